"""Properties over random shapes and gate strengths (hypothesis; bounded and derandomized so CI is fast
and reproducible): future invariance, chunk-size invariance, split invariance, packing equivalence and
grouped heads == repeated heads, for the forms the CPU runs (recurrent, chunk). Kernels in the
interpreters and context parallel are not in this suite yet."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from linear_attention_jax import ops

SETTINGS = settings(max_examples=2, deadline=None, derandomize=True, database=None)
VARIANTS = st.sampled_from(["gated_delta_rule", "gla", "kda", "simple_gla", "delta_rule"])
IMPLS = st.sampled_from(["recurrent", "chunk"])
T_VALUES = st.sampled_from([5, 16, 23])
STRENGTH = st.sampled_from([0.05, 1.0, 8.0])  # gate magnitude: weak to strong decay
K, V = 4, 3


def make(variant, T, strength, seed, H=1, Hv=1):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q, k = (jax.random.normal(x, (1, T, H, K)) for x in ks[:2])
  v = jax.random.normal(ks[2], (1, T, Hv, V))
  g = -strength * jax.nn.sigmoid(jax.random.normal(ks[3], (1, T, Hv, K)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, Hv)))
  gates = {"simple_gla": (g[..., 0],), "gla": (g,), "gated_delta_rule": (g[..., 0], beta),
           "kda": (g, beta), "delta_rule": (beta,)}[variant]
  return q, k, v, gates


def run(variant, q, k, v, gates, impl, **kw):
  kw.setdefault("chunk_size", 8)
  if variant in ("delta_rule", "gated_delta_rule", "kda"):
    kw.setdefault("use_qk_l2norm", True)
  return getattr(ops, variant)(q, k, v, *gates, impl=impl, **kw)


def close(a, b, tol=2e-4):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@SETTINGS
@given(VARIANTS, IMPLS, T_VALUES, STRENGTH, st.integers(0, 2**16), st.data())
def test_future_invariance_of_outputs_and_gradients(variant, impl, T, strength, seed, data):
  P = data.draw(st.integers(1, T - 1))
  q, k, v, gates = make(variant, T, strength, seed)
  noise = jax.random.normal(jax.random.PRNGKey(seed + 1), v.shape)
  v2 = v.at[:, P:].add(noise[:, P:])
  past = lambda v_: jnp.sum(run(variant, q, k, v_, gates, impl)[0][:, :P] ** 2)
  close(run(variant, q, k, v, gates, impl)[0][:, :P], run(variant, q, k, v2, gates, impl)[0][:, :P])
  close(jax.grad(past)(v), jax.grad(past)(v2))


@SETTINGS
@given(VARIANTS, T_VALUES, STRENGTH, st.integers(0, 2**16), st.sampled_from([16, 32, 128]))
def test_chunk_size_invariance(variant, T, strength, seed, chunk):
  q, k, v, gates = make(variant, T, strength, seed)
  want, want_s = run(variant, q, k, v, gates, "recurrent", output_final_state=True)
  got, got_s = run(variant, q, k, v, gates, "chunk", chunk_size=chunk, output_final_state=True)
  close(got, want)
  close(got_s, want_s)


@SETTINGS
@given(VARIANTS, IMPLS, T_VALUES, STRENGTH, st.integers(0, 2**16), st.data())
def test_split_invariance_with_the_state_carried(variant, impl, T, strength, seed, data):
  P = data.draw(st.integers(1, T - 1))
  q, k, v, gates = make(variant, T, strength, seed)
  whole, final = run(variant, q, k, v, gates, impl, output_final_state=True)
  cut = lambda x, sl: x[:, sl]
  first, mid = run(variant, cut(q, slice(None, P)), cut(k, slice(None, P)), cut(v, slice(None, P)),
                   tuple(cut(g, slice(None, P)) for g in gates), impl, output_final_state=True)
  second, end = run(variant, cut(q, slice(P, None)), cut(k, slice(P, None)), cut(v, slice(P, None)),
                    tuple(cut(g, slice(P, None)) for g in gates), impl, initial_state=mid,
                    output_final_state=True)
  close(jnp.concatenate([first, second], axis=1), whole)
  close(end, final)


@SETTINGS
@given(VARIANTS, IMPLS, STRENGTH, st.integers(0, 2**16), st.lists(st.integers(0, 9), min_size=1,
                                                                   max_size=3))
def test_packing_segment_ids_equals_cu_seqlens_equals_separate_calls(variant, impl, strength, seed,
                                                                      lengths):
  lengths = lengths + [16 - sum(lengths)] if sum(lengths) < 16 else [16]  # an empty one allowed
  cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  q, k, v, gates = make(variant, 16, strength, seed)
  seg = np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)
  by_cu = run(variant, q, k, v, gates, impl, cu_seqlens=cu)[0]
  by_seg = run(variant, q, k, v, gates, impl, segment_ids=seg)[0]
  parts = [run(variant, q[:, a:b], k[:, a:b], v[:, a:b], tuple(g[:, a:b] for g in gates), impl)[0]
           for a, b in zip(cu[:-1], cu[1:]) if b > a]
  close(by_cu, jnp.concatenate(parts, axis=1))
  close(by_seg, by_cu)


@SETTINGS
@given(VARIANTS, IMPLS, T_VALUES, STRENGTH, st.integers(0, 2**16))
def test_grouped_heads_equal_repeated_heads(variant, impl, T, strength, seed):
  q, k, v, gates = make(variant, T, strength, seed, H=1, Hv=2)
  grouped = run(variant, q, k, v, gates, impl)[0]
  repeated = run(variant, jnp.repeat(q, 2, axis=2), jnp.repeat(k, 2, axis=2), v, gates, impl)[0]
  close(grouped, repeated)
