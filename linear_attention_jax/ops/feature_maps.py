"""Feature maps phi for kernel linear attention (Katharopoulos et al. 2020 and successors)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

FEATURE_MAPS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "elu_plus_one": lambda x: jax.nn.elu(x) + 1.0,  # Katharopoulos et al.: positive, smooth
    "relu": jax.nn.relu,
    "identity": lambda x: x,
    "silu": jax.nn.silu,
}


def resolve_feature_map(feature_map) -> Callable[[jax.Array], jax.Array]:
  """A name from `FEATURE_MAPS` or a callable `[..., K] -> [..., K]`."""
  if callable(feature_map):
    return feature_map
  if isinstance(feature_map, str) and feature_map in FEATURE_MAPS:
    return FEATURE_MAPS[feature_map]
  raise ValueError(
      f"feature_map must be a callable or one of {sorted(FEATURE_MAPS)}; got {feature_map!r}")


def l2_normalize(x, eps: float = 1e-6):
  """`x / sqrt(sum(x**2) + eps)` over the last axis (the head dimension), in float32: `[..., K]` to
  `[..., K]`."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
