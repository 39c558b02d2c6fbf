"""Cache memory: constant in the context for linear mixers, linear in it for attention.

Measured with `jax.eval_shape` on abstract ~125M models, so nothing is allocated.
"""

from __future__ import annotations

import jax
from flax import nnx

from linear_attention_jax.layers import nbytes
from linear_attention_jax.models import LM, preset_125m

CONTEXTS = (1024, 2048, 65536)


def cache_bytes(pattern: str) -> dict[int, int]:
  """Bytes of `init_cache(batch=1, max_len=L)` for each L in CONTEXTS, from shapes alone."""
  model = nnx.eval_shape(lambda: LM(preset_125m(pattern), rngs=nnx.Rngs(0)))
  return {L: nbytes(jax.eval_shape(lambda L=L: model.init_cache(1, L))) for L in CONTEXTS}


def test_linear_cache_is_constant_and_attention_cache_grows_linearly():
  # Given ~125M models: pure Gated DeltaNet, pure KDA, a Transformer, and a GGGA hybrid
  sizes = {pattern: cache_bytes(pattern) for pattern in ("G", "K", "A", "GGGA")}
  for pattern, by_len in sizes.items():
    print(f"pattern {pattern!r}: cache bytes per sequence "
          + ", ".join(f"max_len {L:>6}: {b:>13,}" for L, b in by_len.items()))
  # Then the pure-linear caches are identical at 1K and 64K
  for pattern in ("G", "K"):
    assert sizes[pattern][1024] == sizes[pattern][65536]
  # And the caches with attention grow by a fixed amount per token (an affine function of L)
  for pattern in ("A", "GGGA"):
    b = sizes[pattern]
    per_token = (b[2048] - b[1024]) / 1024
    assert per_token > 0
    assert b[65536] - b[1024] == per_token * (65536 - 1024)
  # KV of 12 layers (3 in GGGA) x 2 x 12 heads x 64 dims x 4 bytes per token
  assert (sizes["A"][2048] - sizes["A"][1024]) / 1024 == 12 * 2 * 12 * 64 * 4
  assert (sizes["GGGA"][2048] - sizes["GGGA"][1024]) / 1024 == 3 * 2 * 12 * 64 * 4
