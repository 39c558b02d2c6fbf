"""Mosaic TPU kernels (`pl.pallas_call` + `pltpu`) for the chunked form of both families.

`chunked_attention` is the op; `supports` says whether it serves a call (and why not);
`interpret_kernels` runs the kernels in the TPU interpreter; under `jax.shard_map` the op runs per
shard (the library's `linear_attention_jax.sharding.shard_op`). NOTES.md holds the block-size reasoning
and the roofline.
"""

from .ops import (chunked_attention, explicitly_sharded, interpret_kernels, interpreting,
                                    supports, walked_columns)
from .walk import BlockSizes

__all__ = ["BlockSizes", "chunked_attention", "explicitly_sharded", "interpret_kernels", "interpreting",
           "supports", "walked_columns"]
