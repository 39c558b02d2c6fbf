"""Which implementation serves a call (`select_impl`, `pallas_reason`) and the Pallas kernels' call, the
same for every backend: each backend's `chunked_attention` takes q, k, v in any float dtype with the
matmul dtype, and `qk_l2norm`; it decides where to cast and where to normalise, and `walked_columns`
says how many value columns its kernels walk (the chunked form here walks the rest: every value column
walks independently)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_attention_jax.ops import checks
from linear_attention_jax.ops.chunk import chunk_form
from linear_attention_jax.pallas_kernels import gpu as gpu_kernels
from linear_attention_jax.pallas_kernels.prep import floor_log_decay
from linear_attention_jax.pallas_kernels import tpu as tpu_kernels

BACKENDS = {"gpu": gpu_kernels, "tpu": tpu_kernels}


def kernel_backend() -> str:
  """"tpu" or "gpu" inside that backend's interpreter context, else the running backend."""
  if tpu_kernels.interpreting() is not None:
    return "tpu"
  if gpu_kernels.interpreting() is not None:
    return "gpu"
  return jax.default_backend()


def pallas_reason(*, K: int, V: int, chunk_size: int, packing: str = "none", dtype=jnp.float32,
                  sharded: bool = False, v_extra: int = 0, delta: bool = False):
  """None if a Pallas kernel serves a call of this kind on this backend, else why not.

  The TPU kernels serve a TPU backend, or any backend inside the TPU interpreter
  (`linear_attention_jax.pallas_kernels.tpu.interpret_kernels()`); the Mosaic GPU kernels serve a Hopper
  GPU, or any backend inside `linear_attention_jax.pallas_kernels.gpu.interpret_kernels()` (the
  interpreters, for tests). `V` counts the state's value columns and `v_extra` of them are
  appended ones (the linear-attention normaliser); the backend's `walked_columns` says how many it walks.
  `sharded`: the operands are split over mesh axes outside `jax.shard_map`. `delta`: the call is of
  the delta family (whose key dimension a backend may not split into blocks).
  """
  backend = kernel_backend()
  if backend not in BACKENDS:
    return f"no Pallas kernel runs on backend {backend!r} (the kernels are for TPUs and Hopper GPUs)"
  kernels = BACKENDS[backend]
  call = dict(K=K, V=kernels.walked_columns(V, v_extra), chunk_size=chunk_size, dtype=dtype,
              packing=packing, sharded=sharded, delta=delta)
  return kernels.supports(**call)


# On a CPU the recurrent scan's forward was faster than the chunked form's in 43 of 48 rows measured,
# T = 64 ... 16384, K = V = 64 and 128, B * H = 4 ... 32 (1.1-3.7x; where it lost, by at most 1.5x:
# simple_gla and gated_delta_rule at K = 128), and the chunked form's forward + backward faster in
# every row (1.7-7x). Neither form's lead follows T, so the bound is the longest length measured.
# Measured on a shared 2-core CPU, float32, jitted, medians of 5-7 rounds (experiments/benchmark.py;
# the table is in the README, "impl="auto" on a CPU"). Past it (and for T unknown) the chunked form
# runs both ways.
CPU_SCAN_MAX_T = 16384


def cpu_scan_forward(T: int | None, backend: str | None = None) -> bool:
  """Whether "auto" off-kernel runs the recurrent scan's forward (with the chunked form's derivatives)
  for a call of `T` tokens on `backend` (default: the running one): on a CPU for T <= CPU_SCAN_MAX_T."""
  backend = jax.default_backend() if backend is None else backend
  return backend == "cpu" and T is not None and T <= CPU_SCAN_MAX_T


