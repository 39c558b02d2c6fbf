"""The seven variants: each sets gates, feature maps and scale, then calls one of the two families.

Every variant takes `q, k: [B, T, H, K]`, `v: [B, T, H_v, V]` (`H_v % H == 0`; q/k head h serves value
heads `h * H_v / H ... (h + 1) * H_v / H - 1`), its gates, and the common keywords:

  scale: read-out scale, default `K ** -0.5`.
  initial_state: `[B, H_v, K, V]` (`[N, H_v, K, V]` with `cu_seqlens`), any float dtype, used as float32.
  output_final_state: return the state after the last token (float32, same shape); else None.
  segment_ids: `[B, T]` int; the state restarts from zero wherever the id changes along T.
  cu_seqlens: `[N + 1]` int offsets of N packed sequences along T, with B == 1.
  impl: "recurrent" (lax.scan reference), "chunk" (chunked XLA form), "pallas" (kernel) or "auto".
  chunk_size: chunk length of the chunked form, a positive power of two.

Each returns `(o, final_state)` with `o: [B, T, H_v, V]` in v's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention_jax.ops import checks
from linear_attention_jax.ops.chunk import chunk_form
from linear_attention_jax.ops.dispatch import (gate_for, pallas_form, pallas_reason,  # noqa: F401
                                               scan_forward_chunk_derivatives, select_impl)
from linear_attention_jax.ops.feature_maps import l2_normalize, resolve_feature_map
from linear_attention_jax.ops.packing import Packing, from_cu_seqlens, from_segment_ids
from linear_attention_jax.ops.recurrent import recurrent_form
from linear_attention_jax.pallas_kernels import common as kernel_common
from linear_attention_jax.pallas_kernels import gate as kernel_gate


def _expand_heads(x, Hv):
  return x if x.shape[2] == Hv else jnp.repeat(x, Hv // x.shape[2], axis=2)


def _family(variant, q, k, v, g, beta, *, scale, initial_state, output_final_state, segment_ids,
            cu_seqlens, impl, chunk_size, gated=False, delta=False, per_channel=False, qk_map=None,
            v_extra=0, gate=None):
  """Checks the call, runs the chosen form of the family (beta None: additive; else delta).

  `gated` / `delta`: the variant takes g / beta, so None there is an error.

  `qk_map` is applied to q and k in float32 (feature maps, l2 norm). `v_extra` columns of ones are
  appended to v (the linear-attention normaliser), so the state is `[.., K, V + v_extra]`.
  `gate`: None, or a `pallas_kernels.gate.Gate` whose pre-activation g is (the GPU's kernels take it
  into their cumsum walks; every other form takes its values first).
  Returns the float32 output `[B, T, H_v, V + v_extra]` and the final state or None.
  """
  checks.check_static(output_final_state=output_final_state)
  if isinstance(cu_seqlens, (list, tuple)) or isinstance(cu_seqlens, np.ndarray):
    cu_seqlens = np.asarray(cu_seqlens)  # lists and NumPy arrays as well as jax arrays
  if isinstance(segment_ids, (list, tuple)):
    segment_ids = np.asarray(segment_ids)
  B, T, H, K, Hv, V = checks.check_qkv(q, k, v)
  checks.check_options(impl=impl, chunk_size=chunk_size, scale=scale)
  if gated:
    checks.check_gate("g", g, B, T, Hv, K, per_channel=per_channel)
  if delta:
    checks.check_gate("beta", beta, B, T, Hv, K, per_channel=False)
  N = checks.check_packing(segment_ids, cu_seqlens, B, T)
  checks.check_initial_state(initial_state, B if N is None else N, Hv, K, V, v_extra=v_extra,
                             rows_name="B" if N is None else "N")
  packing_kind = "segments" if segment_ids is not None else ("none" if cu_seqlens is None else "cu_seqlens")
  compute_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)  # the kernel's matmul dtype
  form = select_impl(impl, variant, T=T, K=K, V=V + v_extra, chunk_size=chunk_size, packing=packing_kind,
                     dtype=compute_dtype, sharded=kernel_common.explicitly_sharded(q, k, v),
                     v_extra=v_extra, delta=delta)
  if gate is not None:
    kind = kernel_gate.check(g, gate.A_log, gate.dt_bias, gate.kind, Hv, K)
    gate = kernel_gate.Gate(gate.A_log, gate.dt_bias, kind)
    if form != "pallas":
      g, gate = gate.values(g), None

  if B == 0 or T == 0:  # nothing to run: empty outputs, and the initial state (or zeros) as final
    rows = B if N is None else N
    final = (jnp.zeros((rows, Hv, K, V + v_extra), jnp.float32) if initial_state is None
             else jnp.asarray(initial_state, jnp.float32))
    return jnp.zeros((B, T, Hv, V + v_extra), jnp.float32), (final if output_final_state else None)
  scale = K ** -0.5 if scale is None else scale
  q_raw, k_raw = _expand_heads(q.astype(jnp.float32), Hv), _expand_heads(k.astype(jnp.float32), Hv)
  mapped = lambda: (q_raw, k_raw) if qk_map is None else (qk_map(q_raw), qk_map(k_raw))
  v32 = v.astype(jnp.float32)
  if v_extra:
    v32 = jnp.concatenate([v32, jnp.ones(v32.shape[:-1] + (v_extra,), jnp.float32)], axis=-1)
  g32 = None if g is None else g.astype(jnp.float32)
  b32 = None if beta is None else beta.astype(jnp.float32)
  h0 = None if initial_state is None else jnp.asarray(initial_state, jnp.float32)
  if segment_ids is not None:
    packing = from_segment_ids(segment_ids)
  elif cu_seqlens is not None:
    packing = from_cu_seqlens(cu_seqlens)
  else:
    packing = Packing()

  if form == "pallas":
    # the backend decides where q, k are l2-normalised (`qk_l2norm`) and where they are cast to the
    # matmul dtype (the inputs' own: exact for raw inputs)
    l2 = qk_map is l2_normalize
    q_in, k_in = (q_raw, k_raw) if l2 else mapped()
    o, final = pallas_form(q_in, k_in, v32, gate_for(form, g32) if gate is None else g, b32, scale=scale,
                           initial_state=h0, segment_ids=segment_ids, chunk_size=chunk_size,
                           compute_dtype=compute_dtype, qk_l2norm=l2, v_extra=v_extra, mapped_qk=mapped,
                           packing=packing, gate=gate)
  elif form == "recurrent" and impl == "auto":  # the scan forward, the chunked form's derivatives
    scan = lambda *x: recurrent_form(*x[:5], scale=scale, initial_state=x[5], packing=packing)
    chunk = lambda q, k, v, g, b, h0: chunk_form(q, k, v, gate_for("chunk", g), b, scale=scale,
                                                 initial_state=h0, packing=packing, chunk_size=chunk_size)
    o, final = scan_forward_chunk_derivatives(scan, chunk)(*mapped(), v32, g32, b32, h0)
  elif form == "recurrent":
    o, final = recurrent_form(*mapped(), v32, g32, b32, scale=scale, initial_state=h0, packing=packing)
  else:
    o, final = chunk_form(*mapped(), v32, gate_for(form, g32), b32, scale=scale, initial_state=h0,
                          packing=packing, chunk_size=chunk_size)
  return o, (final if output_final_state else None)


def linear_attention(q, k, v, *, feature_map="elu_plus_one", normalize=True, eps=1e-6, scale=None,
                     initial_state=None, output_final_state=False, segment_ids=None, cu_seqlens=None,
                     impl="auto", chunk_size=64):
  """Kernel linear attention (Katharopoulos et al. 2020): no decay, q and k through `feature_map`.

  `S_t = S_{t-1} + phi(k_t) v_t^T`, `o_t = scale * S_t^T phi(q_t)`. With `normalize=True` the output is
  divided by `scale * phi(q_t)^T z_t + eps` with `z_t = sum_{j<=t} phi(k_j)`; z rides along as one extra
  value column, so the state (initial and final) is `[B, H_v, K, V + 1]`, its last column z.
  `feature_map`: "elu_plus_one", "relu", "identity", "silu", or a callable on `[..., K]`.
  """
  checks.check_static(normalize=normalize)
  phi = resolve_feature_map(feature_map)
  o, final = _family("linear_attention", q, k, v, None, None, qk_map=phi, v_extra=int(normalize),
                     scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     segment_ids=segment_ids, cu_seqlens=cu_seqlens, impl=impl, chunk_size=chunk_size)
  if normalize:
    o = o[..., :-1] / (o[..., -1:] + eps)
  return o.astype(v.dtype), final


def retention_log_gamma(gamma, Hv: int):
  """`log(gamma)` per value head `[H_v]`; gamma None gives RetNet's `1 - 2 ** (-5 - h)`."""
  if gamma is None:
    gamma = 1.0 - 2.0 ** (-5.0 - jnp.arange(Hv, dtype=jnp.float32))
  gamma = jnp.asarray(gamma, jnp.float32)
  if gamma.ndim == 0:
    gamma = jnp.full((Hv,), gamma)
  if gamma.shape != (Hv,):
    raise ValueError(f"gamma must be a float or have shape [H_v] = ({Hv},); got {gamma.shape}")
  concrete = checks._concrete(gamma)
  if concrete is not None and not ((concrete > 0) & (concrete <= 1)).all():
    raise ValueError(f"gamma must lie in (0, 1]; got {concrete.tolist()}")
  return jnp.log(gamma)


