"""Mosaic GPU kernels (`plgpu.kernel`, wgmma, TMA) for the chunked forms of both families, on Hopper.

`chunked_attention` is the op; `plan` says what runs for a call, forward and backward, in its
docstring's table (`plan.select`), `call_plan` for given arguments, and `GpuConfig` holds the tuning values
(`default_config` sets them for calls that pass none: the ops and layers);
`supports` says whether the kernels serve a call (and why not); `interpret_kernels` runs the kernels in
the Mosaic GPU interpreter (whose multi-warpgroup kernels need `interpreter_threads()` above their
warpgroups); under `jax.shard_map` it runs per shard (`linear_attention_jax.sharding.shard_op`).
`shared_compiles.enable()` (opt-in) compiles a kernel that several layers share once, not once a layer.
NOTES.md holds the cost model and each measured version.

The kernels, by stage (each file's `kernel_name`s are `chunk_{prep,walk,grads}_<cell>`):
- `walk`: the chunk walks over prepared tensors, every variant;
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

from . import shared_compiles
from .interpret import interpret_kernels, interpreter_threads, interpreting
from .ops import (call_plan, chunked_attention, default_config, fused_gate, layers_order_channels,
                  ordered_channels)
from . import plan
from .plan import GpuConfig, Plan, hopper_reason, supports, walked_columns

__all__ = ["GpuConfig", "Plan", "call_plan", "chunked_attention", "default_config", "fused_gate",
           "hopper_reason", "interpret_kernels", "interpreter_threads", "interpreting",
           "layers_order_channels", "ordered_channels", "plan", "shared_compiles", "supports",
           "walked_columns"]
