"""Properties of the ops over random values, gate strengths, split points and packings (hypothesis,
derandomized, bounded: `max_examples` per test below, `deadline=None`, no example database).

Each property is one jitted function per (variant, impl) over one fixed shape (B = 1, one query/key
head serving H_v = 2 value heads, K = 8, V = 4, T = 32). Hypothesis draws a seed for the values, the
gate strength (0.01 ... 30 times a sigmoid: from almost no decay to beyond the -20 floor), the split
point and the documents' lengths; all enter the compiled function as arrays, so no draw compiles
anything. Pieces of any length keep the one shape: the tokens outside a piece are neutral
(k = v = g = beta = 0 leave the state as it is; for retention, whose constant decay acts on them too,
the initial state is divided by gamma^n), and independent calls are batched as rows of one call. The
compiles, not the examples, are the suite's time (~70 s on one core).

| property | what must hold | cases (variant-impl) x examples |
|---|---|---|
| future invariance | q, k, v, g, beta replaced from token P on: o before P, and every gradient of a loss on o[:P] (inputs before P and h0), unchanged; the gradients from P on zero | gated_delta_rule, gla x (recurrent, chunk): 4 each; simple_gla-pallas: 2 |
| chunk-size invariance | the chunked form (T = 72) equals the recurrent one, o and final state, at C = 16, 128 (kda), 32, 64 (simple_gla) | kda-chunk, simple_gla-chunk: 3 each; gla-pallas (C = 16, 32): 2 |
| split invariance | any split point P: the first piece's final state as the second's initial state gives the whole call's o and final state | linear_attention, kda x (recurrent, chunk): 4 each; kda-pallas: 2 |
| packing equivalence | 3 documents of any lengths (empty ones too): cu_seqlens (an initial state per document) == each document alone == segment_ids (o and final states) | delta_rule, simple_gla x (recurrent, chunk): 4 each; gla-pallas (segment_ids == alone): 2 |
| grouped heads | one q/k head serving 2 value heads equals q, k repeated to 2 heads: o and final state | retention x (recurrent, chunk): 4 each |

Every variant meets both XLA impls in some property; "pallas" is the TPU kernels in their interpreter
(grouped heads through the kernels: tests/ops/test_pallas_dispatch.py). `LINEAR_ATTENTION_JAX_PROPERTIES=all`
runs every property on every variant, every impl and every chunk size (minutes). Context parallel ==
one device needs several devices: tests/sharding/test_context_parallel.py, `test_context_parallel_property`.

Bugs found: none in the ops.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from linear_attention_jax import ops
from linear_attention_jax.pallas_kernels import tpu
from tests.ops.conftest import FAMILY

T, K, V, H, HV = 32, 8, 4, 1, 2
FAST = {"xla_backend_optimization_level": 0}
EXAMPLES = {"recurrent": 4, "chunk": 4, "pallas": 2}
CHUNK_EXAMPLES = {"chunk": 3}  # chunk-size invariance
# Which variants each property runs, so that every variant meets every XLA impl (recurrent, chunk) in
# some property and every property meets both families and both gate kinds: the compiles, not the
# examples, are the suite's time. LINEAR_ATTENTION_JAX_PROPERTIES=all runs every variant everywhere.
POOL = {"future": ("gated_delta_rule", "gla"), "chunk_size": ("kda", "simple_gla"),
        "split": ("linear_attention", "kda"), "packing": ("delta_rule", "simple_gla"),
        "grouped": ("retention",)}
PALLAS_POOL = {"future": ("simple_gla",), "chunk_size": ("gla",), "split": ("kda",), "packing": ("gla",),
               "grouped": ()}  # grouped heads in the kernels: tests/ops/test_pallas_dispatch.py


def cases(prop, impls=("recurrent", "chunk")):
  everything = os.environ.get("LINEAR_ATTENTION_JAX_PROPERTIES") == "all"
  out = [(v, i) for i in impls for v in (ops.VARIANTS if everything else POOL[prop])]
  kernels = ("simple_gla", "gla", "kda", "gated_delta_rule") if everything else PALLAS_POOL[prop]
  return out + [(v, "pallas") for v in kernels]


SEEDS = st.integers(0, 2**31 - 1)
STRENGTHS = st.floats(0.01, 30.0)  # the gate magnitude: from no decay to beyond the floor (-20)
TOL = 2e-5


def prove(impl, check, examples=None, **strategies):
  """Runs `check(**draws)` on `EXAMPLES[impl]` (or `examples`) derandomized draws of `strategies`."""
  n = EXAMPLES[impl] if examples is None else examples

  @settings(max_examples=n, deadline=None, derandomize=True, database=None)
  @given(st.fixed_dictionaries(strategies))
  def inner(draws):
    check(**draws)

  inner()


def _chunk(impl):
  return 16 if impl == "pallas" else 8


def make(variant, seed, strength, *, T=T, H=H, rows=1):
  """The variant's inputs as a dict (traced under jit): q, k, v, g (log-decay), beta, h0."""
  gate, has_beta = FAMILY[variant]
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q = jax.random.normal(ks[0], (1, T, H, K))
  k = jax.random.normal(ks[1], (1, T, H, K))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True) if has_beta else 0.5 * k
  x = {"q": q, "k": k, "v": jax.random.normal(ks[2], (1, T, HV, V)), "g": None, "beta": None}
  if gate is not None:
    shape = (1, T, HV) if gate == "scalar" else (1, T, HV, K)
    x["g"] = -strength * jax.nn.sigmoid(jax.random.normal(ks[3], shape))
  if has_beta:
    x["beta"] = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, HV)))
  extra = 1 if variant == "linear_attention" else 0  # the normaliser column, kept positive
  h0 = jax.random.normal(ks[5], (rows, HV, K, V + extra))
  if extra:
    h0 = h0.at[..., -1].set(jnp.abs(h0[..., -1]) + 1.0)
  x["h0"] = h0
  return x


