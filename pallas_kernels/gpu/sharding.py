"""`chunked_attention` of the GPU kernels under `jax.shard_map` (`pallas_kernels.sharding`)."""

from __future__ import annotations

import functools

from pallas_kernels.gpu.ops import chunked_attention
from pallas_kernels.sharding import shard_chunked

sharded_chunked_attention = functools.partial(shard_chunked, chunked_attention)
sharded_chunked_attention.__doc__ = (
    "`sharded_chunked_attention(mesh, *, batch_axis=None, head_axis=None, value_axis=None, "
    "check_vma=True, **options)`: `pallas_kernels.sharding.shard_chunked` for the GPU kernels.")
