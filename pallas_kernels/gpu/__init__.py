"""Mosaic GPU kernels (`plgpu.kernel`, wgmma, TMA) for the chunk walk of both families, on Hopper.

`chunked_attention` is the op; `supports` says whether it serves a call (and why not);
`interpret_kernels` runs the kernels in the Mosaic GPU interpreter (whose multi-warpgroup kernels need
`interpreter_threads()` above their warpgroups); `sharded_chunked_attention` wraps the
op in `jax.shard_map`. NOTES.md holds the cost model and each measured version.

The kernels, by stage (each file's `kernel_name`s are `chunk_{prep,walk,grads}_<cell>`):
- `walk` (+ `walk_streamed`, its warpgroup-specialised form): the chunk walks over prepared tensors,
  every variant;
- `fused` (+ `fused_streamed`, `fused_grads`): the additive family with no or scalar decay, every stage
  with no XLA preparation;
- `delta_prep`, `delta_grads` (+ `delta_grads_pair`, `delta_terms`): the delta family with no or scalar
  decay, its forward preparation and its per-chunk gradients;
- `channel_prep`, `channel_grads`, `channel_delta_grads`: per-channel decay's preparation (gla, kda)
  and gradients (gla, kda).

What they share: `tiles` (layouts, shared memory, tensor-core products, l2 rows, the unit lower
inverse), `masks` (packed rows), `decay` (scalar decay's G and its tiles), `pipeline` (the walks'
TMA chunk pipeline and sequence pieces) and `channel` (per-channel decay's G, bound and key gradients).
"""

from pallas_kernels.gpu.ops import (chunked_attention, hopper_reason, interpret_kernels, interpreter_threads,
                                    interpreting, supports)
from pallas_kernels.gpu.sharding import sharded_chunked_attention

__all__ = ["chunked_attention", "hopper_reason", "interpret_kernels", "interpreter_threads", "interpreting",
           "sharded_chunked_attention", "supports"]