def run(variant, x, impl, **kw):
  """`ops.<variant>` on the arrays of `x`; for impl "pallas" the TPU kernels in their interpreter."""
  gate, has_beta = FAMILY[variant]
  args = [x["q"], x["k"], x["v"]] + ([x["g"]] if gate else []) + ([x["beta"]] if has_beta else [])
  kw.setdefault("chunk_size", _chunk(impl))
  kw.setdefault("initial_state", x["h0"])
  if variant in ("delta_rule", "gated_delta_rule", "kda"):
    kw["use_qk_l2norm"] = True
  if variant == "linear_attention":
    kw["feature_map"] = "relu"  # phi(0) = 0: a zero key is a neutral token
  if impl == "pallas":
    with tpu.interpret_kernels(pltpu.InterpretParams(random_seed=3)):
      return getattr(ops, variant)(*args, impl="pallas", output_final_state=True, **kw)
  return getattr(ops, variant)(*args, impl=impl, output_final_state=True, **kw)


def undo_decay(variant, h0, n):
  """The state that `n` neutral tokens turn into `h0`: `h0` itself, except for retention, whose
  constant decay gamma (no g argument) also acts on neutral tokens: `h0 / gamma ** n`."""
  if variant != "retention":
    return h0
  gamma = 1.0 - 2.0 ** (-5.0 - jnp.arange(HV, dtype=jnp.float32))  # retention's default
  return h0 * (gamma ** -jnp.asarray(n, jnp.float32))[:, None, None]


def neutral(x, keep):
  """`x` with every token where `keep [T]` is False made neutral (k = v = g = beta = 0)."""
  out = dict(x)
  for n in ("k", "v", "g", "beta"):
    if x[n] is not None:
      out[n] = jnp.where(keep.reshape((1, -1) + (1,) * (x[n].ndim - 2)), x[n], 0.0)
  return out


def roll(x, shift):
  """Every per-token input of `x` rolled by `shift` along T (h0 stays)."""
  return {n: (a if a is None or n == "h0" else jnp.roll(a, shift, axis=1)) for n, a in x.items()}


def rows(*xs):
  """The inputs `xs` (dicts of `make`) as the rows of one call (h0 too): rows are independent, so
  one compiled call serves what would be several."""
  return {n: None if xs[0][n] is None else jnp.concatenate([x[n] for x in xs]) for n in xs[0]}


def assert_close(got, want, what, tol=TOL):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
  err = float(np.max(np.abs(got - want))) if want.size else 0.0
  assert err <= tol * scale, f"{what}: max error {err:.2e} (scale {scale:.1e})"


