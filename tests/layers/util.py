"""Shared by the layer and model tests: tiny mixers, the error measure, jitted calls."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax import layers

WIDTH, B, T = 32, 2, 13  # T = 13 with chunk_size 8: two chunks, the last one padded
CHUNK = 8


def make_mixer(name: str, *, dtype=jnp.float32, impl: str = "auto", seed: int = 0) -> nnx.Module:
  """A tiny mixer (width 32); several use grouped value heads (H_v = 2 H)."""
  rngs = nnx.Rngs(seed)
  if name == "attention":
    return layers.Attention(WIDTH, 4, num_kv_heads=2, dtype=dtype, rngs=rngs)
  kw = dict(impl=impl, chunk_size=CHUNK, dtype=dtype, rngs=rngs)
  return {
      "linear_attention": lambda: layers.LinearAttention(WIDTH, 2, **kw),
      "retention": lambda: layers.MultiScaleRetention(WIDTH, 2, num_v_heads=4, **kw),
      "gla": lambda: layers.GatedLinearAttention(WIDTH, 2, **kw),
      "delta_net": lambda: layers.DeltaNet(WIDTH, 2, num_v_heads=4, **kw),
      "gated_delta_net": lambda: layers.GatedDeltaNet(WIDTH, 2, num_v_heads=4, **kw),
      "kda": lambda: layers.KimiDeltaAttention(WIDTH, 2, num_v_heads=4, **kw),
  }[name]()


MIXERS = ("linear_attention", "retention", "gla", "delta_net", "gated_delta_net", "kda", "attention")
LINEAR_MIXERS = MIXERS[:-1]


def rel_rms(out, ref) -> float:
  """`rms(out - ref) / rms(ref)`, in float32."""
  out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.sqrt(jnp.mean((out - ref) ** 2)) / jnp.sqrt(jnp.mean(ref ** 2)))


def all_eqns(jaxpr):
  """Every equation of a jaxpr, those of the jaxprs in its equations' parameters included."""
  for e in jaxpr.eqns:
    yield e
    for param in e.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from all_eqns(sub)


# The test shapes are tiny, so XLA's CPU compile time dominates; LLVM's optimisation level changes the
# speed of the generated code, not what it computes.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
fast_jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)


@functools.partial(fast_jit, static_argnums=0)
def _call(graphdef, state, x, cache):
  return nnx.merge(graphdef, state)(x, cache)


def call(module, x, cache):
  """`module(x, cache)` under jit (one compilation per module structure and shape)."""
  graphdef, state = nnx.split(module)
  return _call(graphdef, state, x, cache)


def decode_tokens(module, x, cache, start: int):
  """Feeds `x[:, start:]` one token at a time; returns the outputs `[B, T - start, ...]` and the cache."""
  outs = []
  for t in range(start, x.shape[1]):
    y, cache = call(module, x[:, t:t + 1], cache)
    outs.append(y)
  return jnp.concatenate(outs, axis=1), cache


def inputs(dtype=jnp.float32, seed: int = 1, T: int = T):
  return jax.random.normal(jax.random.key(seed), (B, T, WIDTH), jnp.float32).astype(dtype)
