"""Runs `pallas_kernels.tpu.chunked_attention` in the TPU interpreter with gradients, and measures it
against the NumPy float64 loop of tests/ops (o, final state, and every gradient)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from linear_attention_jax.pallas_kernels import tpu
from tests.ops.conftest import rel_rms
from tests.ops.test_equivalence import _reference

# Uninitialised memory is NaN and out-of-bounds reads raise (the defaults); the "parallel" grid axes
# run in a shuffled order, so a kernel that leaned on their order would fail.
PARAMS = pltpu.InterpretParams(random_seed=0)
F32_TOL = 1e-5
NAMES = ("q", "k", "v", "g", "beta", "h0")
# The interpreted kernels compile to large CPU programs that run once: skip XLA's backend optimisation
# (halves the compile time, which dominates these tests).
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, static_argnames=("chunk_size", "block_sizes", "params", "compute_dtype"),
                   compiler_options=FAST_COMPILE)
def run_with_grads(inp, do, dhT, seg, *, chunk_size, block_sizes, params, compute_dtype):
  """`(o, final_state, {name: gradient})` of the kernel op under random cotangents `do`, `dhT`."""
  names = [n for n in NAMES if inp.get(n) is not None]

  def f(*xs):
    x = dict(inp, **dict(zip(names, xs)))
    return tpu.chunked_attention(x["q"], x["k"], x["v"], x.get("g"), x.get("beta"),
                                 initial_state=x.get("h0"), segment_ids=seg, chunk_size=chunk_size,
                                 block_sizes=block_sizes, compute_dtype=compute_dtype,
                                 interpret=params)

  (o, hT), vjp = jax.vjp(f, *[inp[n] for n in names])
  return o, hT, dict(zip(names, vjp((do.astype(o.dtype), dhT))))


def check(variant, inp, *, chunk_size=16, seg=None, block_sizes=None, params=PARAMS,
          compute_dtype=None, tol=F32_TOL, seed=1):
  """Asserts relative RMS errors <= tol for o, the final state and every gradient; returns them."""
  rng = np.random.default_rng(seed)
  B, T, Hv, V = inp["v"].shape
  K = inp["q"].shape[-1]
  do = rng.normal(size=inp["v"].shape).astype(np.float32)
  dhT = rng.normal(size=(B, Hv, K, V)).astype(np.float32)
  o, hT, grads = run_with_grads(
      inp, do, dhT, None if seg is None else jnp.asarray(seg), chunk_size=chunk_size,
      block_sizes=tpu.BlockSizes() if block_sizes is None else block_sizes, params=params,
      compute_dtype=compute_dtype)
  ref_inp = dict(inp, h0=np.zeros((B, Hv, K, V), np.float32) if inp.get("h0") is None else inp["h0"])
  ro, rhT, rgrads = _reference(variant, ref_inp, do, dhT, segment_ids=seg)
  errors = {"o": rel_rms(o, ro), "state": rel_rms(hT, rhT)}
  errors.update({f"d{n}": rel_rms(grads[n], rgrads[n]) for n in grads})
  print(f"{variant} T={T} C={chunk_size} " + " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
  assert np.isfinite(list(errors.values())).all(), errors
  for name, e in errors.items():
    assert e <= tol, (name, errors)
  return errors
