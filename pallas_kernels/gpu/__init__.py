"""Mosaic GPU kernels (`plgpu.kernel`, wgmma, TMA) for the chunked forms of both families, on Hopper.

`chunked_attention` is the op; `plan` says what runs for a call, forward and backward, in its
docstring's table (`plan.select`), `call_plan` for given arguments, and `GpuConfig` holds the tuning values;
`supports` says whether the kernels serve a call (and why not); `interpret_kernels` runs the kernels in
the Mosaic GPU interpreter (whose multi-warpgroup kernels need `interpreter_threads()` above their
warpgroups). The stages, one module each: `fused` (the additive family with no or scalar decay, no XLA
preparation), `delta_prep` / `channel_prep` (the forward's preparation kernels), `walk` (the walks over
prepared tensors), `delta_grads`, `channel_grads`, `channel_delta_grads` (the gradient kernels).
NOTES.md holds the cost model and each measured version.
"""

from pallas_kernels.gpu.interpret import interpret_kernels, interpreter_threads, interpreting
from pallas_kernels.gpu.ops import call_plan, chunked_attention
from pallas_kernels.gpu import plan
from pallas_kernels.gpu.plan import GpuConfig, Plan, hopper_reason, supports, walked_columns
from pallas_kernels.gpu.sharding import sharded_chunked_attention

__all__ = ["GpuConfig", "Plan", "call_plan", "chunked_attention", "hopper_reason", "interpret_kernels",
           "interpreter_threads", "interpreting", "plan", "sharded_chunked_attention", "supports",
           "walked_columns"]
