"""Linen models: a layer's cache without building the NNX layer's parameters.

`flax.nnx.bridge.to_linen(cls, *args, **kwargs)` wraps a layer for a Linen model; its cache is the
layer's own typed cache (`LinearCache`, `KVCache`, `LatentCache`), which only an NNX instance can make.
`init_cache(cls, *args, batch=B, **kwargs)` builds that instance abstractly (`nnx.eval_shape`: no
parameter is initialised, no random number drawn) and asks it for the cache:

    mixer = bridge.to_linen(layers.GatedDeltaNet, 256, 4, name="mixer")
    cache = layers.init_cache(layers.GatedDeltaNet, 256, 4, batch=1)   # the same arguments
    y, cache = mixer(x, cache)
"""

from __future__ import annotations

from flax import nnx


def init_cache(cls, *args, batch: int, max_len: int | None = None, **kwargs):
  """The fresh cache of `cls(*args, **kwargs)` for `batch` sequences (`max_len`: KV buffer length of
  attention layers; unused by the linear mixers), without initialising its parameters.

  `cls`, `args` and `kwargs` are those given to `flax.nnx.bridge.to_linen`; `rngs` is supplied here.
  Returns the layer's cache type, its arrays `[B, ...]` concrete zeros (states float32).
  """
  if "rngs" in kwargs:
    raise ValueError("init_cache supplies rngs itself (no parameter is built); drop rngs=")
  abstract = nnx.eval_shape(lambda: cls(*args, rngs=nnx.Rngs(0), **kwargs))
  if not hasattr(abstract, "init_cache"):
    raise ValueError(f"{cls.__name__} has no cache (no init_cache method)")
  return abstract.init_cache(batch) if max_len is None else abstract.init_cache(batch, max_len)