def select_impl(impl: str, variant: str, *, T: int | None = None, **call) -> str:
  """The implementation that serves a call: a named impl, or for "auto" the Pallas kernel where
  `pallas_reason(**call)` is None, else (off-kernel) the faster XLA form. `impl="pallas"` raises with
  that reason.

  Off-kernel "auto" gives "recurrent" on a CPU for `T <= CPU_SCAN_MAX_T` tokens (`cpu_scan_forward`),
  and "chunk" elsewhere. Its "recurrent" runs the scan's forward with the chunked form's derivatives
  (`scan_forward_chunk_derivatives`): on a CPU the scan's forward is the faster (in 43 of 48 rows
  measured), the chunked form's forward + backward the faster in every row (1.7-7x), so inference and
  training each get the faster form. A named `impl="recurrent"` differentiates through the scan (the reference).

  `T`: the call's length along T (None: unknown, the chunked form). `call`: the keywords of
  `pallas_reason` (K, V, chunk_size, packing, dtype, sharded, delta); without them "pallas" raises.
  """
  if impl not in ("pallas", "auto"):
    return impl
  reason = pallas_reason(**call) if call else "the call's shapes were not given to select_impl"
  if reason is None:
    return "pallas"
  if impl == "pallas":
    raise ValueError(f"impl='pallas' cannot serve {variant}: {reason}; use impl='chunk' or impl='auto'")
  return "recurrent" if cpu_scan_forward(T, kernel_backend()) else "chunk"


def gate_for(form: str, g):
  """The log-decay `g` that the form `form` ("recurrent", "chunk" or "pallas") takes.

  The recurrent scan takes g as given: it multiplies the state by `exp(g)`, so `g = -inf` forgets
  exactly. Every other form sums g within a chunk and exponentiates differences of those sums, where a
  -inf gives NaN (-inf - -inf) and a huge finite g drowns the small gates after it; they take
  `floor_log_decay(g)`, g floored at `LOG_DECAY_FLOOR` (-20) per token and key channel (gradient 0
  below the floor). A token at the floor keeps e^-20 ~ 2e-9 of the state instead of 0, so the forms
  agree with the scan to float32 rounding for any `g <= 0`, -inf included. NaN stays NaN. "pallas"
  takes g as given too: each backend's `chunked_attention` floors it, the GPU's inside its
  per-channel kernels where they run both ways (no second copy of g for the floor).
  """
  return g if form in ("recurrent", "pallas") else floor_log_decay(g)


def scan_forward_chunk_derivatives(scan, chunk):
  """`scan` (a function of arrays) whose derivatives, forward (jvp) and so reverse (vjp), are those of
  `chunk`, the same function in the chunked form: the call runs `scan` alone, a differentiated call
  runs `chunk` alone (its primal output too)."""
  fn = jax.custom_jvp(scan)
  fn.defjvp(lambda primals, tangents: jax.jvp(chunk, primals, tangents))
  return fn


def pallas_form(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size, compute_dtype,
                qk_l2norm, v_extra, mapped_qk, packing, gate=None):
  """The running backend's kernels on float32 `q, k` (raw when `qk_l2norm`), `v` with `v_extra`
  appended columns, g (unfloored: `gate_for`), beta; the columns the kernels do not walk take the
  chunked form on `mapped_qk()` (q, k through the variant's map). Returns float32 `(o, final)`.
  `gate`: None, or a `pallas_kernels.gate.Gate` whose pre-activation g is: the GPU's kernels take it
  (`gpu.chunked_attention`), the TPU's take the gate's values."""
  backend = kernel_backend()
  kernels = BACKENDS[backend]
  if gate is not None and backend != "gpu":
    g, gate = gate.values(g), None
  if backend == "gpu" and g is not None and g.ndim == 4 and gate is None:
    # the per-chunk forms of its per-channel kernels take a non-increasing cumulative decay in a chunk
    checks.check_log_decay("g", g, "the GPU's per-channel kernels; impl='chunk' takes any g")
  V = v.shape[-1]
  cols = kernels.walked_columns(V, v_extra)
  h0 = initial_state
  o, final = kernels.chunked_attention(q, k, v[..., :cols], g, beta, scale=scale,
                                       initial_state=None if h0 is None else h0[..., :cols],
                                       segment_ids=segment_ids, chunk_size=chunk_size,
                                       compute_dtype=compute_dtype, qk_l2norm=qk_l2norm,
                                       **({} if gate is None else dict(gate=gate)))
  o = o.astype(jnp.float32)
  if cols < V:
    q_m, k_m = mapped_qk()
    g = g if gate is None else gate.values(g)
    o_x, final_x = chunk_form(q_m, k_m, v[..., cols:], gate_for("chunk", g), beta, scale=scale,
                              initial_state=None if h0 is None else h0[..., cols:], packing=packing,
                              chunk_size=chunk_size)
    o, final = jnp.concatenate([o, o_x], axis=-1), jnp.concatenate([final, final_x], axis=-1)
  return o, final
