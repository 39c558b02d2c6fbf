"""Mosaic GPU kernels (`plgpu.kernel`, wgmma, TMA) for the chunk walk of both families, on Hopper.

`chunked_attention` is the op; `supports` says whether it serves a call (and why not);
`interpret_kernels` runs the kernels in the Mosaic GPU interpreter (whose multi-warpgroup kernels need
`interpreter_threads()` above their warpgroups); under `jax.shard_map` it runs per shard (`shard_op`
of linear_attention_jax.sharding). `walk`: the chunk walks over prepared tensors (every variant); `fused`: the
additive family with no or scalar decay, with no XLA preparation; `delta_prep`: the delta family's
forward preparation (no or scalar decay) as one kernel. Both are the default where they apply.
NOTES.md holds the cost model and each
measured version.
"""

from pallas_kernels.gpu.ops import (chunked_attention, hopper_reason, interpret_kernels, interpreter_threads,
                                    interpreting, supports)

__all__ = ["chunked_attention", "hopper_reason", "interpret_kernels", "interpreter_threads", "interpreting",
           "supports"]
