"""decode.py: cache bytes are flat in the context for linear layers and grow linearly for attention."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from experiments import decode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["contexts=[16, 32, 64]", "model.width=32", "model.depth=2", "model.num_heads=2",
        'models=[["linear", "L"], ["attention", "A"], ["hybrid", "LA"]]', "warmup=1", "iters=2"]


def test_cache_is_flat_for_linear_layers_and_linear_in_the_context_for_attention(tmp_path):
  # Given three tiny models at contexts 16, 32 and 64
  config = decode.load_config("decode_latency", TINY)
  # When decode steps are timed at each context
  results = decode.run_decode(config, str(tmp_path))
  rows = {(r["model"], r["context"]): r for r in results["rows"]}
  # Then every step ran and took time
  assert all(r["ms_per_token"] > 0 and len(r["times_ms"]) == 2 for r in results["rows"])
  # And the linear model's cache does not depend on the context
  linear = [rows[("linear", L)]["cache_bytes"] for L in (16, 32, 64)]
  assert linear[0] == linear[1] == linear[2]
  # And attention's grows by the same bytes per token: 2 layers x K and V x 2 heads x 16 x 4 bytes
  for name, layers in (("attention", 2), ("hybrid", 1)):
    b = [rows[(name, L)]["cache_bytes"] for L in (16, 32, 64)]
    assert (b[1] - b[0]) / 16 == (b[2] - b[1]) / 32 == layers * 2 * 2 * 16 * 4
  # And the reported elements match LM.state_size
  assert rows[("attention", 64)]["state_elements"] * 4 + 4 * 2 == rows[("attention", 64)]["cache_bytes"]
  with open(tmp_path / "decode.json", encoding="utf-8") as f:
    assert len(json.load(f)["rows"]) == 9
  with open(tmp_path / "decode.md", encoding="utf-8") as f:
    assert "| attention | `A` | cache MiB |" in f.read()


def test_main_writes_the_table(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "decode.py"), f"--workdir={tmp_path}",
         *(f"--set={s}" for s in TINY), '--set=models=[["linear", "L"]]', "--set=contexts=[8]"]
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"wrote {tmp_path / 'decode.md'}" in done.stdout