def retention(q, k, v, *, gamma=None, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, cu_seqlens=None, impl="auto", chunk_size=64):
  """RetNet retention (Sun et al. 2023): a constant decay gamma per value head.

  `gamma`: None (RetNet's `1 - 2 ** (-5 - h)` for head h), a float, or `[H_v]`.
  """
  B, T, _, _, Hv, _ = checks.check_qkv(q, k, v)
  g = jnp.broadcast_to(retention_log_gamma(gamma, Hv), (B, T, Hv))
  o, final = _family("retention", q, k, v, g, None, gated=True, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, segment_ids=segment_ids,
                     cu_seqlens=cu_seqlens, impl=impl, chunk_size=chunk_size)
  return o.astype(v.dtype), final


def simple_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
               segment_ids=None, cu_seqlens=None, impl="auto", chunk_size=64):
  """Scalar-gated linear attention: `g: [B, T, H_v]` natural-log decay per head and token."""
  o, final = _family("simple_gla", q, k, v, g, None, gated=True, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, segment_ids=segment_ids,
                     cu_seqlens=cu_seqlens, impl=impl, chunk_size=chunk_size)
  return o.astype(v.dtype), final


def gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, segment_ids=None,
        cu_seqlens=None, impl="auto", chunk_size=64):
  """Gated linear attention (Yang et al. 2024): `g: [B, T, H_v, K]` log-decay per key channel.

  The GPU's kernels take `g <= 0` only (README, "Non-finite inputs"); the recurrent and chunk forms
  take any g.
  """
  o, final = _family("gla", q, k, v, g, None, gated=True, per_channel=True, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state,
                     segment_ids=segment_ids, cu_seqlens=cu_seqlens, impl=impl, chunk_size=chunk_size)
  return o.astype(v.dtype), final


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               segment_ids=None, cu_seqlens=None, impl="auto", chunk_size=64, use_qk_l2norm=False):
  """DeltaNet: `beta: [B, T, H_v]` write strength; no decay.

  `use_qk_l2norm`: l2-normalise q and k per head first (keeps `I - beta k k^T` a contraction).
  """
  o, final = _family("delta_rule", q, k, v, None, beta, delta=True,
                     qk_map=l2_normalize if checks.check_static(use_qk_l2norm=use_qk_l2norm) is None
                     and use_qk_l2norm else None, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state,
                     segment_ids=segment_ids, cu_seqlens=cu_seqlens, impl=impl, chunk_size=chunk_size)
  return o.astype(v.dtype), final


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     segment_ids=None, cu_seqlens=None, impl="auto", chunk_size=64,
                     use_qk_l2norm=False):
  """Gated DeltaNet (Yang et al. 2025): scalar decay `g: [B, T, H_v]`, `beta: [B, T, H_v]`."""
  o, final = _family("gated_delta_rule", q, k, v, g, beta, gated=True, delta=True,
                     qk_map=l2_normalize if checks.check_static(use_qk_l2norm=use_qk_l2norm) is None
                     and use_qk_l2norm else None, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state,
                     segment_ids=segment_ids, cu_seqlens=cu_seqlens, impl=impl, chunk_size=chunk_size)
  return o.astype(v.dtype), final


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        segment_ids=None, cu_seqlens=None, impl="auto", chunk_size=64, use_qk_l2norm=False, A_log=None,
        dt_bias=None, gate_lower_bound=None):
  """Kimi Delta Attention (arXiv 2510.26692): per-channel decay `g: [B, T, H_v, K]`, `beta: [B, T, H_v]`.

  The GPU's kernels take `g <= 0` only (README, "Non-finite inputs"); the recurrent and chunk forms
  take any g.

  With `A_log: [H_v]` and `dt_bias: [H_v * K]`, g is the gate's pre-activation f and the decay is
  Kimi Linear's `-exp(A_log) * softplus(f + dt_bias)`, or with `gate_lower_bound=lb` (in [-5, 0)) the
  bounded `lb * sigmoid(exp(A_log) * (f + dt_bias))`; the op is differentiable in f, A_log and dt_bias.
  The GPU's kernels compute the gate inside their cumsum walks (neither g nor its cotangent is
  written); every other form computes it first (`pallas_kernels.gate.values`).
  """
  gate = kernel_gate.from_args(A_log, dt_bias, gate_lower_bound)
  o, final = _family("kda", q, k, v, g, beta, gated=True, delta=True, per_channel=True, gate=gate,
                     qk_map=l2_normalize if checks.check_static(use_qk_l2norm=use_qk_l2norm) is None
                     and use_qk_l2norm else None, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state,
                     segment_ids=segment_ids, cu_seqlens=cu_seqlens, impl=impl, chunk_size=chunk_size)
  return o.astype(v.dtype), final
