"""Sampling from an `LM` under `jax.jit`: one prefill of the prompt, then one decode step per token.

Greedy with `temperature=0`, else softmax sampling at that temperature, optionally restricted to the
`top_k` most likely tokens. A fixed PRNG key gives the same tokens on every call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.models.lm import LM


def sample_token(logits: jax.Array, key: jax.Array, *, temperature: float = 0.0,
                 top_k: int | None = None) -> jax.Array:
  """One token per row from `logits: [B, vocab]`: argmax when temperature == 0. Returns `[B]` int32."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(model: LM, prompt: jax.Array, max_new_tokens: int, *, key: jax.Array | None = None,
             temperature: float = 0.0, top_k: int | None = None,
             max_len: int | None = None) -> jax.Array:
  """Extends `prompt: [B, T]` int by `max_new_tokens` tokens.

  Args:
    model: the LM.
    prompt: `[B, T]` integer tokens, T >= 1.
    max_new_tokens: N >= 1 tokens to produce.
    key: PRNG key (required when temperature > 0).
    temperature: 0 for greedy decoding, else the softmax temperature.
    top_k: sample only among the k most likely tokens (None: all).
    max_len: the cache's context limit (default T + N); must be >= T + N.

  Returns:
    `[B, T + N]` int32: the prompt followed by the new tokens.
  """
  if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise ValueError(f"prompt must be an integer array [B, T] with T >= 1; got {prompt.dtype} "
                     f"{prompt.shape}")
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer; got {max_new_tokens!r}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0; got {temperature=}")
  if temperature > 0 and key is None:
    raise ValueError("sampling with temperature > 0 needs a PRNG key")
  vocab = model.config.vocab_size
  if top_k is not None and not 1 <= top_k <= vocab:
    raise ValueError(f"top_k must lie in [1, vocab_size={vocab}]; got {top_k=}")
  needed = prompt.shape[1] + max_new_tokens
  max_len = needed if max_len is None else max_len
  if max_len < needed:
    raise ValueError(f"decoding past max_len: prompt T={prompt.shape[1]} + max_new_tokens="
                     f"{max_new_tokens} > max_len={max_len}")
  key = jax.random.key(0) if key is None else key
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, prompt.astype(jnp.int32), key, max_new_tokens=max_new_tokens,
                   temperature=float(temperature), top_k=top_k, max_len=max_len)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k",
                                             "max_len"))
def _generate(graphdef, state, prompt, key, *, max_new_tokens, temperature, top_k, max_len):
  model = nnx.merge(graphdef, state)
  sample = functools.partial(sample_token, temperature=temperature, top_k=top_k)
  keys = jax.random.split(key, max_new_tokens)
  cache = model.init_cache(prompt.shape[0], max_len)
  logits, cache = model(prompt, cache)
  first = sample(logits[:, -1], keys[0])

  def step(carry, step_key):
    token, cache = carry
    logits, cache = model(token[:, None], cache)
    return (sample(logits[:, -1], step_key), cache), token

  (last, _), tokens = jax.lax.scan(step, (first, cache), keys[1:])
  return jnp.concatenate([prompt, tokens.T, last[:, None]], axis=1)
