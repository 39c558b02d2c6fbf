"""Converted Hugging Face hybrids against transformers: tiny random Qwen3.5, Kimi Linear and Qwen3-Next
checkpoints with the logits and gradients transformers computed for them (tests/models/hf_golden/,
written by tests/models/make_hf_golden.py; torch is not needed here).

Given a checkpoint directory, when `models.hf.load_checkpoint` converts it and the model runs the
golden tokens, then its logits (full forward, and prefill + one-token decode with the caches) match
transformers' float64 run to float32 precision with impl="recurrent" and impl="chunk", and the
gradient of the next-token loss matches transformers' float64 gradient, parameter by parameter.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from linear_attention_jax.models import hf
from tests.layers.util import call, decode_tokens, fast_jit, rel_rms

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_golden")
MODELS = ("qwen3_5", "kimi_linear", "qwen3_next")
CHUNK = 8  # T = 12: a full chunk and a padded one


@functools.lru_cache(maxsize=None)
def golden(name):
  with np.load(os.path.join(GOLDEN, name, "golden.npz")) as g:
    return {k: g[k] for k in g.files}


def load(name, impl):
  return hf.load_checkpoint(os.path.join(GOLDEN, name), impl=impl, chunk_size=CHUNK)


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, impl):
  g = golden(name)
  model, tokens = load(name, impl), jnp.asarray(g["tokens"])
  # Full forward
  logits, _ = call(model, tokens, None)
  err = rel_rms(logits, g["logits"])
  # Prefill, then one token at a time
  P, (B, T) = int(g["prefill"]), tokens.shape
  head, cache = call(model, tokens[:, :P], model.init_cache(B, T))
  tail, cache = decode_tokens(model, tokens, cache, start=P)
  err_decode = rel_rms(jnp.concatenate([head, tail], axis=1), g["decode_logits"])
  print(f"{name} impl={impl}: forward rel RMS error {err:.2e}, prefill {P} + decode {T - P} "
        f"{err_decode:.2e} (against transformers, float64)")
  assert err <= 1e-4 and err_decode <= 1e-4
  assert int(cache.pos) == T


def _loss(graphdef, params, rest, tokens):
  logits, _ = nnx.merge(graphdef, params, rest)(tokens)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]))


_grad = fast_jit(jax.value_and_grad(_loss, argnums=1), static_argnums=0)


@pytest.mark.parametrize("name", MODELS)
def test_gradients_match_transformers_float64(name):
  # Given the converted model (recurrent form: the cheaper backward to compile) and transformers' float64 gradient,
  # converted to our parameter tree by the same mapping as the weights
  g = golden(name)
  model = load(name, "recurrent")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss, grads = _grad(graphdef, params, rest, jnp.asarray(g["tokens"]))
  ref_sd = hf.read_safetensors(os.path.join(GOLDEN, name, "grads.safetensors"))
  for key, bias in hf.read_safetensors(os.path.join(GOLDEN, name, "model.safetensors")).items():
    if key.endswith("e_score_correction_bias"):  # a buffer in transformers: no gradient
      ref_sd[key.replace("block_sparse_moe", "mlp")] = np.zeros_like(bias)
  ref = hf.params_from_state_dict(model.config, ref_sd, _model_type(name))
  ours = nnx.to_pure_dict(grads)
  flat_ref = dict(jax.tree_util.tree_flatten_with_path(ref)[0])
  flat_ours = {path: v for path, v in jax.tree_util.tree_flatten_with_path(ours)[0]}
  # Then every gradient is finite and the whole gradient matches
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in flat_ours.values())
  keys = sorted(flat_ref, key=str)
  assert len(keys) == len(flat_ours)
  ref_vec = np.concatenate([np.ravel(flat_ref[k]) for k in keys])
  our_vec = np.concatenate([np.ravel(flat_ours[_match(flat_ours, k)]) for k in keys])
  err = float(np.linalg.norm(our_vec - ref_vec) / np.linalg.norm(ref_vec))
  worst = max((float(np.linalg.norm(flat_ours[_match(flat_ours, k)] - flat_ref[k]) /
                     max(np.linalg.norm(flat_ref[k]), 1e-30)), jax.tree_util.keystr(k))
              for k in keys if np.linalg.norm(flat_ref[k]) > 1e-6)
  print(f"{name}: loss {float(loss):.6f} (transformers {float(g['loss']):.6f}); gradient rel error "
        f"{err:.2e} over {len(keys)} parameters, worst {worst[0]:.2e} at {worst[1]}")
  assert abs(float(loss) - float(g["loss"])) <= 1e-5 * abs(float(g["loss"]))
  assert err <= 1e-4 and worst[0] <= 1e-3


def _model_type(name):
  return "qwen3_5_text" if name == "qwen3_5" else name


def _match(flat, path):
  """Our flattened path for a reference path (integer block keys vs their string form)."""
  as_str = jax.tree_util.keystr(path)
  for p in flat:
    if jax.tree_util.keystr(p).replace("'", "") == as_str.replace("'", ""):
      return p
  raise KeyError(as_str)


@pytest.mark.parametrize("name", MODELS)
def test_golden_files_record_their_versions(name):
  with open(os.path.join(GOLDEN, name, "versions.json"), encoding="utf-8") as f:
    versions = json.load(f)
  with open(os.path.join(GOLDEN, name, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  assert int(versions["transformers"].split(".")[0]) >= 5 and versions["torch"]
  assert versions["transformers"] == config["transformers_version"]
  assert versions["model_type"] == config["model_type"] and "make_hf_golden.py" in versions["command"]


def test_config_from_hf_reads_the_layer_pattern():
  qwen = hf.config_from_hf(json.load(open(os.path.join(GOLDEN, "qwen3_5", "config.json"))))
  kimi = hf.config_from_hf(json.load(open(os.path.join(GOLDEN, "kimi_linear", "config.json"))))
  nxt = hf.config_from_hf(json.load(open(os.path.join(GOLDEN, "qwen3_next", "config.json"))))
  assert (qwen.mixers, qwen.mlps, qwen.rotary_dim, qwen.tie_embeddings) == ("GQ", "DD", 4, True)
  assert (kimi.mixers, kimi.mlps, kimi.expert_groups, kimi.shared_expert_dim) == ("KMK", "DEE", 2, 16)
  assert (nxt.mixers, nxt.mlps, nxt.router, nxt.shared_expert_gate) == ("GQ", "DE", "softmax", True)
  # The vision-language wrapper's config gives its text model's
  wrapped = {"model_type": "qwen3_5", "text_config": json.load(
      open(os.path.join(GOLDEN, "qwen3_5", "config.json")))}
  assert hf.config_from_hf(wrapped) == qwen
  with pytest.raises(ValueError, match="model_type"):
    hf.config_from_hf({"model_type": "llama"})


def test_train_config_takes_a_converted_checkpoint():
  # experiments/train.py fine-tunes a checkpoint named by hf_checkpoint (the run itself is exercised
  # by hand: a 3-step run costs ~40 s of compilation on 2 cores)
  from experiments.train import TrainConfig
  config = TrainConfig(hf_checkpoint=os.path.join(GOLDEN, "kimi_linear"),
                       model=dict(impl="chunk", chunk_size=CHUNK))
  model_config = config.lm_config(vocab_size=64)
  assert (model_config.mixers, model_config.impl, model_config.chunk_size) == ("KMK", "chunk", CHUNK)
  with pytest.raises(ValueError, match="exceeds the checkpoint"):
    config.lm_config(vocab_size=256)
