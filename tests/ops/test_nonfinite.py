"""Non-finite gates and values, per impl the CPU runs: recurrent, chunk, auto (the scan's forward with
the chunked form's derivatives) and pallas through the Mosaic TPU and GPU interpreters.

- `g = -inf` ("forget everything"; `log(sigmoid(a))` for a < -104) on one token, on some key channels of
  one token (per-channel variants), and very negative finite gates (-1e4, -1e5): outputs, final state
  and every gradient finite and equal to the recurrent form's (the other forms floor g at
  `prep.LOG_DECAY_FLOOR`, ops/dispatch.py `gate_for`).
- A NaN at token t reaches exactly the documented tokens (README, "Non-finite inputs"; `reached` below).
- g > 0 (a growing state): the chunk form takes it; the GPU's per-channel kernels do not (their
  per-chunk forms take a non-increasing cumulative decay), and say so.

Shapes are tiny, and every case of a variant and impl shares one compiled function (the cases differ
in values only), since the interpreters are slow.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from linear_attention_jax.pallas_kernels import gpu, tpu
from linear_attention_jax.pallas_kernels.prep import LOG_DECAY_FLOOR, floor_log_decay
from tests.ops.conftest import FAMILY, call, make_inputs, rel_rms

GATED = ("simple_gla", "gla", "gated_delta_rule", "kda")
PER_CHANNEL = ("gla", "kda")
IMPLS = ("recurrent", "chunk", "auto", "pallas_tpu", "pallas_gpu")
OPTIONS = {"simple_gla": {}, "gla": {}, "gated_delta_rule": {"use_qk_l2norm": True},
           "kda": {"use_qk_l2norm": True}, "retention": {}}
# The GPU kernels take bfloat16 / float16 operands, K and V of 64 or 128 and chunks of 64 tokens.
SHAPES = {"pallas_gpu": dict(T=100, K=64, V=64, C=64, t=40)}
SMALL = dict(T=40, K=8, V=4, C=16, t=5)
TOL = {"pallas_gpu": 2e-2}  # bfloat16 operands against the float32 recurrence
FAST = {"xla_backend_optimization_level": 0}


def shape(impl):
  return SHAPES.get(impl, SMALL)


def interpreted(impl):
  """The context that runs `impl`'s kernels in an interpreter (entered while tracing)."""
  if impl == "pallas_tpu":
    return tpu.interpret_kernels(pltpu.InterpretParams(random_seed=3))
  if impl == "pallas_gpu":
    return gpu.interpret_kernels()
  return _Nothing()


class _Nothing:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


@functools.partial(jax.jit, static_argnames=("variant", "impl", "grads"), compiler_options=FAST)
def _run(inp, *, variant, impl, grads=True):
  """`(o, final_state, {name: gradient of a fixed random projection of (o, final)})`."""
  names = [n for n in ("q", "k", "v", "g", "beta", "h0") if inp.get(n) is not None]
  C = shape(impl)["C"]
  op_impl = "pallas" if impl.startswith("pallas") else impl
  dtype = jnp.bfloat16 if impl == "pallas_gpu" else jnp.float32

  def f(*xs):
    x = dict(inp, **dict(zip(names, xs)))
    x.update({n: x[n].astype(dtype) for n in ("q", "k", "v")})
    o, hT = call(variant, x, impl=op_impl, chunk_size=C, output_final_state=True, **OPTIONS[variant])
    return o.astype(jnp.float32), hT

  with interpreted(impl):
    if not grads:
      o, hT = f(*[inp[n] for n in names])
      return o, hT, {}
    (o, hT), pull = jax.vjp(f, *[inp[n] for n in names])
  key_o, key_h = jax.random.split(jax.random.PRNGKey(0))
  cot = (jax.random.normal(key_o, o.shape), jax.random.normal(key_h, hT.shape))
  return o, hT, dict(zip(names, pull(cot)))


def _inputs(variant, impl, seed=4):
  s = shape(impl)
  inp = make_inputs(variant, B=1, T=s["T"], H=1, Hv=1, K=s["K"], V=s["V"], seed=seed)
  if impl == "pallas_gpu":  # the reference sees the operands the kernel sees
    inp.update({n: np.asarray(jnp.asarray(inp[n], jnp.bfloat16).astype(jnp.float32))
                for n in ("q", "k", "v")})
  return inp


