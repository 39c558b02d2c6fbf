"""What every backend's entry and kernels share that is not a kernel: argument shapes, the interpreter
switch, and the mesh-axis bookkeeping of calls under `jax.shard_map`."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from . import prep


def check_shapes(q, k, v, g, beta, initial_state, segment_ids):
  """`(B, T, H, K, H_v, V)`, or a ValueError naming the argument whose shape is wrong."""
  if q.ndim != 4 or k.shape != q.shape:
    raise ValueError(f"q and k must have one shape [B, T, H, K]; got q {q.shape}, k {k.shape}")
  B, T, H, K = q.shape
  if v.ndim != 4 or v.shape[:2] != (B, T) or v.shape[2] % H:
    raise ValueError(f"v must be [B, T, H_v, V] with B={B}, T={T} and H_v a multiple of H={H}; "
                     f"got {v.shape}")
  Hv, V = v.shape[2:]
  want = {"g": (None, (B, T, Hv), (B, T, Hv, K)), "beta": (None, (B, T, Hv)),
          "initial_state": (None, (B, Hv, K, V)), "segment_ids": (None, (B, T))}
  for name, x in (("g", g), ("beta", beta), ("initial_state", initial_state),
                  ("segment_ids", segment_ids)):
    shape = None if x is None else tuple(x.shape)
    if shape not in want[name]:
      raise ValueError(f"{name} must be one of {want[name]} (None: absent); got {shape}")
  return B, T, H, K, Hv, V


L2_EPS = 1e-6   # `x * rsqrt(sum(x^2) + eps)`, as linear_attention_jax.ops.l2_normalize


def l2_normalize(x):
  """`x * rsqrt(sum(x^2) + L2_EPS)` over the last axis (K) in float32, back in x's dtype (XLA;
  differentiable): `qk_l2norm` where a backend's kernels do not normalise on load."""
  x32 = x.astype(jnp.float32)
  return (x32 * lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2_EPS)).astype(x.dtype)


def cast_tensors(t: prep.ChunkTensors, dtype) -> prep.ChunkTensors:
  """The chunk tensors that are matmul operands (qg, kd, w, u, p) in `dtype`; `decay` as it is."""
  cast = lambda x: None if x is None else x.astype(dtype)
  return t._replace(qg=cast(t.qg), kd=cast(t.kd), w=cast(t.w), u=cast(t.u), p=cast(t.p))


def row_and_head(i, Hv: int):
  """For the i-th (batch row, value head) pair of a `lax.map` over `B * Hv`: `(h, row, head)`, where
  `row(x)` slices x's batch row (axis 0) and `head(x, j, axis)` also the head j on `axis` (size-1
  slices; None stays None)."""
  b, h = i // Hv, i % Hv
  row = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, b, 1, 0)
  head = lambda x, j, axis=2: None if x is None else lax.dynamic_slice_in_dim(row(x), j, 1, axis)
  return h, row, head


class InterpretSwitch:
  """A backend's "run the kernels in the interpreter" switch: `use(params)` is a context manager
  inside which `current()` returns `params` (else None). jit caches do not see it: trace inside."""

  def __init__(self, name: str, default_params: Callable[[], Any]):
    self._var = contextvars.ContextVar(name, default=None)
    self._default = default_params

  @contextlib.contextmanager
  def use(self, params=None):
    token = self._var.set(self._default() if params is None else params)
    try:
      yield
    finally:
      self._var.reset(token)

  def current(self):
    return self._var.get()


def explicitly_sharded(*arrays) -> bool:
  """True if an array is split over mesh axes that are not manual: a sharded jit (explicit mesh) outside
  `jax.shard_map`, where a pallas_call cannot run. (Under an auto mesh the sharding is not visible at
  trace time; XLA would then replicate the kernel's operands.)"""
  for x in arrays:
    spec = None if x is None else getattr(jax.typeof(x).sharding, "spec", None)
    if spec is not None and any(p is not None for p in spec):
      return True
  return False


def varying_axes(arrays) -> frozenset:
  """The mesh axes over which any of `arrays` varies (under `jax.shard_map`; empty outside)."""
  return frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in arrays))


def vary_over(x, axes: frozenset):
  """`x`, made to vary over every mesh axis in `axes` (`check_vma=True` wants a kernel's operands and
  results to say so; a kernel call itself does not track it)."""
  missing = axes - jax.typeof(x).manual_axis_type.varying
  return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def sum_over_extra_axes(ct, primal):
  """Under `jax.shard_map`, a cotangent that varies over mesh axes its primal does not (K-side tensors
  when V is sharded) holds per-shard partial sums: add them up."""
  extra = jax.typeof(ct).manual_axis_type.varying - jax.typeof(primal).manual_axis_type.varying
  return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


def summed_like(grads, primals):
  """`sum_over_extra_axes` of each gradient against its primal (None stays None): what a kernel branch
  returns where a `lax.cond` pairs it with a branch whose gradients already vary as their primals do
  (the branches' types must match under shard_map)."""
  return tuple(None if d is None else sum_over_extra_axes(d, x) for d, x in zip(grads, primals))