# --- future invariance -------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("variant", "impl"), compiler_options=FAST)
def _future(seed, strength, P, *, variant, impl):
  """Row 0 the inputs, row 1 the same with q, k, v, g, beta replaced from P on; the gradients of a loss
  on each row's o[:P]."""
  x, other = make(variant, seed, strength), make(variant, seed + 1, strength)
  past = jnp.arange(T) < P
  x2 = {n: (x[n] if n == "h0" or x[n] is None else
            jnp.where(past.reshape((1, -1) + (1,) * (x[n].ndim - 2)), x[n], other[n])) for n in x}
  both = rows(x, x2)
  w = jax.random.normal(jax.random.PRNGKey(7), (1, T, HV, V))
  names = [n for n in both if both[n] is not None]

  def loss(*xs):
    o, _ = run(variant, dict(zip(names, xs)), impl)
    return jnp.sum(jnp.where(past[None, :, None, None], o * w, 0.0)), o

  (_, o), grads = jax.value_and_grad(loss, argnums=tuple(range(len(names))), has_aux=True)(
      *[both[n] for n in names])
  return o, dict(zip(names, grads))


@pytest.mark.parametrize("variant,impl", cases("future"))
def test_future_invariance_of_outputs_and_gradients(variant, impl):
  def check(seed, strength, P):
    o, grads = _future(seed, strength, P, variant=variant, impl=impl)
    assert_close(o[1, :P], o[0, :P], "o before P")
    for n, d in grads.items():
      if n == "h0":
        assert_close(d[1], d[0], "dh0")
        continue
      assert_close(d[1, :P], d[0, :P], f"d{n} before P")
      assert_close(d[:, P:], np.zeros_like(d[:, P:]), f"d{n} from P on (zero)")

  prove(impl, check, seed=SEEDS, strength=STRENGTHS, P=st.integers(1, T - 1))


# --- chunk-size invariance ---------------------------------------------------------------------------

# chunk sizes per variant (together 16 ... 128 for each impl); T = 72: chunks of 128 hold all tokens
# (padded), chunks of 16 four and a half
CHUNKS = {("kda", "chunk"): (16, 128), ("simple_gla", "chunk"): (32, 64), ("gla", "pallas"): (16, 32)}
ALL_CHUNKS = {"chunk": (16, 32, 64, 128), "pallas": (16, 32)}
T_CHUNKS = 72


def chunk_sizes(variant, impl):
  if os.environ.get("LINEAR_ATTENTION_JAX_PROPERTIES") == "all":
    return ALL_CHUNKS[impl]
  return CHUNKS.get((variant, impl), ALL_CHUNKS[impl])


@functools.partial(jax.jit, static_argnames=("variant", "impl"), compiler_options=FAST)
def _chunk_sizes(seed, strength, *, variant, impl):
  x = make(variant, seed, strength, T=T_CHUNKS)
  want = run(variant, x, "recurrent")
  return want, [run(variant, x, impl, chunk_size=C) for C in chunk_sizes(variant, impl)]


@pytest.mark.parametrize("variant,impl", cases("chunk_size", impls=("chunk",)))
def test_chunk_size_invariance(variant, impl):
  def check(seed, strength):
    (o, final), got = _chunk_sizes(seed, strength, variant=variant, impl=impl)
    for C, (o_c, final_c) in zip(chunk_sizes(variant, impl), got):
      assert_close(o_c, o, f"o, chunk_size={C}")
      assert_close(final_c, final, f"final state, chunk_size={C}")

  prove(impl, check, examples=CHUNK_EXAMPLES.get(impl), seed=SEEDS, strength=STRENGTHS)


# --- split invariance --------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("variant", "impl"), compiler_options=FAST)
def _split(seed, strength, P, *, variant, impl):
  """Row 0 the whole call; row 1 the first piece, at the row's end after T - P neutral tokens; then the
  second piece in its place after P neutral tokens, from row 1's final state."""
  x = make(variant, seed, strength)
  t = jnp.arange(T)
  first = neutral(roll(x, T - P), t >= T - P)
  first["h0"] = undo_decay(variant, x["h0"], T - P)
  o, final = run(variant, rows(x, first), impl)
  second, end = run(variant, neutral(x, t >= P), impl, initial_state=undo_decay(variant, final[1:], P))
  return o[:1], final[:1], jnp.roll(o[1:], P - T, axis=1), second, end


