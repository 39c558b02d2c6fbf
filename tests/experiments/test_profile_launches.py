"""profile_step's reading of how a step is launched: the short gaps between kernels (launches) apart
from the idle time, and what the compiled entry computation launches, by kind."""

import pytest


def test_short_gaps_are_counted_apart_from_a_stall():
  # Given a call whose kernels are 8 us and 1 us apart and then 300 us apart (the host fell behind)
  from experiments import lm_benchmark, profile_step  # noqa: F401  (flags defined side by side)
  kernels = [dict(name=n, ts=t, dur=d) for n, t, d in (("a", 0, 10), ("b", 18, 2), ("c", 21, 9),
                                                       ("d", 330, 10))]
  t = profile_step.timeline(kernels, calls=1)
  # Then the two short gaps are the launches' 9 us; the stall is idle time but not among them
  assert t["short_gaps"] == 2 and t["short_gaps_ms"] == pytest.approx(0.009)
  assert t["idle_ms"] == pytest.approx(0.309) and t["longest_idle_ms"] == pytest.approx(0.300)


GPU_ENTRY = """HloModule jit_step

%command_buffer.3 (p0: bf16[8,64]) -> bf16[8,64] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  ROOT %fusion.9 = bf16[8,64]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation.9
}

ENTRY %main.12 (Arg_0.1: bf16[8,64], Arg_1.2: f32[64]) -> (bf16[8,64], f32[]) {
  %Arg_0.1 = bf16[8,64]{1,0} parameter(0), metadata={op_name="x"}
  %Arg_1.2 = f32[64]{0} parameter(1)
  %call = bf16[8,64]{1,0} call(%Arg_0.1), to_apply=%command_buffer.3
  %custom-call.4 = (bf16[8,64]{1,0}, s8[128]{0}) custom-call(%call), custom_call_target="mosaic_gpu_v2"
  %get-tuple-element.5 = bf16[8,64]{1,0} get-tuple-element(%custom-call.4), index=0
  %call.1 = bf16[8,64]{1,0} call(%get-tuple-element.5), to_apply=%command_buffer.3
  %fusion.2 = f32[] fusion(%Arg_1.2), kind=kInput, calls=%fused_reduce
  %custom-call.7 = (bf16[8,64]{1,0}, s8[4]{0}) custom-call(%call.1), custom_call_target="__cublas$lt$matmul"
  %get-tuple-element.8 = bf16[8,64]{1,0} get-tuple-element(%custom-call.7), index=0
  ROOT %tuple.9 = (bf16[8,64]{1,0}, f32[]) tuple(%get-tuple-element.8, %fusion.2)
}
"""


def test_launches_counts_what_the_entry_runs_as_kernels():
  from experiments import lm_benchmark, profile_step  # noqa: F401
  got = profile_step.launches(GPU_ENTRY)
  # the entry's own instructions, not the called computation's; parameters and tuples launch nothing
  assert got == dict(launched=5, launched_kinds={"call": 2, "custom-call mosaic_gpu_v2": 1, "fusion": 1,
                                                 "custom-call __cublas$lt$matmul": 1})
