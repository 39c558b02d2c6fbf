"""Chunked form and recurrent form against a NumPy float64 per-token loop: outputs, final states and
every gradient (q, k, v, g, beta, initial_state) with random cotangents, on awkward shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax import ops
from tests.ops.conftest import FAMILY, call, make_inputs, rel_rms
from tests.ops.numpy_reference import packed_forward_backward

# Variants whose every input maps to a family input one to one (retention's gamma and the feature maps
# of linear_attention are checked in test_variants.py).
DIRECT = ("simple_gla", "gla", "delta_rule", "gated_delta_rule", "kda")
F32_TOL = {"o": 1e-5, "state": 1e-5, "grad": 1e-5}
BF16_TOL = 1e-2


# The optimisation level changes no result beyond the tolerances; it cuts the compiles, most of the
# file's time, by about a third.
@functools.partial(jax.jit, static_argnames=("variant", "impl", "chunk_size", "packed"),
                   compiler_options={"xla_backend_optimization_level": 0})
def _run_with_grads(inp, do, dhT, seg, cu, *, variant, impl, chunk_size, packed):
  names = [n for n in ("q", "k", "v", "g", "beta", "h0") if inp[n] is not None]

  def f(*xs):
    x = dict(inp, **dict(zip(names, xs)))
    return call(variant, x, impl=impl, chunk_size=chunk_size, output_final_state=True,
                segment_ids=seg if packed == "segments" else None,
                cu_seqlens=cu if packed == "cu" else None)

  (o, hT), vjp = jax.vjp(f, *[inp[n] for n in names])
  grads = vjp((do.astype(o.dtype), dhT))
  return o, hT, dict(zip(names, grads))


def _reference(variant, inp, do, dhT, *, segment_ids=None, cu_seqlens=None):
  B, T, H, K = inp["q"].shape
  Hv = inp["v"].shape[2]
  G = Hv // H
  f64 = lambda x: None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  q, k = (np.repeat(f64(inp[n]), G, axis=2) for n in ("q", "k"))
  o, hT, grads = packed_forward_backward(
      q, k, f64(inp["v"]), f64(inp["g"]), f64(inp["beta"]), f64(inp["h0"]), K ** -0.5, f64(do),
      f64(dhT), segment_ids=segment_ids, cu_seqlens=cu_seqlens)
  for n in ("q", "k"):
    grads[n] = grads[n].reshape(B, T, H, G, K).sum(3)
  return o, hT, grads


def _check(variant, inp, impl, *, chunk_size=64, seg=None, cu=None, tol=F32_TOL, seed=1):
  rng = np.random.default_rng(seed)
  B, T = inp["v"].shape[:2]
  do = rng.normal(size=inp["v"].shape).astype(np.float32)
  dhT = rng.normal(size=inp["h0"].shape).astype(np.float32)
  packed = "segments" if seg is not None else ("cu" if cu is not None else "none")
  o, hT, grads = _run_with_grads(
      inp, do, dhT, None if seg is None else jnp.asarray(seg), None if cu is None else jnp.asarray(cu),
      variant=variant, impl=impl, chunk_size=chunk_size, packed=packed)
  ro, rhT, rgrads = _reference(variant, inp, do, dhT, segment_ids=seg, cu_seqlens=cu)
  errors = {"o": rel_rms(o, ro), "state": rel_rms(hT, rhT)}
  errors.update({f"d{n}": rel_rms(grads[n], rgrads[n]) for n in grads})
  print(f"{variant} {impl} T={T} " + " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
  assert np.isfinite(list(errors.values())).all(), errors
  assert errors["o"] <= tol["o"], errors
  assert errors["state"] <= tol["state"], errors
  for n, e in errors.items():
    if n.startswith("d"):
      assert e <= tol["grad"], (n, errors)
  return errors


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 300])
@pytest.mark.parametrize("variant", DIRECT)
def test_matches_numpy_float32(variant, T, impl):
  _check(variant, make_inputs(variant, T=T), impl)


@pytest.mark.parametrize("gates", ["strong", "zero"])
@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("variant", ["simple_gla", "gla", "gated_delta_rule", "kda"])
def test_strong_and_zero_gates(variant, impl, gates):
  _check(variant, make_inputs(variant, T=130, gates=gates, seed=3), impl, chunk_size=32)


@pytest.mark.parametrize("chunk_size", [1, 2, 16, 128])
@pytest.mark.parametrize("variant", ["gla", "kda"])
def test_chunk_sizes(variant, chunk_size):
  _check(variant, make_inputs(variant, T=77, seed=4), "chunk", chunk_size=chunk_size)


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("variant", DIRECT)
def test_bfloat16_inputs(variant, impl):
  inp = make_inputs(variant, T=100, seed=5)
  inp = {n: None if x is None else jnp.asarray(x, jnp.bfloat16) for n, x in inp.items()}
  tol = {"o": BF16_TOL, "state": BF16_TOL, "grad": BF16_TOL}
  _check(variant, inp, impl, tol=tol)


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("variant", DIRECT)
def test_segment_ids(variant, impl):
  # Row 0: runs of 30, 1 (a length-one segment), 40 and 29 with a reused id; row 1: one segment.
  T = 100
  seg = np.zeros((2, T), np.int32)
  seg[0, 30:31], seg[0, 31:71], seg[0, 71:] = 5, 1, 0
  _check(variant, make_inputs(variant, T=T, seed=6), impl, seg=seg, chunk_size=16)


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("variant", DIRECT)
def test_cu_seqlens(variant, impl):
  # Lengths 0, 1, 70, 0, 18, 40: empty sequences at the start and in the middle, one of length one.
  cu = np.cumsum([0, 0, 1, 70, 0, 18, 40]).astype(np.int32)
  inp = make_inputs(variant, B=1, T=int(cu[-1]), rows=len(cu) - 1, seed=7)
  _check(variant, inp, impl, cu=cu, chunk_size=16)


@pytest.mark.parametrize("packed", ["none", "segments", "cu"])
@pytest.mark.parametrize("variant", DIRECT)
def test_walk_in_many_blocks(variant, packed, monkeypatch):
  # A tiny block budget makes the outer walk cross many block boundaries (3 to 6 chunks of 8 each);
  # T = 173 is used by no other test, so no trace with the default budget is reused.
  from linear_attention_jax.ops import chunk
  monkeypatch.setattr(chunk, "BLOCK_TOKEN_HEADS", 2 * 4 * 8 * 3)
  T = 173
  if packed == "cu":
    cu = np.array([0, 5, 5, 60, 61, 130, T], np.int32)
    _check(variant, make_inputs(variant, B=1, T=T, rows=6, seed=8), "chunk", chunk_size=8, cu=cu)
  else:
    seg = None
    if packed == "segments":
      seg = np.zeros((2, T), np.int32)
      seg[0, 23:24], seg[0, 24:90], seg[1, 50:] = 1, 2, 1
    _check(variant, make_inputs(variant, T=T, seed=9), "chunk", chunk_size=8, seg=seg)
