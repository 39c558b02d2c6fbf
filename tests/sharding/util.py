"""Inputs, references and error measures for the sharding tests (float32 throughout)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention_jax import ops
from tests.ops.conftest import FAMILY  # variant -> (gate kind, has beta)

TOL = 1e-5  # relative RMS error, float32

# Tiny shapes: XLA's CPU compile time dominates, and its optimisation level does not change results.
FAST_OPTIONS = {"xla_backend_optimization_level": 0}
fast_jit = functools.partial(jax.jit, compiler_options=FAST_OPTIONS)


def rel_rms(out, ref) -> float:
  """`rms(out - ref) / rms(ref)` in float64."""
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  return float(np.sqrt(np.mean((out - ref) ** 2) / max(np.mean(ref ** 2), 1e-300)))


def inputs(variant, *, B=2, T=48, H=2, Hv=4, K=8, V=12, seed=0):
  """`(args, h0)`: the op's positional arrays (q, k, v, gates...) and an initial state, float32.

  Keys are unit-norm for the delta family; gates are log_sigmoid(N(0, 1) + 2), some strong.
  Normalised linear attention's state has a normaliser column (V + 1), kept positive.
  """
  rng = np.random.default_rng(seed)
  gate, has_beta = FAMILY[variant]
  q = rng.normal(size=(B, T, H, K))
  k = rng.normal(size=(B, T, H, K))
  k = k / np.linalg.norm(k, axis=-1, keepdims=True) if has_beta else 0.5 * k
  args = [q, k, rng.normal(size=(B, T, Hv, V))]
  if gate is not None:
    shape = (B, T, Hv) if gate == "scalar" else (B, T, Hv, K)
    g = -np.logaddexp(0.0, -(rng.normal(size=shape) + 2.0))
    g[:, ::7] -= 5.0  # a few strong decays
    args.append(g)
  if has_beta:
    args.append(1 / (1 + np.exp(-rng.normal(size=(B, T, Hv)))))
  h0 = rng.normal(size=(B, Hv, K, V))
  if variant == "linear_attention":
    h0 = np.concatenate([h0, np.abs(rng.normal(size=(B, Hv, K, 1))) + 1.0], axis=-1)
  return [jnp.asarray(a, jnp.float32) for a in args], jnp.asarray(h0, jnp.float32)


def segment_ids(B, T, seed=0):
  """`[B, T]` ids with changes on and off shard boundaries, a segment spanning several shards, and
  an id reused after another (the state restarts wherever the id changes)."""
  ids = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = [T // 2, T // 2 + 7] if b % 2 == 0 else [5, 3 * T // 4]
    for c in cuts:
      ids[b, c:] += 1
    if b % 2:
      ids[b, 3 * T // 4:] = ids[b, 0]
  return jnp.asarray(ids)


def loss_and_grads(fn, args, h0, **kwargs):
  """`((o, final), grads of a random projection of both w.r.t. args and h0)`, jitted; with `h0` None
  the op runs without states and `final` is None."""

  def loss(args, h0):
    if h0 is None:
      o, final = fn(*args, **kwargs)[0], None
    else:
      o, final = fn(*args, initial_state=h0, output_final_state=True, **kwargs)
    total = jnp.sum(o * jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape))
    if final is not None:
      total += jnp.sum(final * jnp.sin(jnp.arange(final.size, dtype=jnp.float32)).reshape(final.shape))
    return total, (o, final)

  (_, outs), grads = fast_jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(args, h0)
  return outs, grads


def compare(fn, ref_fn, args, h0, **kwargs) -> dict[str, float]:
  """Relative RMS errors of `fn` against `ref_fn`: output, final state and every gradient (h0 None:
  no states)."""
  (o, final), grads = loss_and_grads(fn, args, h0, **kwargs)
  (o_ref, final_ref), grads_ref = loss_and_grads(ref_fn, args, h0, **kwargs)
  errors = {"o": rel_rms(o, o_ref)}
  if h0 is not None:
    errors["final"] = rel_rms(final, final_ref)
  names = ["dq", "dk", "dv"] + [f"dgate{i}" for i in range(len(args) - 3)]  # g and/or beta
  for name, g, r in zip(names, grads[0], grads_ref[0]):
    errors[name] = rel_rms(g, r)
  if h0 is not None:
    errors["dh0"] = rel_rms(grads[1], grads_ref[1])
  return errors


def op(variant):
  return getattr(ops, variant)


def table(title: str, errors: dict[str, float]) -> str:
  return f"{title}: " + " ".join(f"{k} {v:.1e}" for k, v in errors.items())


def kernel_op(chunked_attention, **options):
  """A backend's kernel entry (`pallas_kernels.tpu.chunked_attention`, `...gpu...`) with the variants'
  signature and results, for `shard_op`: the kernel itself runs on each shard, with `options`
  (`interpret`, `chunk_size`, ...), on whatever backend traces it (no impl dispatch)."""

  def op(q, k, v, *gates, initial_state=None, output_final_state=False, segment_ids=None,
         cu_seqlens=None, **kwargs):
    assert cu_seqlens is None, "the kernels take segment_ids"
    if "A_log" in kwargs:   # kda's gate arrays, as shard_op splits them: the GPU entry's gate
      from linear_attention_jax.pallas_kernels.gate import Gate
      kwargs["gate"] = Gate(kwargs.pop("A_log"), kwargs.pop("dt_bias"), "softplus")
    o, final = chunked_attention(q, k, v, *gates, initial_state=initial_state, segment_ids=segment_ids,
                                 **options, **kwargs)
    return o, (final if output_final_state else None)

  return op
