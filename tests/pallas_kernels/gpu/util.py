"""Runs `pallas_kernels.gpu.chunked_attention` in the Mosaic GPU interpreter with gradients and measures
it against the NumPy float64 loop of tests/ops (o, final state, every gradient); and a float32 mirror of
the walk that rounds exactly where the kernels round, for tight checks of the kernels alone."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np

from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import GpuConfig
from tests.ops.conftest import rel_rms
from tests.ops.test_equivalence import _reference

# Uninitialised memory is NaN and out-of-bounds reads raise (the defaults).
PARAMS = plgpu.InterpretGPUParams()
NAMES = ("q", "k", "v", "g", "beta", "h0")
FAST_COMPILE = {"xla_backend_optimization_level": 0}
# float16 operands (11-bit significands): the rounding of q, k, v and of the per-chunk tensors, the state
# and u as matmul operands gives ~1e-3 relative RMS error against the float64 loop.
F16_TOL = 4e-3
BF16_TOL = 2e-2


def assert_walk_outputs_close(reference, got, tol):
  """The `(o, states, final)` of two forward walks agree: the same absent outputs, shapes, finite
  values and relative RMS below `tol`."""
  for name, a, b in zip(("o", "states", "final"), reference, got):
    if a is None:
      assert b is None, name
      continue
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape and np.isfinite(b).all(), name
    assert rel_rms(b, a) < tol, name


# The prepared path (XLA's preparation and vjp around the walk kernels), every cell's kernels, and each
# half of them; one warpgroup a program unless a test asks for more (the interpreter's threads).
XLA = GpuConfig(forward="xla_prep", backward="xla_vjp", forward_warpgroups=1, delta_warpgroups=1)
KERNELS = GpuConfig(forward_warpgroups=1, delta_warpgroups=1, key_warpgroups=1, prep_warpgroups=1)
KERNEL_FORWARD = dataclasses.replace(KERNELS, backward="xla_vjp")
KERNEL_BACKWARD = dataclasses.replace(KERNELS, forward="xla_prep")


@functools.partial(jax.jit, static_argnames=("params", "dtype", "config"), compiler_options=FAST_COMPILE)
def run_with_grads(inp, do, dhT, seg, *, params, dtype, config=XLA):
  """`(o, final_state, {name: gradient})` of the kernel op under cotangents `do`, `dhT`; q, k, v enter
  in `dtype`, g, beta and h0 in float32."""
  names = [n for n in NAMES if inp.get(n) is not None]
  cast = {"q": dtype, "k": dtype, "v": dtype}

  def f(*xs):
    x = {n: xs[names.index(n)].astype(cast.get(n, jnp.float32)) if n in names else None for n in NAMES}
    return gpu.chunked_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                 segment_ids=seg, config=config, interpret=params)

  (o, hT), vjp = jax.vjp(f, *[jnp.asarray(inp[n], jnp.float32) for n in names])
  return o, hT, dict(zip(names, vjp((do.astype(o.dtype), dhT))))


def check(variant, inp, *, seg=None, params=PARAMS, dtype=jnp.float16, tol=F16_TOL, seed=1, config=XLA,
          pieces=None):
  """Asserts relative RMS errors <= tol for o, the final state and every gradient; returns them. The
  reference sees q, k, v rounded to `dtype` as the kernel does. `pieces`: the config's sequence pieces."""
  rng = np.random.default_rng(seed)
  B, T, Hv, V = inp["v"].shape
  K = inp["q"].shape[-1]
  inp = {n: None if x is None else (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
                                    if n in ("q", "k", "v") else np.asarray(x, np.float32))
         for n, x in inp.items()}
  do = rng.normal(size=inp["v"].shape).astype(np.float32)
  dhT = rng.normal(size=(B, Hv, K, V)).astype(np.float32)
  if pieces is not None:
    config = dataclasses.replace(config, sequence_pieces=pieces)
  o, hT, grads = run_with_grads(inp, do, dhT, None if seg is None else jnp.asarray(seg), params=params,
                                dtype=dtype, config=config)
  ref_inp = dict(inp, h0=np.zeros((B, Hv, K, V), np.float32) if inp.get("h0") is None else inp["h0"])
  ro, rhT, rgrads = _reference(variant, ref_inp, do, dhT, segment_ids=seg)
  errors = {"o": rel_rms(o, ro), "state": rel_rms(hT, rhT)}
  errors.update({f"d{n}": rel_rms(grads[n], rgrads[n]) for n in grads})
  print(f"{variant} T={T} " + " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
  assert np.isfinite(list(errors.values())).all(), errors
  for name, e in errors.items():
    assert e <= tol, (name, errors)
  return errors


def packed_runs(T):
  """`[1, T]` segment ids of four runs: one ends on a chunk boundary (64), two end inside chunks."""
  seg = np.zeros((1, T), np.int32)
  seg[0, 40:64], seg[0, 64:110], seg[0, 110:] = 3, 1, 2
  return seg


def normalised_kda_reference(q, k, v, g, beta, h0, do, dhT, seg):
  """The float64 loop of kda on l2-normalised q, k (the raw float64 q, k given), dq and dk through the
  norm's float64 backward: `(o, final state, {name: gradient})`."""
  norm = lambda x: np.linalg.norm(x, axis=-1, keepdims=True)
  qn, kn = q / norm(q), k / norm(k)
  ro, rhT, rgrads = _reference("kda", dict(q=qn, k=kn, v=v, g=g, beta=beta, h0=h0), do, dhT, segment_ids=seg)
  for n, x, y in (("q", q, qn), ("k", k, kn)):
    dy = rgrads[n]
    rgrads[n] = (dy - y * np.sum(y * dy, axis=-1, keepdims=True)) / norm(x)
  return ro, rhT, rgrads
