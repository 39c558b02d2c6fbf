"""Smoke test of experiments/sharded_throughput.py: a data-parallel and a tensor-parallel layout and
the one-device baseline in the same call (8 simulated CPU devices), through train.py's training path,
with equal losses, a table on stdout and the results in {workdir}/sharded_throughput.json. An
attention-only LM keeps it quick; the linear mixers' sharded steps are tested in test_model.py and
test_train_script.py."""

import json
import os
import subprocess
import sys

from tests.sharding.multidevice import DEVICES, ROOT


def test_throughput_script_runs_layouts_against_one_device(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
  command = [sys.executable, "experiments/sharded_throughput.py", "--layouts=dp:data=8,tp:tensor=2",
             "--pattern=A", "--width=32", "--depth=1", "--num_heads=2", "--batch_size=8",
             "--seq_len=16", "--steps=2", "--chunk_size=8", f"--workdir={tmp_path}"]
  proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(tmp_path / "sharded_throughput.json", encoding="utf-8") as f:
    results = json.load(f)["results"]
  assert [r["layout"] for r in results] == ["1 device (cpu)", "dp (data=8)", "tp (data=4, tensor=2)"]
  assert [r["devices"] for r in results] == [1, 8, 8]
  for r in results:
    assert r["tokens_per_s"] > 0 and len(r["losses"]) == 3 and r["step_bytes_per_device"] > 0, r
    assert r["layout"] in proc.stdout
    assert abs(r["final_loss"] - results[0]["final_loss"]) <= 1e-5 * results[0]["final_loss"], results
  assert results[2]["mesh"] == {"data": 4, "fsdp": 1, "seq": 1, "tensor": 2}
  assert "P(None, 'tensor')" in results[2]["param_specs"]  # the tp layout really split parameters
  assert f"wrote {tmp_path / 'sharded_throughput.json'}" in proc.stdout
  assert (tmp_path / "sharded_throughput.txt").read_text().strip() in proc.stdout
