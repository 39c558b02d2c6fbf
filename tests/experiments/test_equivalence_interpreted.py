"""`experiments/equivalence.py --interpret`: impl "pallas" through the Mosaic GPU kernels in their
interpreter on this CPU, against the recurrent form (kda through its bounded gate's pre-activation)."""

import numpy as np

from experiments import equivalence
from linear_attention_jax.pallas_kernels import gpu as gpu_kernels


def test_equivalence_runs_the_gpu_kernels_in_their_interpreter(tmp_path, monkeypatch, capsys):
  calls = []
  original = gpu_kernels.chunked_attention
  monkeypatch.setattr(gpu_kernels, "chunked_attention",
                      lambda *a, **k: calls.append(k.get("interpret")) or original(*a, **k))
  config = equivalence.Config(variants=("kda",), T=(70,), B=1, H=1, H_v=1, K=64, V=64, dtype="bfloat16",
                              impls=("recurrent", "pallas"), packed=1, gates="bounded", gate_inputs=True,
                              interpret=True)
  results = equivalence.run_equivalence(config, str(tmp_path))
  assert calls, "impl='pallas' did not reach the GPU kernels"
  assert "the GPU kernels interpreted" in capsys.readouterr().out
  (row,) = results["rows"]
  assert set(row["errors"]) == {"o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"}
  # bfloat16 operands against the float32 recurrence: rounding-sized. dA_log, one head's sum over
  # every token and channel, cancels here to ~1e-3 of its terms (-0.009 against dt_bias's cotangents up
  # to 13): its relative error says nothing of the kernels at this size, only that it is finite
  errors = {n: e for n, e in row["errors"].items() if n != "dA_log"}
  assert all(1e-4 < e < 1e-2 for e in errors.values()), row["errors"]
  assert np.isfinite(row["errors"]["dA_log"])