def _assert_matches_the_recurrence(variant, impl, inp):
  o, hT, grads = _run(jax.tree.map(jnp.asarray, inp), variant=variant, impl=impl)
  ro, rhT, rgrads = _run(jax.tree.map(jnp.asarray, inp), variant=variant, impl="recurrent")
  got = {"o": o, "state": hT, **{f"d{n}": grads[n] for n in grads}}
  want = {"o": ro, "state": rhT, **{f"d{n}": rgrads[n] for n in rgrads}}
  for name, x in want.items():  # the reference is finite: -inf forgets, it does not poison
    assert np.isfinite(np.asarray(x)).all(), f"recurrent {name} not finite"
  for name, x in got.items():
    assert np.isfinite(np.asarray(x)).all(), f"{impl} {name} not finite"
  errors = {name: rel_rms(got[name], want[name]) for name in want}
  print(variant, impl, " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
  assert max(errors.values()) < TOL.get(impl, 1e-5), errors


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", GATED)
def test_minus_inf_gate_on_one_token_forgets_everything(variant, impl):
  inp = _inputs(variant, impl)
  inp["g"][0, shape(impl)["t"]] = -np.inf  # every channel of that token
  _assert_matches_the_recurrence(variant, impl, inp)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", PER_CHANNEL)
def test_minus_inf_gate_on_some_channels(variant, impl):
  inp = _inputs(variant, impl)
  t, K = shape(impl)["t"], shape(impl)["K"]
  inp["g"][0, t, :, : K // 2] = -np.inf
  inp["g"][0, t + 3, :, K - 1] = -np.inf
  _assert_matches_the_recurrence(variant, impl, inp)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", GATED)
@pytest.mark.parametrize("gate", [-1e4, -1e5])
def test_very_negative_finite_gate_stays_exact(variant, impl, gate):
  inp = _inputs(variant, impl)
  t = shape(impl)["t"]
  inp["g"][0, t] = gate
  if variant in PER_CHANNEL:  # and some channels of a later token, the others left normal
    inp["g"][0, t + 2, :, ::2] = gate
  _assert_matches_the_recurrence(variant, impl, inp)


@pytest.mark.parametrize("impl", ["chunk", "auto", "pallas_tpu"])
def test_retention_with_a_vanishing_gamma(impl):
  # gamma = 1e-30 is log(gamma) = -69 a token, beyond the floor: the state is forgotten at every token
  inp = _inputs("retention", impl)
  run = lambda impl: _run_retention(jax.tree.map(jnp.asarray, inp), impl=impl)
  (o, hT), (ro, rhT) = run(impl), run("recurrent")
  assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(hT)).all()
  assert rel_rms(o, ro) < 1e-5 and rel_rms(hT, rhT) < 1e-5


@functools.partial(jax.jit, static_argnames=("impl",), compiler_options=FAST)
def _run_retention(inp, *, impl):
  with interpreted(impl):
    return call("retention", inp, gamma=1e-30, impl="pallas" if impl.startswith("pallas") else impl,
                chunk_size=SMALL["C"], output_final_state=True)


def test_the_floor_is_a_maximum_with_zero_gradient_below():
  g = jnp.array([-jnp.inf, -1e5, -25.0, -3.0, 0.0, jnp.nan])
  floored = floor_log_decay(g)
  np.testing.assert_array_equal(np.asarray(floored)[:5], [LOG_DECAY_FLOOR] * 3 + [-3.0, 0.0])
  assert np.isnan(np.asarray(floored)[5])  # a NaN stays a NaN
  np.testing.assert_array_equal(np.asarray(jax.grad(lambda g: floor_log_decay(g).sum())(g[:5])),
                                [0, 0, 0, 1, 1])
  assert floor_log_decay(None) is None


def test_the_gpu_per_channel_kernels_refuse_a_growing_gate():
  # 8 channels at -3 a token take the per-chunk forms, 4 tokens at +2 make G rise inside that chunk:
  # the kernels' forms would be wrong there. A concrete g: a ValueError naming g at the call; a traced
  # one: with debug_checks, when the program runs. The chunk form matches the recurrence.
  from linear_attention_jax import debug_checks, ops
  from linear_attention_jax.ops import checks
  inp = make_inputs("kda", B=1, T=128, H=1, Hv=1, K=64, V=64, seed=3)
  g = np.asarray(inp["g"]).copy()
  g[:, :64, :, :8] = -3.0
  g[:, 30:34, :, :4] = 2.0
  q, k, v = (jnp.asarray(inp[n], jnp.bfloat16) for n in ("q", "k", "v"))
  args = (q, k, v, jnp.asarray(g), jnp.asarray(inp["beta"]))
  with gpu.interpret_kernels():
    with pytest.raises(ValueError, match="g must be a log-decay, <= 0 everywhere .*maximum of 2"):
      ops.kda(*args, impl="pallas")
    with debug_checks(), pytest.raises(Exception, match="g must be a log-decay"):
      jax.block_until_ready(jax.jit(lambda *a: ops.kda(*a, impl="pallas"))(*args))
  f32 = [jnp.asarray(x, jnp.float32) for x in args]
  assert rel_rms(ops.kda(*f32, impl="chunk")[0], ops.kda(*f32, impl="recurrent")[0]) < 1e-5
  checks.check_log_decay("g", jnp.asarray([-jnp.inf, 0.0, jnp.nan, -1e30]), "the test")   # passes


# --- NaN isolation ---------------------------------------------------------------------------------

# Three documents in a row: [0, 24), [24, 32), [32, 48) (C = 16: the second starts inside chunk 1, the
# third with chunk 2); the NaN sits at token 21 (chunk 1, document 0). For the GPU kernel (C = 64):
# [0, 96), [96, 128), [128, 160), NaN at token 80.
DOCS = {"small": (48, [0, 24, 32, 48], 21, 16), "gpu": (160, [0, 96, 128, 160], 80, 64)}


def reached(impl, packing, T, cu, t, C):
  """The tokens a NaN at token t reaches (README, "Non-finite inputs"), as a bool `[T]`.

  recurrent: t ... the end of t's document. chunk and the kernels, one document a row: the chunk
  holding t from its start, and every later token. chunk with cu_seqlens: t's document alone, from
  the start of t's chunk (each document is laid out from a chunk boundary). chunk with segment_ids:
  every token of a chunk that holds a reached token, and every later token of a document with an
  earlier reached token (closed under both); documents that start in a later, unreached chunk are
  untouched. The kernels with segment_ids: the chunk holding t from its start, and every later token
  of the row.
  """
  pos = np.arange(T)
  doc = np.searchsorted(np.asarray(cu[1:]), pos, side="right")
  own = (doc == doc[t]) & (pos >= t)
  if impl == "recurrent":
    return own if packing != "none" else pos >= t
  if packing == "cu_seqlens":
    start = cu[doc[t]] + (t - cu[doc[t]]) // C * C
    return (doc == doc[t]) & (pos >= start)
  if impl != "chunk" or packing == "none":
    return pos >= t // C * C
  hit = own.copy()
  while True:
    chunk_hit = np.zeros(T // C, bool)
    np.logical_or.at(chunk_hit, pos // C, hit)
    grown = hit | chunk_hit[pos // C]
    first = np.array([grown[(doc == d)].argmax() if grown[doc == d].any() else T for d in doc])
    grown |= pos >= first
    if (grown == hit).all():
      return hit
    hit = grown


@functools.partial(jax.jit, static_argnames=("variant", "impl", "packing"), compiler_options=FAST)
def _forward(inp, seg, cu, *, variant, impl, packing):
  s = DOCS["gpu" if impl == "pallas_gpu" else "small"]
  dtype = jnp.bfloat16 if impl == "pallas_gpu" else jnp.float32
  x = dict(inp, **{n: inp[n].astype(dtype) for n in ("q", "k", "v")})
  kw = {"segments": dict(segment_ids=seg), "cu_seqlens": dict(cu_seqlens=cu), "none": {}}[packing]
  with interpreted(impl):
    o, _ = call(variant, x, impl="pallas" if impl.startswith("pallas") else impl, chunk_size=s[3],
                **kw, **OPTIONS[variant])
  return o


NAN_CASES = [(impl, packing) for impl in ("recurrent", "chunk", "pallas_tpu", "pallas_gpu")
             for packing in ("none", "segments", "cu_seqlens")
             if not (impl.startswith("pallas") and packing == "cu_seqlens")]  # no kernel takes cu_seqlens


@pytest.mark.parametrize("impl,packing", NAN_CASES)
@pytest.mark.parametrize("variant", GATED)
@pytest.mark.parametrize("where", ["v", "g", "q"])
def test_a_nan_reaches_the_documented_tokens(where, variant, impl, packing):
  T, cu, t, C = DOCS["gpu" if impl == "pallas_gpu" else "small"]
  K = 64 if impl == "pallas_gpu" else 8
  inp = make_inputs(variant, B=1, T=T, H=1, Hv=1, K=K, V=K if impl == "pallas_gpu" else 4, seed=1,
                    rows=len(cu) - 1 if packing == "cu_seqlens" else 1)
  if packing == "cu_seqlens":
    inp["h0"] = np.zeros_like(inp["h0"])
  inp[where][0, t] = np.nan
  seg = np.repeat(np.arange(len(cu) - 1), np.diff(cu))[None].astype(np.int32)
  o = _forward(jax.tree.map(jnp.asarray, inp), jnp.asarray(seg), jnp.asarray(cu, jnp.int32),
               variant=variant, impl=impl, packing=packing)
  bad = ~np.isfinite(np.asarray(o, np.float32)[0]).reshape(T, -1).all(-1)
  if where == "q":  # a query reads the state: its NaN reaches its own output alone
    np.testing.assert_array_equal(np.nonzero(bad)[0], [t])
    return
  bound = reached(impl, packing, T, cu, t, C)
  own = reached("recurrent", packing, T, cu, t, C)
  assert (bad[own]).all(), "the NaN must reach its own document from t on"
  assert not (bad & ~bound).any(), f"reached beyond the documented tokens: {np.nonzero(bad & ~bound)[0]}"
  if where == "v":  # a NaN value reaches the bound exactly (a NaN gate may reach less: see README)
    np.testing.assert_array_equal(np.nonzero(bad)[0], np.nonzero(bound)[0])
