"""Smoke test of experiments/sharded_throughput.py: one device, then a data-parallel and a
tensor-parallel layout in the same call (8 simulated CPU devices), with equal losses. An attention-only
LM keeps it quick; the linear mixers' sharded steps are tested in test_model.py."""

import os
import re
import subprocess
import sys

from tests.sharding.multidevice import DEVICES, ROOT


def test_throughput_script_runs_layouts_against_one_device():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
  command = [sys.executable, "experiments/sharded_throughput.py", "--layouts=dp:data=8,tp:tensor=2",
             "--pattern=A", "--width=32", "--depth=1", "--num_heads=2", "--vocab_size=64",
             "--batch_size=8", "--seq_len=16", "--steps=1", "--chunk_size=8"]
  proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = re.findall(r"^(1 device|dp \(data=8\)|tp \(data=4, tensor=2\))\s+([\d,]+)\s+([\d.]+)x\s+([\d.]+)$",
                    proc.stdout, re.M)
  assert [r[0] for r in rows] == ["1 device", "dp (data=8)", "tp (data=4, tensor=2)"], proc.stdout
  losses = [float(r[3]) for r in rows]
  assert max(losses) - min(losses) < 1e-4, proc.stdout
