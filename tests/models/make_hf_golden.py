"""Writes the golden files of tests/models/test_hf.py: tiny random Hugging Face hybrids run by transformers.

Needs torch, transformers (>= 5) and safetensors, which the test suite does not install; run it in a
separate environment and commit what it writes (about 0.5 MB in all):

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch transformers safetensors numpy
    /tmp/hfenv/bin/python tests/models/make_hf_golden.py

For each model in `CONFIGS` it writes `tests/models/hf_golden/<name>/`:
  config.json, model.safetensors   the checkpoint as `save_pretrained` writes it (float32)
  golden.npz                       tokens `[B, T]`, full-forward logits `[B, T, vocab]`, the logits of a
                                   prefill of `PREFILL` tokens followed by one-token decode steps, and the
                                   next-token loss
  grads.safetensors                d loss / d parameter for every parameter, under the checkpoint's names
  versions.json                    the transformers, torch and Python versions and this command

The weights are random and larger than transformers' initialisation (std fan_in^-1/2, norm weights
away from their identity values, a non-zero expert-score bias) so every parameter moves the logits.
They are rounded to float32, then the model runs in float64 (transformers' pure-torch fallbacks keep
the delta-rule recurrences in float32): logits, decode logits and gradients are that float64 run's.
"""

from __future__ import annotations

import json
import os
import platform
import sys

import numpy as np
import safetensors.torch
import torch
import transformers

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_golden")
B, T, PREFILL, SEED = 2, 12, 5, 0

CONFIGS = {
    # Gated DeltaNet (2 key heads, 4 value heads, K != V) then gated attention (GQA, partial RoPE),
    # tied embeddings.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))),
    # KDA, MLA (no RoPE, no q LoRA), KDA; a dense MLP first, then MoE (4 experts, top 2, 2 groups of
    # which 1 is kept, one shared expert).
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.446, norm_topk_prob=True, linear_num_heads=2, linear_head_dim=8,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=1, eos_token_id=2)),  # no padding row: it would get no gradient
    # Gated DeltaNet with its fused, per-key-head interleaved in_proj_qkvz / in_proj_ba, gated attention,
    # then a softmax-routed MoE with a sigmoid-gated shared expert.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[0],
        norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))),
}


def randomize(model: torch.nn.Module, generator: torch.Generator):
  """Every parameter random and float32-representable; decay parameters keep their initialisation."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(("A_log", "dt_bias")):
        continue
      noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
      if p.ndim >= 2:
        p.copy_(noise * p.shape[-1] ** -0.5)
      else:
        p.copy_(p + 0.2 * noise)
    for name, buf in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        buf.copy_(0.1 * torch.randn(buf.shape, generator=generator, dtype=torch.float64))
    for t in list(model.parameters()) + list(model.buffers()):
      t.copy_(t.float().to(t.dtype))


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
  return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           tokens[:, 1:].reshape(-1))


def make(name: str):
  config_cls, model_cls, fields = CONFIGS[name]
  config = getattr(transformers, config_cls)(**fields)
  config._attn_implementation = "eager"
  config._experts_implementation = "eager"  # the per-expert loop (grouped_mm has no float64)
  torch.manual_seed(SEED)
  model = getattr(transformers, model_cls)(config).eval()
  randomize(model, torch.Generator().manual_seed(SEED))
  out = os.path.join(HERE, name)
  os.makedirs(out, exist_ok=True)
  model.save_pretrained(out, safe_serialization=True)
  for extra in ("generation_config.json",):
    if os.path.exists(os.path.join(out, extra)):
      os.remove(os.path.join(out, extra))

  model = model.double()
  tokens = torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(SEED))
  logits = model(tokens).logits
  loss = next_token_loss(logits, tokens)
  loss.backward()
  grads = {k: p.grad.float().contiguous() for k, p in model.named_parameters() if p.grad is not None}
  tied = getattr(config, "tie_word_embeddings", False)
  if tied:  # save_pretrained drops the tied head; its gradient is already the embedding's
    grads.pop("lm_head.weight", None)
  safetensors.torch.save_file(grads, os.path.join(out, "grads.safetensors"))

  with torch.no_grad():
    step = model(tokens[:, :PREFILL], use_cache=True)
    cache, decoded = step.past_key_values, [step.logits]
    for t in range(PREFILL, T):
      step = model(tokens[:, t:t + 1], past_key_values=cache, use_cache=True)
      cache = step.past_key_values
      decoded.append(step.logits)
  decode_logits = torch.cat(decoded, dim=1)
  err = float((decode_logits - logits).norm() / logits.norm())
  print(f"{name}: transformers' own prefill + decode vs forward, relative error {err:.2e}")
  np.savez(os.path.join(out, "golden.npz"), tokens=tokens.numpy().astype(np.int32),
           logits=logits.detach().float().numpy(), decode_logits=decode_logits.float().numpy(),
           loss=np.float32(loss.item()), prefill=np.int32(PREFILL))
  versions = dict(transformers=transformers.__version__, torch=torch.__version__,
                  python=platform.python_version(), model_type=config.model_type,
                  command="python tests/models/make_hf_golden.py " + " ".join(sys.argv[1:]),
                  reference="float64 forward and backward (delta-rule recurrences in float32), "
                            "float32 weights")
  with open(os.path.join(out, "versions.json"), "w", encoding="utf-8") as f:
    json.dump(versions, f, indent=1)


if __name__ == "__main__":
  for model_name in (sys.argv[1:] or CONFIGS):
    make(model_name)
