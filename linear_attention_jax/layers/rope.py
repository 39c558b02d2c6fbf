"""Rotary position embedding (Su et al. 2021), used by softmax Attention and by RetNet's retention.

Pairs channel i with channel i + D/2 ("rotate half") and rotates the pair by `position * theta^(-2i/D)`,
so the dot product of a rotated query and key depends only on their distance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float = 10000.0) -> jax.Array:
  """Rotates `x: [B, T, H, D]` (D even) at `positions: [T]` int. Returns x's shape and dtype.

  The rotation is computed in float32.
  """
  D = x.shape[-1]
  if D % 2:
    raise ValueError(f"rotary embedding needs an even head dim; got D={D}")
  inv_freq = theta ** (-jnp.arange(0, D // 2, dtype=jnp.float32) * 2.0 / D)  # [D/2]
  angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]       # [T, D/2]
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :D // 2], x32[..., D // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