@pytest.mark.parametrize("variant,impl", cases("split"))
def test_split_invariance_with_the_state_carried(variant, impl):
  def check(seed, strength, P):
    o, final, first, second, end = _split(seed, strength, P, variant=variant, impl=impl)
    assert_close(first[:, :P], o[:, :P], "o of the first piece")
    assert_close(second[:, P:], o[:, P:], "o of the second piece")
    assert_close(end, final, "final state")

  prove(impl, check, seed=SEEDS, strength=STRENGTHS, P=st.integers(1, T - 1))


# --- packing equivalence -----------------------------------------------------------------------------

DOCS = 3


@functools.partial(jax.jit, static_argnames=("variant", "impl"), compiler_options=FAST)
def _packing(seed, strength, cu, *, variant, impl):
  """The row packed by segment_ids (its initial state for its first non-empty document), by cu_seqlens
  (an initial state per document), and each document alone in a row of its own, at the row's end after
  neutral tokens: DOCS rows with the cu_seqlens initial states, DOCS with the segment_ids ones."""
  x = make(variant, seed, strength, rows=DOCS)
  t = jnp.arange(T)
  lengths = cu[1:] - cu[:-1]
  first = jnp.argmax(lengths > 0)
  seg_h0 = jnp.where((jnp.arange(DOCS) == first)[:, None, None, None], x["h0"][:1], 0.0)
  out = {"seg": run(variant, x, impl, segment_ids=jnp.searchsorted(cu[1:], t, side="right")[None],
                    initial_state=x["h0"][:1])}
  if impl != "pallas":  # no kernel takes cu_seqlens
    out["cu"] = run(variant, x, impl, cu_seqlens=cu)
  alone = []
  for n in range(DOCS):
    doc = neutral(roll(x, T - cu[n + 1]), t >= T - lengths[n])
    alone.append(dict(doc, h0=undo_decay(variant, x["h0"][n:n + 1], T - lengths[n])))
  for n in range(DOCS):
    alone.append(dict(alone[n], h0=undo_decay(variant, seg_h0[n:n + 1], T - lengths[n])))
  o, final = run(variant, rows(*alone), impl)
  out["alone"] = (jnp.stack([jnp.roll(o[n], cu[n % DOCS + 1] - T, axis=0) for n in range(2 * DOCS)]),
                  final)
  return out


@pytest.mark.parametrize("variant,impl", cases("packing"))
def test_packing_segment_ids_equals_cu_seqlens_equals_separate_calls(variant, impl):
  def check(seed, strength, cuts):
    cu = np.array([0, *sorted(cuts), T], np.int32)  # empty documents allowed
    out = _packing(seed, strength, jnp.asarray(cu), variant=variant, impl=impl)
    o_alone, final_alone = out["alone"]
    last = max(n for n in range(DOCS) if cu[n + 1] > cu[n])
    for n in range(DOCS):
      a, b = cu[n], cu[n + 1]
      if "cu" in out:
        assert_close(out["cu"][0][0, a:b], o_alone[n, a:b], f"cu_seqlens o of document {n}")
        assert_close(out["cu"][1][n], final_alone[n], f"cu_seqlens final state of document {n}")
      assert_close(out["seg"][0][0, a:b], o_alone[DOCS + n, a:b], f"segment_ids o of document {n}")
    assert_close(out["seg"][1][0], final_alone[DOCS + last], "segment_ids final state (last document)")

  prove(impl, check, seed=SEEDS, strength=STRENGTHS,
        cuts=st.lists(st.integers(0, T), min_size=DOCS - 1, max_size=DOCS - 1))


# --- grouped heads -----------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("variant", "impl"), compiler_options=FAST)
def _grouped(seed, strength, *, variant, impl):
  x = make(variant, seed, strength)
  repeated = dict(x, q=jnp.repeat(x["q"], HV, axis=2), k=jnp.repeat(x["k"], HV, axis=2))
  return run(variant, x, impl), run(variant, repeated, impl)


@pytest.mark.parametrize("variant,impl", cases("grouped"))
def test_grouped_heads_equal_repeated_heads(variant, impl):
  def check(seed, strength):
    (o, final), (o_r, final_r) = _grouped(seed, strength, variant=variant, impl=impl)
    assert_close(o, o_r, "o")
    assert_close(final, final_r, "final state")

  prove(impl, check, seed=SEEDS, strength=STRENGTHS)
