"""Smoke tests of the experiment scripts: each plain function on tiny inputs, and each main once."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import benchmark, common, equivalence
from linear_attention_jax import ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_equivalence_every_variant_agrees_in_float32(tmp_path, capsys):
  # Given every variant at T = 5 with chunks of 4 (a full chunk and a padded one), grouped heads
  config = equivalence.Config(T=(5,), B=1, H=1, H_v=2, K=8, V=8, chunk_size=4)
  # When the equivalence run compares chunk with recurrent
  results = equivalence.run_equivalence(config, str(tmp_path))
  # Then the JSON holds the rows, one per variant, with o, state and every input's gradient
  with open(tmp_path / "equivalence.json", encoding="utf-8") as f:
    assert json.load(f)["rows"] == results["rows"]
  assert [r["variant"] for r in results["rows"]] == list(ops.VARIANTS)
  for row in results["rows"]:
    names = common.input_names(row["variant"], initial_state=True)
    expected = {"o", "state"} | {equivalence._GRAD_KEYS[n] for n in names}
    assert set(row["errors"]) == expected, row["variant"]
    # and every error is small in float32
    assert all(err < 1e-4 for err in row["errors"].values()), row
  # and each row was printed as it finished, before the table (a run cut short still reports)
  printed = capsys.readouterr().out
  assert all(f"done: {v} T=5 chunk: o=" in printed.split("relative RMS")[0] for v in ops.VARIANTS)


def test_benchmark_has_a_row_per_variant_impl_and_mode(tmp_path):
  plot = importlib.util.find_spec("matplotlib") is not None
  # Given a scalar-gated additive and a per-channel delta variant at a tiny shape
  config = benchmark.Config(variants=("simple_gla", "kda"), shapes=((1, 16, 2, 8),), dtype="float32",
                            warmup=0, iters=2, chunk_size=8, plot=plot, stream=3)
  # When every contender is timed
  results = benchmark.run_benchmark(config, str(tmp_path))
  # Then the JSON holds the rows: one timed row per (variant, impl, mode), jla's say whether it ran
  with open(tmp_path / "benchmark.json", encoding="utf-8") as f:
    assert json.load(f)["rows"] == results["rows"]
  rows = {(r["variant"], r["impl"], r["mode"]): r for r in results["rows"]}
  jla_installed = importlib.util.find_spec("jla") is not None
  for variant in config.variants:
    for mode in config.modes:
      for impl in config.impls:
        row = rows[(variant, impl, mode)]
        assert row["status"] == "ok" and row["median_ms"] > 0 and len(row["times_ms"]) == 2, row
        # and the streamed timing (3 calls back to back, per call) has its own rounds and median
        assert len(row["stream_times_ms"]) == 2 and row["stream_ms"] > 0, row
      jla = rows[(variant, "jla:chunked", mode)]
      assert jla["status"] == ("ok" if jla_installed else "not installed"), jla
      anchor = rows[(variant, results["anchor"], mode)]
      assert anchor["ratio"] == 1.0 and anchor["stream_ratio"] == 1.0
  softmax = [r for r in results["rows"] if r["variant"] == "softmax"]
  assert sorted(r["mode"] for r in softmax) == sorted(config.modes)
  assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in softmax)
  assert os.path.exists(tmp_path / "benchmark.png") == plot
  # and every timed row has its roofline floor from ceilings measured in the same run
  assert results["ceilings"]["bandwidth_bytes_per_s"] > 0 and results["ceilings"]["matmul_flops_per_s"] > 0
  for row in results["rows"]:
    if row["status"] == "ok":
      # (of the streamed time, the device's, when the run measured it)
      assert row["floor_ms"] > 0 and row["floor_multiple"] == row["stream_ms"] / row["floor_ms"], row


def test_roofline_model_gives_the_documented_gated_deltanet_floor():
  # BENCHMARKS.md: Gated DeltaNet at (4, 8192, 16, 128) bf16 moves ~0.54 GB and does ~94 GFLOP forward
  from experiments import roofline
  B, T, H, K = 4, 8192, 16, 128
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  inputs = {"q": spec(B, T, H, K), "k": spec(B, T, H, K), "v": spec(B, T, H, K),
            "g": spec(B, T, H, dtype=jnp.float32), "beta": spec(B, T, H)}
  do = spec(B, T, H, K, dtype=jnp.float32)
  nbytes, flops = roofline.op_cost("gated_delta_rule", (B, T, H, K), "fwd", inputs, do)
  assert abs(nbytes / 0.54e9 - 1) < 0.01 and abs(flops / 94e9 - 1) < 0.01, (nbytes, flops)
  both = roofline.op_cost("gated_delta_rule", (B, T, H, K), "fwd_bwd", inputs, do)
  assert both[1] == 3 * flops and both[0] > 2 * nbytes
  additive = roofline.op_cost("simple_gla", (B, T, H, K), "fwd", inputs, do)[1]
  assert additive < flops       # the delta family's extra products
  ceilings = {"bandwidth_bytes_per_s": 4.21e12, "matmul_flops_per_s": 817e12}
  assert abs(roofline.floor_ms(nbytes, flops, ceilings) - 0.128) < 0.002   # memory-bound: 128 us
  with pytest.raises(ValueError, match="mode"):
    roofline.op_cost("gla", (B, T, H, K), "bwd", inputs, do)


def test_benchmark_parses_shapes_and_rejects_bad_configs():
  assert benchmark.parse_shapes("4,8192,16,128;1,64,2,8") == ((4, 8192, 16, 128), (1, 64, 2, 8))
  with pytest.raises(ValueError, match="variants"):
    benchmark.Config(variants=("softmax",))
  with pytest.raises(ValueError, match="anchor"):
    benchmark.Config(anchor="jla:triton")
  with pytest.raises(ValueError, match="stream"):
    benchmark.Config(stream=-1)
  with pytest.raises(ValueError, match="impls"):
    equivalence.Config(impls=("recurrent",))
  with pytest.raises(ValueError, match="gates"):
    equivalence.Config(gates="weak")
  with pytest.raises(ValueError, match="kernels"):
    equivalence.Config(kernels="kk")
  assert equivalence.Config(kernels="k").kernels == "k"


def test_gate_recipes_give_the_documented_values():
  make = lambda gates: np.asarray(common.make_inputs("kda", np.random.default_rng(0), B=1, T=64, H=1, K=8,
                                                     V=8, gates=gates)["g"])
  bench, edge, strong = make("benchmark"), make("edge"), make("strong")
  assert (bench < 0).all() and bench.mean() > -0.1           # log_sigmoid(N(0, 1) + 4): mild decay
  assert (edge[..., ::2] == np.float32(-1.8)).all()           # 115 nats over a chunk on half the channels
  np.testing.assert_array_equal(edge[..., 1::2], bench[..., 1::2])
  assert strong.min() >= -20 and strong.max() <= 0 and strong.mean() < -5
  # the layers' own gates at initialisation: KDA's -A softplus(a + dt_bias), A in [1, 16] per head
  layer = np.asarray(common.make_inputs("kda", np.random.default_rng(0), B=1, T=4096, H=2, K=8, V=8,
                                        gates="layer")["g"])
  assert (layer < 0).all() and layer.min() > -16 * 40 and layer.mean() < -0.05
  bounded = make("bounded")
  assert (bounded <= 0).all() and bounded.min() >= common.GATE_LOWER_BOUND
  gla = np.asarray(common.make_inputs("gla", np.random.default_rng(0), B=1, T=64, H=1, K=8, V=8,
                                      gates="layer")["g"])
  assert (gla < 0).all() and gla.min() > -20 / 16 and gla.mean() > -0.2   # log_sigmoid(N(0, 1)) / 16
  with pytest.raises(ValueError, match="gates"):
    make("weak")


@pytest.mark.parametrize("script, flags, output", [
    ("equivalence.py", ["--variants=simple_gla", "--T=3", "--K=4", "--V=4", "--gates=strong"],
     "equivalence.json"),
    ("benchmark.py", ["--variants=simple_gla", "--impls=chunk", "--modes=fwd", "--shapes=1,8,1,4",
                      "--nosoftmax", "--warmup=0", "--iters=1"], "benchmark.json"),
    ("layer_benchmark.py", ["--B=1", "--T=16", "--width=32", "--heads=2", "--iters=1", "--stream=2",
                            "--impl=chunk", "--mixers=A,G,K,Kb"], "layers.json"),
    ("benchmark.py", ["--variants=kda", "--impls=chunk", "--modes=fwd_bwd_state", "--shapes=1,8,1,4",
                      "--nosoftmax", "--warmup=0", "--iters=1", "--gates=layer"], "benchmark.json"),
    ("kernel_breakdown.py", ["--variants=gated_delta_rule", "--shape=1,64,1,64", "--iters=1",
                             "--interpret", "--stages=op fwd,delta prep kernel,delta grads kernel"],
     "kernel_breakdown.json"),
    ("kernel_breakdown.py", ["--variants=gated_delta_rule", "--shape=1,64,1,128", "--iters=1",
                             "--interpret", "--stages=delta grads pair kernel,pair check"], "kernel_breakdown.json"),
    ("kernel_breakdown.py", ["--variants=simple_gla", "--shape=1,128,1,128", "--iters=1", "--interpret",
                             "--stages=op fwd fused streamed,forward streamed check"],
     "kernel_breakdown.json"),
    ("kernel_breakdown.py", ["--variants=gated_delta_rule", "--shape=1,128,1,64", "--iters=1", "--interpret",
                             "--sequence_pieces=2", "--stages=pieces maps"],
     "kernel_breakdown.json"),
    ("kernel_breakdown.py", ["--variants=kda", "--shape=1,64,1,64", "--iters=1", "--interpret",
                             "--stages=channel prep kernel,op fwd channel kernel,channel check"],
     "kernel_breakdown.json"),
    ("lm_benchmark.py", ["--patterns=G,A", "--seq_lens=32,64", "--tokens=64", "--width=16", "--depth=1",
                         "--num_heads=2", "--impl=chunk", "--chunk_size=16", "--steps=2", "--breakdown=G,A",
                         "--breakdown_seq_lens=32", "--share_kernel_compiles", "--rounds=1", "--step_rounds=2",
                         "--placed_batches"],
     "lm.json"),
    ("profile_step.py", ["--mixers=G", "--patterns=A:o", "--seq_len=32", "--tokens=64", "--width=16",
                         "--depth=1", "--num_heads=2", "--impl=chunk", "--chunk_size=16", "--dtype=float32",
                         "--warmup=1", "--calls=1"], "profile.json"),
    ("conv_benchmark.py", ["--B=1", "--T=16", "--D=128", "--W=4", "--dtype=float32", "--iters=1", "--stream=1",
                           "--interpret", "--blocks=auto,8x128"],
     "conv.json"),
    ("embedding_grad.py", ["--vocabs=64", "--tokens=2,32", "--width=16", "--iters=1", "--stream=2"],
     "embedding_grad.json"),
    ("cumsum_benchmark.py", ["--B=1", "--T=128", "--H=2", "--K=16", "--iters=1", "--stream=1"], "cumsum.json"),
    ("forms_census.py", ["--pattern=KA", "--impl=chunk", "--width=32", "--depth=2", "--num_heads=2",
                         "--batch_size=1", "--seq_len=128", "--chunk_size=16", "--census_steps=0,2"],
     "census.json"),
    ("compile_time.py", ["--pattern=G", "--impl=chunk", "--width=32", "--depth=1", "--num_heads=2",
                         "--batch_size=1", "--seq_len=64", "--chunk_size=16", "--steps=1",
                         "--unrolls=1,4"], "compile_time.json"),
])
def test_main_parses_flags_and_writes_results(tmp_path, script, flags, output):
  cmd = [sys.executable, os.path.join(ROOT, "experiments", script), f"--workdir={tmp_path}", *flags]
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-2000:]
  assert os.path.exists(tmp_path / output) and f"wrote {tmp_path / output}" in done.stdout
  assert script != "benchmark.py" or "error: " not in done.stdout   # every row timed
  if script == "lm_benchmark.py":  # the anchor first at each T, and every part of each step timed
    with open(tmp_path / output, encoding="utf-8") as f:
      rows = json.load(f)["rows"]
    assert [(r["pattern"], r["T"], r["batch"]) for r in rows] == [("A", 32, 2), ("G", 32, 2), ("A", 64, 1),
                                                                  ("G", 64, 1)]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    # the timed steps twice over: the reported step is one of the rounds' (the lower middle of two)
    assert all(len(r["step_ms_rounds"]) == 2 and r["step_ms"] == min(r["step_ms_rounds"]) for r in rows)
    # each round's host time until its last step was dispatched: within the round's time
    assert all(all(0 < d <= s for d, s in zip(r["dispatch_ms_rounds"], r["step_ms_rounds"])) for r in rows)
    # the trace and lowering, a part of the first step's time
    assert all(0 < r["lower_s"] < r["compile_s"] for r in rows)
    assert all(len(r["parts"]) == 4 and r["parts_sum_ms"] > 0 for r in rows if r["T"] == 32)
    assert not any("parts" in r for r in rows if r["T"] == 64)   # --breakdown_seq_lens
  if script == "forms_census.py":  # the K layer (not the A) at both steps; every share a fraction
    with open(tmp_path / output, encoding="utf-8") as f:
      rows = json.load(f)["rows"]
    assert [(r["step"], r["layer"]) for r in rows] == [(0, 0), (2, 0)]
    for r in rows:
      assert abs(r["one"] + r["halves"] + r["groups"] - 1) < 1e-6 and r["one_narrow"] <= r["one"] <= 1, r
      assert r["mean_g"] < 0, r
      assert 0 <= r["beyond_channels"] <= 16 and 0 <= r["beyond_within_16"] <= 1, r
      assert all(0 <= r[f"{by}_top_{n}"] <= 1 for by in ("mean", "batch", "strength") for n in (32, 64)), r
  if script == "kernel_breakdown.py":  # a stage that fails is reported as NaN: none may here
    stages = next(f for f in flags if f.startswith("--stages="))[len("--stages="):].split(",")
    variant = next(f for f in flags if f.startswith("--variants="))[len("--variants="):]
    with open(tmp_path / output, encoding="utf-8") as f:
      ms = json.load(f)["ms"][variant]
    assert all(ms[s] > 0 for s in stages if not s.endswith("check")), ms
    if "channel check" in stages:
      assert 0 <= ms["check channel o rel rms"] < 2e-2, ms
    if "pair check" in stages:
      assert 0 <= ms["check pair rel rms"] < 1e-2, ms
    if "forward streamed check" in stages:   # other roundings (fused_streamed.streamed_walk)
      assert 0 <= ms["check forward streamed rel rms"] < 1e-2, ms
  if script == "profile_step.py":  # each kernel of the trace found in the compiled module
    with open(tmp_path / output, encoding="utf-8") as f:
      rows = {r["target"]: r for r in json.load(f)}
    # a pattern's suffix (here ':o', a kernel option) is read, not taken for a layer
    assert set(rows) == {"layer_G", "lm_A:o_T32"} and all("error" not in r for r in rows.values()), rows
    # the LM trains through every call, each on the next batch of the data (not one batch again)
    losses = rows["lm_A:o_T32"]["losses"]
    assert len(losses) == 3 and len(set(losses)) == 3 and "losses" not in rows["layer_G"], losses
    for r in rows.values():
      # every thunk is an instruction of the module, those the compiler added without metadata too
      assert r["kernel_ms"] > 0 and r["unmatched_ms"] == 0, r
      assert 0 < r["busy_ms"] <= r["span_ms"] and abs(r["span_ms"] - r["busy_ms"] - r["idle_ms"]) < 1e-9, r
    assert any(line["where"].startswith("linear_attention_jax/layers/conv.py")
               and line["direction"] == "bwd" for line in rows["layer_G"]["lines"])
    parts = {p["part"]: p["ms"] for p in rows["layer_G"]["parts"]}   # by part, summing to the total
    assert parts["short convolutions"] > 0 and parts["XLA chunked form and ops"] > 0, parts
    assert sum(parts.values()) == pytest.approx(rows["layer_G"]["kernel_ms"])
  if script == "conv_benchmark.py":  # every form computes one function and its gradients
    with open(tmp_path / output, encoding="utf-8") as f:
      rows = json.load(f)["rows"]
    assert [r["form"] for r in rows] == ["sum", "pallas:auto", "pallas:8x128", "vjp", "xlaconv"]
    assert all(err < 1e-5 for r in rows for err in r["max_rel_diff"].values()), rows
  if script == "cumsum_benchmark.py":  # every form, both directions, the same sums
    with open(tmp_path / output, encoding="utf-8") as f:
      rows = json.load(f)
    assert [(r["form"], r["reverse"]) for r in rows] == [(n, d) for d in (False, True)
                                                         for n in ("cumsum", "blocks", "matmul")]
    assert all(r["rel_err"] < 1e-5 for r in rows), rows
  if script == "compile_time.py":  # the unroll changes the program, not what it computes
    with open(tmp_path / output, encoding="utf-8") as f:
      runs = json.load(f)["results"]
    assert [r["unroll"] for r in runs] == [1, 4] and all(r["compile_s"] > 0 for r in runs)
    assert runs[0]["final_loss"] == pytest.approx(runs[1]["final_loss"], rel=1e-5)


def test_kernel_breakdown_times_jla_alongside_when_asked(tmp_path):
  # A stand-in `jla` package (o = v * 2) on the path: the script passes it our inputs by name.
  (tmp_path / "jla").mkdir()
  (tmp_path / "jla" / "__init__.py").write_text("")
  (tmp_path / "jla" / "ops.py").write_text(
      "def linear_attention(kind, q, k, v, *, impl, g=None, beta=None, use_qk_l2norm=False):\n"
      "  assert kind == 'deltanet' and impl == 'mosaic_gpu' and g is None and beta is not None\n"
      "  return v * 2, None\n")
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "kernel_breakdown.py"), f"--workdir={tmp_path}",
         "--variants=delta_rule", "--shape=1,64,1,64", "--iters=1", "--interpret", "--jla",
         "--stages=op fwd fused,op value+grad delta_backward,jla fwd,jla fwd+bwd"]
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(tmp_path)))
  assert done.returncode == 0, done.stderr[-2000:]
  with open(tmp_path / "kernel_breakdown.json", encoding="utf-8") as f:
    ms = json.load(f)["ms"]["delta_rule"]
  # delta_rule's fused forward takes its tensors from the preparation kernel
  assert ms["jla fwd"] > 0 and ms["jla fwd+bwd"] > 0 and ms["op fwd fused"] > 0
  assert ms["op value+grad delta_backward"] > 0


def test_fla_benchmark_says_why_nothing_is_timed_without_fla(tmp_path):
  # No torch/CUDA/fla here: every requested row carries the reason, the JSON is still written.
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "fla_benchmark.py"), f"--workdir={tmp_path}",
         "--kinds=gla,kda", "--shapes=1,64,1,64", "--modes=fwd"]
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-2000:]
  with open(tmp_path / "fla_benchmark.json", encoding="utf-8") as f:
    rows = json.load(f)["rows"]
  assert [(r["kind"], r["mode"]) for r in rows] == [("gla", "fwd"), ("kda", "fwd")]
  assert all(r["median_ms"] is None and r["status"] != "ok" for r in rows), rows
  bad = subprocess.run(cmd + ["--kinds=retnet"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert bad.returncode != 0 and "--kinds must be from" in bad.stderr


def test_lm_benchmark_counts_the_forms_after_each_round(tmp_path):
  # a K LM: the census runs at each round's end, off the clock, one row of shares a round
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "lm_benchmark.py"), f"--workdir={tmp_path}",
         "--patterns=K", "--seq_lens=32", "--tokens=64", "--width=16", "--depth=1", "--num_heads=1",
         "--impl=chunk", "--chunk_size=16", "--steps=2", "--step_rounds=2", "--forms_census"]
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-2000:]
  (row,) = json.loads((tmp_path / "lm.json").read_text())["rows"]
  assert len(row["forms_rounds"]) == 2, row
  for shares in row["forms_rounds"]:
    assert abs(shares["one"] + shares["halves"] + shares["groups"] - 1) < 1e-6, shares
    assert 0 <= shares["one_narrow"] <= shares["one"], shares
    assert shares["beyond_channels"] >= 0 and 0 <= shares["beyond_within_16"] <= 1, shares
    assert 0 <= shares["groups_in_16"] <= shares["groups"], shares


def test_forms_census_counts_the_channels_beyond_one_reference():
  # chunk 0 fits; in chunk 1, 3 of 32 channels decay 3 nats a token (192 nats over the chunk: beyond
  # 2 x 76; 96 over 32 tokens: the halves' form); in chunk 2, 20 of them (more than 16); in chunk 3,
  # 3 channels at 8 nats a token (256 over 32 tokens: the groups', 128 over 16: within 2 x 84); in
  # chunk 4, at 15 (240 over 16 tokens: beyond)
  from experiments import forms_census
  g = np.full((1, 320, 1, 32), -0.01, np.float32)
  g[0, 64:128, 0, :3] = -3.0
  g[0, 128:192, 0, :20] = -3.0
  g[0, 192:256, 0, :3] = -8.0
  g[0, 256:, 0, :3] = -15.0
  got = {k: float(v) for k, v in forms_census.forms(jnp.asarray(g), 64).items()}
  assert got["one"] == pytest.approx(1 / 5) and got["halves"] == pytest.approx(2 / 5), got
  assert got["beyond_channels"] == pytest.approx((3 + 20 + 3 + 3) / 4), got
  assert got["beyond_within_16"] == pytest.approx(3 / 4), got
  assert got["groups"] == pytest.approx(2 / 5) and got["groups_in_16"] == pytest.approx(1 / 5), got


def test_forms_census_places_the_channels_beyond_in_an_order():
  # 128 channels; chunk 1: channels 0-39 decay 3 nats a token (40 beyond: within 64, not 32); chunk 2:
  # channels 100-109 at 4 (10 beyond). Over the row channels 100-109 decay most, then 0-39, so the 32
  # decaying most hold chunk 2's and not chunk 1's; the 64 hold both. By a strength that ranks channel
  # 0 first, the 32 strongest hold neither chunk's, the 64 strongest chunk 1's
  from experiments import forms_census
  g = np.full((1, 192, 1, 128), -0.01, np.float32)
  g[0, 64:128, 0, :40] = -3.0
  g[0, 128:, 0, 100:110] = -4.0
  strength = -jnp.arange(128.0)[None]
  got = {k: float(v) for k, v in forms_census.forms(jnp.asarray(g), 64, strength).items()}
  assert got["beyond_within_32"] == pytest.approx(1 / 2) and got["beyond_within_64"] == 1.0, got
  assert got["mean_top_32"] == pytest.approx(1 / 2) and got["mean_top_64"] == 1.0, got
  assert got["strength_top_32"] == 0.0 and got["strength_top_64"] == pytest.approx(1 / 2), got
  assert got["batch_top_32"] == got["mean_top_32"] and got["batch_top_64"] == 1.0, got   # one row
  # a second row whose strong channels are 50-99 (chunk 1's 40 at 3 nats, chunk 2's 10 at 4): over the
  # batch the 64 most decaying are 90-109 and, of the 80 tied at 3 nats (0-39, 50-89), the first 44 in
  # order (0-39, 50-53), so row 1's chunk 1 (50-89) falls outside them; each row's own order holds all
  g2 = np.full_like(g, -0.01)
  g2[0, 64:128, 0, 50:90] = -3.0
  g2[0, 128:, 0, 90:100] = -4.0
  both = {k: float(v) for k, v in forms_census.forms(jnp.asarray(np.concatenate([g, g2])), 64).items()}
  assert both["mean_top_64"] == 1.0 and both["batch_top_64"] == pytest.approx(3 / 4), both
  assert "strength_top_32" not in forms_census.forms(jnp.asarray(g), 64), got


def test_lm_benchmark_counts_model_flops_by_hand():
  from experiments import lm_benchmark
  from flax import nnx
  from linear_attention_jax.models import LM, LMConfig
  for pattern in ("A", "G"):
    config = LMConfig(vocab_size=256, width=32, depth=2, num_heads=2, pattern=pattern, chunk_size=16)
    params = nnx.state(LM(config, rngs=nnx.Rngs(0)), nnx.Param)
    n = sum(x.size for x in jax.tree.leaves(params)) - 256 * 32 + 32 * 256  # the tied head's product
    mixer = (6 * 2 * 16 * 128 if pattern == "A" else 3 * 2 * (2 * 16 * (16 + 16) + 4 * 16 * 16))
    assert lm_benchmark.model_flops_per_token(config, params, 128) == 6 * n + 2 * mixer


def test_layer_benchmark_merges_the_rows_of_several_processes(tmp_path):
  def run(T, a_ms, g_ms):  # one process's layers.json: its own anchor at its T
    path = tmp_path / f"T{T}.json"
    rows = [dict(mixer=m, B=1, T=T, single_ms=ms, stream_ms=ms, compile_s=1.0) for m, ms in (("A", a_ms),
                                                                                        ("G", g_ms))]
    path.write_text(json.dumps(dict(width=1024, heads=8, impl="pallas", dtype="bfloat16", device="H200",
                                    rows=rows)))
    return str(path)
  files = [run(1024, 1.0, 2.0), run(4096, 3.0, 2.5), run(16384, 9.0, 3.0)]
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "layer_benchmark.py"), f"--workdir={tmp_path}",
         "--impl=pallas", f"--rows_from={','.join(files)}"]
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-2000:]
  assert "- G: 4096" in done.stdout and "H200" in done.stdout
  assert len(json.loads((tmp_path / "layers.json").read_text())["rows"]) == 6
  assert (tmp_path / "layers.png").exists()
  bad = subprocess.run(cmd[:-2] + ["--impl=chunk", cmd[-1]], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert bad.returncode != 0 and "impl" in bad.stderr


def test_profile_step_timeline_counts_overlaps_once_and_finds_the_longest_gap():
  # Given two calls' kernels (us): a [0, 10], b [5, 12] overlapping it, c [20, 30] after an 8 us gap,
  # d [31, 40] after 1 us. (profile_step imports beside lm_benchmark: their flags do not collide.)
  from experiments import lm_benchmark, profile_step  # noqa: F401
  kernels = [dict(name=n, ts=t, dur=d) for n, t, d in (("c", 20, 10), ("a", 0, 10), ("b", 5, 7),
                                                       ("d", 31, 9))]
  t = profile_step.timeline(kernels, calls=2)
  assert t["span_ms"] == pytest.approx(0.040 / 2) and t["busy_ms"] == pytest.approx(0.031 / 2)
  assert t["idle_ms"] == pytest.approx(0.009 / 2)
  assert t["longest_idle_ms"] == pytest.approx(0.008) and t["longest_idle_before"] == "c"
  assert profile_step.timeline([], calls=1)["span_ms"] == 0
  # And the host's side: XLA's annotations summed per call, whatever the process
  host = [dict(ph="X", pid=9, name=n, ts=0, dur=d) for n, d in (
      ("[0] GpuExecutable::ExecuteThunks", 900), ("command_buffer::update", 600),
      ("command_buffer::execute", 200), ("[0] GpuExecutable::ExecuteThunks", 700), ("other", 5000))]
  h = profile_step.host_side(dict(traceEvents=host), calls=2)
  assert h == pytest.approx(dict(host_execute_ms=0.8, host_command_buffer_update_ms=0.3,
                                host_command_buffer_launch_ms=0.1))


def test_layer_benchmark_reads_the_kernel_option_suffixes():
  from experiments import layer_benchmark
  options = layer_benchmark.kernel_options
  assert options("G:p132") == dict(grads_programs=132) and options("G2:p8") == dict(grads_programs=8)
  assert options("K:u") == dict(unit_ref_bound=True) and options("K:n") == dict(unit_ref_bound=False)
  assert options("G:s4") == dict(sequence_pieces=4) and options("K:c") == dict(call_test=False)
  assert options("K:o") == dict(order_channels="op") and options("K:l") == dict(order_channels="layer")
  assert options("K:w") == dict(order_channels="none") and options("K:g") == dict(gate="xla")
  assert options("K:r") == dict(dg_cumsum="kernel") and options("K:k") == dict(key_warpgroups=2)
  assert options("K:f") == dict(prep_warpgroups=2) and options("K:q") == dict(l2_grads="kernel")
  assert options("K:kf") == dict(key_warpgroups=2, prep_warpgroups=2)
  assert options("K:1") == dict(key_warpgroups=1, prep_warpgroups=1)
  assert options("K:kw") == dict(key_warpgroups=2, order_channels="none")
  assert options("K:x") == dict(cumsums="xla") and options("K:v") == dict(l2_grads="xla")
  assert options("G") == {} and options("G:xlaconv") == {}
  for bad in ("G:p0", "G:p", "G:q4", "G:p4x", "K:uu", "K:nu", "G:s0", "G:s", "K:cc", "K:oo", "K:rr", "K:kk",
              "K:ol", "K:qv", "K:xx", "K:kp4", "K:2", "K:k1"):
    with pytest.raises(ValueError, match="suffix"):
      layer_benchmark.build(bad, width=32, heads=2, impl="chunk", dtype=jnp.float32)


def test_kernel_phases_reads_the_profilers_traces(tmp_path):
  # Given a trace in Mosaic GPU's own dump format: 2 SMs x 2 programs each, 2 warpgroups a program,
  # phases "pair.a" (100 cycles, with a nested record), "pair.b" (300 on warpgroup 0, 500 on 1) and 50
  # cycles outside any phase; programs start 2000 ns apart on their SM
  from jax.experimental.mosaic.gpu import profiler
  from experiments import kernel_phases
  spec = profiler.ProfilerSpec(64)
  a, b, inner = (spec.intern_name(n) for n in ("pair.a", "pair.b", "pair.a.inner"))
  buffer = np.zeros((4, 2, 64), np.uint32)
  for block in range(4):
    sm, start = block % 2, 10_000 + 2000 * (block // 2)
    for wg in range(2):
      long_b = 300 if wg == 0 else 500
      events = [(a, 0), (inner, 10), (inner | spec.EXIT, 20), (a | spec.EXIT, 100),
                (b, 150), (b | spec.EXIT, 150 + long_b)]
      buffer[block, wg, :3] = (start + wg, sm, 2 * len(events))
      for i, (tag, clock) in enumerate(events):
        buffer[block, wg, 3 + 2 * i: 5 + 2 * i] = (tag, 1_000 + clock)
  path = tmp_path / "1-trace.json"
  with open(path, "w") as f:
    spec.dump(buffer.reshape(-1), f, grid=(4, 1, 1), block=(256, 1, 1))
  # When the script reads and summarises it
  kernel, programs = kernel_phases.read_trace(str(path))
  s = kernel_phases.summarise(programs)
  # Then the kernel is named by its phases' prefix, the nested record is inside its phase, and the
  # cycles, shares and program times are what the records say (the profiler's own overhead estimate,
  # the smallest step between records less one, is 9 cycles a record here)
  assert kernel == "pair" and len(programs) == 8
  rows = {r["phase"]: r for r in s["rows"]}
  assert set(rows) == {"pair.a", "pair.b", "outside"}
  overhead = 9
  assert rows["pair.a"]["cycles"] == pytest.approx(100 - 3 * overhead)
  assert rows["pair.b"]["cycles"] == pytest.approx(400 - overhead)
  span = np.mean([450, 650]) - 5 * overhead
  assert rows["outside"]["cycles"] == pytest.approx(span - (100 - 3 * overhead) - (400 - overhead))
  assert sum(r["share"] for r in s["rows"]) == pytest.approx(1.0)
  assert s["programs"] == 4 and s["sms"] == 2 and s["program_ns"] == pytest.approx(2000)
  # and the sampled SM clock (nvidia-smi's lines, blanks skipped) turns the span into microseconds
  assert kernel_phases.parse_clock_mhz("1980\n1755\n\n1980\n") == 1980.0
  assert kernel_phases.parse_clock_mhz("") is None
  s["span_us"] = s["mean_span_cycles"] / 1980.0
  text = kernel_phases.render({"variants": {"gated_delta_rule": {"pair": s}}})
  assert f"records span {s['span_us']:.2f} us" in text and "| pair.b |" in text


def test_ptxas_report_reads_ptxas_and_refuses_without_a_gpu(tmp_path):
  # Given ptxas's report as MOSAIC_GPU_DUMP_PTXAS=1 prints it on the H200 (NOTES.md v56), with the
  # interleaved log lines of a real run and a kernel assembled twice alike
  from experiments import ptxas_report
  with open(os.path.join(ROOT, "experiments/results/h200_v56/call3/ptxas_new.txt"), encoding="utf-8") as f:
    text = f.read()
  noisy = "I1204 some log line\n" + text + "\n" + "\n".join(text.splitlines()[-5:])
  rows = {r["kernel"]: r for r in ptxas_report.parse(noisy)}
  # Then each kernel has its registers, spills, stack and ptxas time, the repeat folded into one row
  assert rows["chunk_grads_channel_delta_k_chunk"] == dict(
      kernel="chunk_grads_channel_delta_k_chunk", registers=255, spill_stores=2396, spill_loads=1552,
      stack_bytes=512, ptxas_ms=rows["chunk_grads_channel_delta_k_chunk"]["ptxas_ms"])
  assert rows["chunk_prep_channel_chunk"]["spill_stores"] == 1324
  assert rows["short_conv_fwd"] == dict(kernel="short_conv_fwd", registers=20, spill_stores=0,
                                        spill_loads=0, stack_bytes=0, ptxas_ms=20.076)
  assert all(r["ptxas_ms"] > 0 and r["registers"] <= 255 for r in rows.values())
  assert not any("#" in name for name in rows)
  # another specialisation of one kernel (other numbers) is a second row
  again = text.replace("Used 20 registers", "Used 24 registers")
  names = [r["kernel"] for r in ptxas_report.parse(text + "\n" + again)]
  assert names.count("short_conv_fwd") == 1 and names.count("short_conv_fwd#2") == 1
  text_md = ptxas_report.render(dict(device="d", jax="j", shape={}, gates="strong", dtype="bfloat16",
                                     variants={"kda": list(rows.values()), "gla": "exit 1"}))
  assert "| `chunk_grads_channel_delta_k_chunk` | 255 | 2,396 | 1,552 | 512 |" in text_md
  assert "error: exit 1" in text_md
  # and the script says why it cannot run on a CPU
  done = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "ptxas_report.py"),
                         f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode != 0 and "needs a CUDA GPU" in done.stderr + done.stdout
