"""Hugging Face checkpoints -> `HybridLM`: Qwen3.5 (`qwen3_5`, `qwen3_5_text`), Qwen3-Next (`qwen3_next`)
and Kimi Linear (`kimi_linear`).

    model = load_checkpoint("path/to/checkpoint")              # config.json + *.safetensors
    config = config_from_hf(json.load(open("config.json")))     # -> HybridConfig
    model = from_state_dict(config, state_dict)                 # numpy arrays or torch tensors

The layer pattern comes from the config's `layer_types` (and Kimi's `mlp_layer_types` or
`first_k_dense_replace`). Either weight layout is read: the files as published (Kimi's separate
`q_conv1d`/`k_conv1d`/`v_conv1d`, one `experts.{e}.w1/w2/w3` per expert) and the layout transformers
holds in memory (one fused `conv1d`, stacked `experts.gate_up_proj` / `experts.down_proj`). The mapping
only transposes, splits and stacks, so it also carries gradients named like the parameters.

Head order: transformers repeats each q/k head over `num_v_heads / num_k_heads` consecutive value
heads (`repeat_interleave`), which is this library's grouped-head convention, so no head is permuted.
Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` hold, per key head, `[q, k, v of its value heads,
z of its value heads]` and `[b, a]`; they are split back into that order.
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention_jax.models.hybrid import HybridConfig, HybridLM

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next", "kimi_linear")
_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.")


def _pick(cfg: dict, *names, default=None):
  for name in names:
    if cfg.get(name) is not None:
      return cfg[name]
  return default


def config_from_hf(hf: dict, **overrides) -> HybridConfig:
  """A transformers config (the dict of its config.json) -> `HybridConfig`; `overrides` replace fields
  (e.g. `impl="chunk"`, `dtype=jnp.bfloat16`)."""
  model_type = hf.get("model_type")
  if model_type == "qwen3_5":  # the vision-language wrapper: its text model
    hf = dict(hf["text_config"], tie_word_embeddings=hf.get(
        "tie_word_embeddings", hf["text_config"].get("tie_word_embeddings", False)))
    model_type = "qwen3_5_text"
  if model_type not in MODEL_TYPES:
    raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
  n = hf["num_hidden_layers"]
  common = dict(vocab_size=hf["vocab_size"], width=hf["hidden_size"],
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
  if model_type in ("qwen3_5_text", "qwen3_next"):
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0
        else "linear_attention" for i in range(n)]
    rope = hf.get("rope_parameters") or {}
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    factor = _pick(rope, "partial_rotary_factor", default=hf.get("partial_rotary_factor", 0.25))
    fields = dict(
        mixers="".join("Q" if t == "full_attention" else "G" for t in types),
        mlps="D" * n, norm_eps=hf["rms_norm_eps"], zero_centered_norm=True,
        num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
        head_dim=head_dim, rotary_dim=int(head_dim * factor),
        rope_theta=_pick(rope, "rope_theta", default=hf.get("rope_theta", 10000.0)),
        linear_num_heads=hf["linear_num_key_heads"], linear_num_v_heads=hf["linear_num_value_heads"],
        linear_head_dim=hf["linear_key_head_dim"], linear_head_v_dim=hf["linear_value_head_dim"],
        conv_size=hf["linear_conv_kernel_dim"], mlp_dim=hf["intermediate_size"])
    if model_type == "qwen3_next" and hf.get("num_experts", 0) > 0:
      step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
      fields.update(
          mlps="".join("E" if i not in dense and (i + 1) % step == 0 else "D" for i in range(n)),
          num_experts=hf["num_experts"], experts_per_token=hf["num_experts_per_tok"],
          expert_dim=hf["moe_intermediate_size"],
          shared_expert_dim=hf.get("shared_expert_intermediate_size", 0), shared_expert_gate=True,
          router="softmax", normalize_expert_weights=bool(hf.get("norm_topk_prob", True)))
  else:
    lin = hf.get("linear_attn_config") or {}
    types = hf.get("layer_types")
    if not types and "kda_layers" in lin:
      full = set(lin.get("full_attn_layers", []))  # 1-indexed
      types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    types = types or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    mlp_types = hf.get("mlp_layer_types") or [
        "dense" if i < hf.get("first_k_dense_replace", 1) else "sparse" for i in range(n)]
    activation = hf.get("moe_router_activation_func", "sigmoid")
    fields = dict(
        mixers="".join("M" if t == "full_attention" else "K" for t in types),
        mlps="".join("E" if t == "sparse" else "D" for t in mlp_types),
        norm_eps=hf["rms_norm_eps"], zero_centered_norm=False,
        num_heads=hf["num_attention_heads"], q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        linear_num_heads=_pick(lin, "num_heads", default=hf.get("linear_num_heads")),
        linear_head_dim=_pick(lin, "head_dim", default=hf.get("linear_head_dim")),
        conv_size=_pick(lin, "short_conv_kernel_size", default=hf.get("linear_conv_kernel_dim", 4)),
        kda_gate_bias=False, mlp_dim=hf["intermediate_size"],
        num_experts=_pick(hf, "num_experts", "num_local_experts", "n_routed_experts", default=0),
        experts_per_token=_pick(hf, "num_experts_per_token", "num_experts_per_tok", default=0),
        expert_dim=hf.get("moe_intermediate_size", 0),
        router="sigmoid" if activation == "sigmoid" else "softmax", expert_score_bias=True,
        expert_groups=_pick(hf, "num_expert_group", "n_group", default=1),
        groups_per_token=_pick(hf, "topk_group", default=1),
        normalize_expert_weights=bool(_pick(hf, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling=float(hf.get("routed_scaling_factor", 1.0)))
    fields["shared_expert_dim"] = fields["expert_dim"] * _pick(
        hf, "num_shared_experts", "n_shared_experts", default=0)
  return HybridConfig(**common, **fields, **overrides)


def _numpy(x) -> np.ndarray:
  if hasattr(x, "detach"):  # a torch tensor (bf16 has no numpy dtype: go through float32)
    x = x.detach().cpu()
    return x.float().numpy() if str(x.dtype) == "torch.bfloat16" else x.numpy()
  return np.asarray(x)


class _Weights:
  """The state dict, prefixes normalised to `model.` / `lm_head.`; records which keys were read."""

  def __init__(self, state_dict):
    self.arrays, self.used = {}, set()
    for key, value in state_dict.items():
      if key.startswith(_IGNORED_PREFIXES):
        continue
      key = key.replace("model.language_model.", "model.", 1)
      self.arrays[key] = value

  def __contains__(self, key):
    return key in self.arrays

  def __call__(self, key) -> np.ndarray:
    if key not in self.arrays:
      raise KeyError(f"the checkpoint has no {key!r}")
    self.used.add(key)
    return _numpy(self.arrays[key])

  def first(self, *keys) -> str:
    """The first of `keys` that the checkpoint holds."""
    for key in keys:
      if key in self.arrays:
        return key
    raise KeyError(f"the checkpoint has none of {keys}")


def _conv_kernels(w: _Weights, prefix: str, sizes) -> list[np.ndarray]:
  """Depthwise conv weights `[C, 1, W]` (one fused or one per stream) -> our `[W, C_i]` kernels."""
  if f"{prefix}.conv1d.weight" in w:
    fused = w(f"{prefix}.conv1d.weight")[:, 0, :]
    parts = np.split(fused, np.cumsum(sizes)[:-1], axis=0)
  else:
    parts = [w(f"{prefix}.{s}_conv1d.weight")[:, 0, :] for s in "qkv"]
  return [p.T for p in parts]


def _swiglu(w, prefix):
  return {"gate": {"kernel": w(f"{prefix}.gate_proj.weight").T},
          "up": {"kernel": w(f"{prefix}.up_proj.weight").T},
          "down": {"kernel": w(f"{prefix}.down_proj.weight").T}}


def _gated_delta_net(w, p, c: HybridConfig, fused_qkvz: bool):
  Hk, Hv, K, V = c.linear_num_heads, c.linear_num_v_heads, c.linear_head_dim, c.linear_head_v_dim
  if fused_qkvz:  # Qwen3-Next: per key head [q K, k K, v G*V, z G*V] and [b G, a G]
    G = Hv // Hk
    qkvz = w(f"{p}.in_proj_qkvz.weight").reshape(Hk, 2 * K + 2 * G * V, -1)
    q, k, v, z = np.split(qkvz, [K, 2 * K, 2 * K + G * V], axis=1)
    ba = w(f"{p}.in_proj_ba.weight").reshape(Hk, 2 * G, -1)
    b, a = ba[:, :G], ba[:, G:]
    q, k, v, z, b, a = (t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a))
  else:  # Qwen3.5: in_proj_qkv = [q, k, v], and z, b, a on their own
    q, k, v = np.split(w(f"{p}.in_proj_qkv.weight"), [Hk * K, 2 * Hk * K], axis=0)
    z, b, a = (w(f"{p}.in_proj_{n}.weight") for n in "zba")
  cq, ck, cv = _conv_kernels(w, p, (Hk * K, Hk * K, Hv * V))
  return {"q_proj": {"kernel": q.T}, "k_proj": {"kernel": k.T}, "v_proj": {"kernel": v.T},
          "q_conv": {"kernel": cq}, "k_conv": {"kernel": ck}, "v_conv": {"kernel": cv},
          "a_proj": {"kernel": a.T}, "b_proj": {"kernel": b.T}, "g_proj": {"kernel": z.T},
          "A_log": w(f"{p}.A_log"), "dt_bias": w(f"{p}.dt_bias"),
          "o_norm": {"weight": w(f"{p}.norm.weight")}, "o_proj": {"kernel": w(f"{p}.out_proj.weight").T}}


def _kda(w, p, c: HybridConfig):
  C = c.linear_num_heads * c.linear_head_dim
  cq, ck, cv = _conv_kernels(w, p, (C, C, C))
  fg = f"{p}.forget_gate" if f"{p}.forget_gate.f_a_proj.weight" in w else p
  out = {"q_proj": {"kernel": w(f"{p}.q_proj.weight").T}, "k_proj": {"kernel": w(f"{p}.k_proj.weight").T},
         "v_proj": {"kernel": w(f"{p}.v_proj.weight").T},
         "q_conv": {"kernel": cq}, "k_conv": {"kernel": ck}, "v_conv": {"kernel": cv},
         "f_down": {"kernel": w(f"{fg}.f_a_proj.weight").T}, "f_up": {"kernel": w(f"{fg}.f_b_proj.weight").T},
         "A_log": w(f"{fg}.A_log").reshape(-1), "dt_bias": w(f"{fg}.dt_bias").reshape(-1),
         "b_proj": {"kernel": w(f"{p}.b_proj.weight").T},
         "g_down": {"kernel": w(f"{p}.g_a_proj.weight").T}, "g_up": {"kernel": w(f"{p}.g_b_proj.weight").T},
         "o_norm": {"weight": w(f"{p}.o_norm.weight")}, "o_proj": {"kernel": w(f"{p}.o_proj.weight").T}}
  if f"{p}.g_b_proj.bias" in w:
    out["g_up"]["bias"] = w(f"{p}.g_b_proj.bias")
  return out


def _gated_attention(w, p, c: HybridConfig):
  H, D = c.num_heads, c.head_dim
  qg = w(f"{p}.q_proj.weight").reshape(H, 2 * D, -1)  # per head [q D, gate D]
  q, g = qg[:, :D].reshape(H * D, -1), qg[:, D:].reshape(H * D, -1)
  return {"q_proj": {"kernel": q.T}, "g_proj": {"kernel": g.T},
          "k_proj": {"kernel": w(f"{p}.k_proj.weight").T}, "v_proj": {"kernel": w(f"{p}.v_proj.weight").T},
          "o_proj": {"kernel": w(f"{p}.o_proj.weight").T},
          "q_norm": {"weight": w(f"{p}.q_norm.weight")}, "k_norm": {"weight": w(f"{p}.k_norm.weight")}}


def _mla(w, p, c: HybridConfig):
  out = {"kv_a_proj": {"kernel": w(f"{p}.kv_a_proj_with_mqa.weight").T},
         "kv_a_norm": {"weight": w(f"{p}.kv_a_layernorm.weight")},
         "kv_b_proj": {"kernel": w(f"{p}.kv_b_proj.weight").T},
         "o_proj": {"kernel": w(f"{p}.o_proj.weight").T}}
  if c.q_lora_rank is None:
    out["q_proj"] = {"kernel": w(f"{p}.q_proj.weight").T}
  else:
    out.update(q_a_proj={"kernel": w(f"{p}.q_a_proj.weight").T},
               q_a_norm={"weight": w(f"{p}.q_a_layernorm.weight")},
               q_b_proj={"kernel": w(f"{p}.q_b_proj.weight").T})
  return out


def _moe(w, p, c: HybridConfig):
  E, I = c.num_experts, c.expert_dim
  if f"{p}.experts.gate_up_proj" in w:  # stacked: [E, 2I, d] and [E, d, I]
    gate_up, down = w(f"{p}.experts.gate_up_proj"), w(f"{p}.experts.down_proj")
    gate, up = gate_up[:, :I], gate_up[:, I:]
  else:  # one module per expert: w1/w3/w2 (Kimi) or gate_proj/up_proj/down_proj (Qwen)
    names = ("w1", "w3", "w2") if f"{p}.experts.0.w1.weight" in w else ("gate_proj", "up_proj", "down_proj")
    gate, up, down = (np.stack([w(f"{p}.experts.{e}.{n}.weight") for e in range(E)]) for n in names)
  out = {"router": w(f"{p}.gate.weight").T, "gate": gate.transpose(0, 2, 1),
         "up": up.transpose(0, 2, 1), "down": down.transpose(0, 2, 1)}
  if c.expert_score_bias:
    out["score_bias"] = w(f"{p}.gate.e_score_correction_bias")
  if c.shared_expert_dim:
    out["shared"] = _swiglu(w, w.first(f"{p}.shared_experts.gate_proj.weight",
                                       f"{p}.shared_expert.gate_proj.weight").rsplit(".", 2)[0])
  if c.shared_expert_gate:
    out["shared_gate"] = {"kernel": w(f"{p}.shared_expert_gate.weight").T}
  return out


def params_from_state_dict(config: HybridConfig, state_dict, model_type: str) -> dict:
  """The nested parameter dict of `HybridLM(config)` from a transformers state dict (see the module
  docstring); raises `KeyError` for a missing weight and `ValueError` for unread ones."""
  w = _Weights(state_dict)
  blocks = {}
  for i, (mixer, mlp) in enumerate(zip(config.mixers, config.mlps)):
    p = f"model.layers.{i}"
    if mixer == "G":
      mix = _gated_delta_net(w, f"{p}.linear_attn", config, fused_qkvz=model_type == "qwen3_next")
    elif mixer == "Q":
      mix = _gated_attention(w, f"{p}.self_attn", config)
    elif mixer == "K":
      mix = _kda(w, f"{p}.self_attn", config)
    else:
      mix = _mla(w, f"{p}.self_attn", config)
    m = f"{p}.block_sparse_moe" if f"{p}.block_sparse_moe.gate_proj.weight" in w or any(
        k.startswith(f"{p}.block_sparse_moe.") for k in w.arrays) else f"{p}.mlp"
    blocks[i] = {"mixer_norm": {"weight": w(f"{p}.input_layernorm.weight")}, "mixer": mix,
                 "mlp_norm": {"weight": w(f"{p}.post_attention_layernorm.weight")},
                 "mlp": _swiglu(w, m) if mlp == "D" else _moe(w, m, config)}
  params = {"embed": {"embedding": w("model.embed_tokens.weight")}, "blocks": blocks,
            "final_norm": {"weight": w("model.norm.weight")}}
  if not config.tie_embeddings:
    params["lm_head"] = {"kernel": w("lm_head.weight").T}
  unread = sorted(set(w.arrays) - w.used - {"lm_head.weight"})
  if unread:
    raise ValueError(f"{len(unread)} checkpoint weights have no place in the model: {unread[:8]}")
  return params


def from_state_dict(config: HybridConfig, state_dict, model_type: str) -> HybridLM:
  """A `HybridLM` holding the weights of `state_dict` (parameters in `config.param_dtype`)."""
  model = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0)))
  params = params_from_state_dict(config, state_dict, model_type)
  graphdef, state = nnx.split(model)
  flat = dict(nnx.to_flat_state(state))
  filled = set()

  def visit(tree, path):
    for key, value in tree.items():
      if isinstance(value, dict):
        visit(value, path + (key,))
        continue
      target = path + (key,)
      if target not in flat:
        raise ValueError(f"the model has no parameter {'.'.join(map(str, target))}")
      var = flat[target]
      if tuple(value.shape) != tuple(var.shape):
        raise ValueError(f"{'.'.join(map(str, target))}: checkpoint shape {value.shape}, model "
                         f"shape {var.shape}")
      flat[target] = var.replace(jnp.asarray(value, var.dtype))
      filled.add(target)

  visit(params, ())
  missing = [".".join(map(str, k)) for k, v in flat.items()
             if k not in filled and isinstance(v, nnx.Param)]
  if missing:
    raise ValueError(f"parameters the checkpoint does not set: {missing[:8]}")
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """The tensors of one `.safetensors` file as NumPy arrays (bf16 as `ml_dtypes.bfloat16`)."""
  import ml_dtypes
  dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
            "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
            "BOOL": np.bool_}
  with open(path, "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
    data = f.read()
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    begin, end = info["data_offsets"]
    out[name] = np.frombuffer(data[begin:end], dtypes[info["dtype"]]).reshape(info["shape"])
  return out


def load_checkpoint(directory: str, **overrides) -> HybridLM:
  """A `HybridLM` from a local checkpoint directory (config.json and model*.safetensors, one file or shards);
  `overrides` replace `HybridConfig` fields (e.g. `impl="chunk"`, `param_dtype=jnp.bfloat16`)."""
  with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
    hf = json.load(f)
  files = sorted(glob.glob(os.path.join(directory, "model*.safetensors")))
  if not files:
    raise ValueError(f"{directory} holds no model*.safetensors files")
  state_dict = {}
  for path in files:
    state_dict.update(read_safetensors(path))
  model_type = "qwen3_5_text" if hf.get("model_type") == "qwen3_5" else hf.get("model_type")
  return from_state_dict(config_from_hf(hf, **overrides), state_dict, model_type)
