"""The recall suite: the retrieval generators say what they mean, and every new config and driver runs
(tiny sizes: a few steps each)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from experiments import mqar, recall, recall_sweep, sweep
from experiments import retrieval_data as rd

V = 64  # four word ranges of 8: A [32, 40), B [40, 48), C [48, 56), F [56, 64)


def _gen(task, T=48, n=50, seed=0, **kw):
  return rd.generate(np.random.default_rng(seed), task, num_examples=n, seq_len=T, vocab_size=V, **kw)


@pytest.mark.parametrize("task", rd.TASKS)
def test_every_task_is_t_tokens_scores_only_its_answers_and_is_fixed_by_its_seed(task):
  tokens, targets = _gen(task)
  assert tokens.shape == targets.shape == (50, 48) and tokens.dtype == np.int32
  rows, cols = np.nonzero(targets != rd.IGNORE)
  # every scored target is the next input token (teacher forcing), never a pad or a marker
  np.testing.assert_array_equal(targets[rows, cols], tokens[rows, cols + 1])
  assert targets[rows, cols].min() >= rd.DIGIT0 and targets[:, -1].tolist() == [rd.IGNORE] * 50
  again = _gen(task)
  np.testing.assert_array_equal(tokens, again[0])
  assert not np.array_equal(tokens, _gen(task, seed=1)[0])
  with pytest.raises(ValueError, match="shortest context"):
    _gen(task, T=rd.min_length(task) - 1)


def _needles(row, width):
  """`[(key or None, digits)]` of every NEEDLE in a row."""
  at = np.flatnonzero(row == rd.NEEDLE)
  return [tuple(row[i + 1:i + 1 + width]) for i in at]


def test_passkey_is_recalled_from_a_repeated_filler_phrase():
  tokens, targets = _gen("passkey", T=64, digits=5)
  for row, target in zip(tokens, targets):
    (needle,) = _needles(row, 5)
    assert targets_of(target) == list(needle)  # the 5 digits after NEEDLE are the answer
    q = int(np.flatnonzero(row == rd.QUERY)[0])
    assert q == 64 - 6 and all(rd.DIGIT0 <= d < rd.DIGIT0 + 10 for d in needle)
    filler = [t for t in row[:q] if t >= rd.WORD0]
    assert set(filler) <= set(range(56, 64))  # the one phrase of F-words


def targets_of(target):
  return target[target != rd.IGNORE].tolist()


@pytest.mark.parametrize("task, keys", [("number_needle", 1), ("multikey_needle", 3)])
def test_the_number_of_the_queried_key_is_the_answer_among_distractors(task, keys):
  tokens, targets = _gen(task, T=64, digits=4, num_keys=3)
  for row, target in zip(tokens, targets):
    needles = _needles(row, 5)  # key and 4 digits
    assert len(needles) == keys and len({n[0] for n in needles}) == keys
    assert all(32 <= n[0] < 40 for n in needles)  # keys from range A
    q = int(np.flatnonzero(row == rd.QUERY)[0])
    asked = row[q + 1]
    (digits,) = [n[1:] for n in needles if n[0] == asked]
    assert targets_of(target) == list(digits)


def test_copy_scores_the_second_copy_word_by_word():
  tokens, targets = _gen("copy", T=41)
  L = 20
  for row, target in zip(tokens, targets):
    assert row[L] == rd.COPY and (row[:L] == row[L + 1:]).all()
    assert targets_of(target) == row[:L].tolist()
  assert (_gen("copy", T=42)[0][:, 0] == rd.PAD).all()  # an even length is left-padded


def test_two_hop_answers_are_the_value_of_the_value():
  tokens, targets = _gen("two_hop", T=64, num_pairs=4, num_queries=3)
  for row, target in zip(tokens, targets):
    body = row[:64 - 9].tolist()  # the tail holds 3 x (QUERY a c)
    in_range = lambda t, low: low <= t < low + 8
    hop = {x: y for x, y in zip(body, body[1:])  # a -> b blocks (A then B) and b -> c (B then C)
           if (in_range(x, 32) and in_range(y, 40)) or (in_range(x, 40) and in_range(y, 48))}
    assert len(hop) == 8
    scored = np.flatnonzero(target != rd.IGNORE)
    assert len(scored) == 3
    for t in scored:
      a = row[t]
      assert row[t - 1] == rd.QUERY and 32 <= a < 40
      assert target[t] == hop[hop[a]] and 48 <= target[t] < 56  # a -> b (range B) -> c (range C)


def test_the_source_mixes_tasks_in_training_and_splits_tests_by_task_and_length():
  config = rd.RetrievalConfig(vocab_size=V, tasks=("passkey", "copy"), train_lengths=(24, 32),
                              test_lengths=(32, 48), digits=3)
  source = rd.RetrievalSource(config, batch_size=8)
  assert source.eval_splits == ("passkey_T32", "passkey_T48", "copy_T32", "copy_T48")
  train_batch = source.batch("train", 0, 0)
  assert train_batch["tokens"].shape == (8, 32)
  np.testing.assert_array_equal(train_batch["tokens"], source.batch("train", 0, 0)["tokens"])
  assert source.batch("copy_T48", 1, 0)["tokens"].shape == (8, 48)
  with pytest.raises(ValueError, match="unknown split"):
    source.batch("valid", 0, 0)
  with pytest.raises(ValueError, match="needs context lengths"):
    rd.RetrievalConfig(vocab_size=V, tasks=("two_hop",), train_lengths=(8,), test_lengths=(8,))


def test_a_sweep_with_its_time_spent_starts_nothing_and_reads_finished_runs_back(tmp_path):
  config = mqar.load_config("mqar_sweep", ["train.steps=2", "train.optimizer.warmup_steps=1"])
  run_config = config.run_config("AA", 3e-3)
  assert sweep.run_all([(str(tmp_path / "a"), run_config)], deadline=time.monotonic() - 1) == {}
  assert sweep.finished(str(tmp_path / "a"), run_config) is None


TINY_TRAIN = ["train.steps=2", "train.optimizer.warmup_steps=1", "train.eval_batches=1",
              "train.data.batch_size=4", "train.model.impl=recurrent", "train.checkpoint_every=0"]


def test_the_zoology_config_builds_zoology_s_grid_and_runs_tiny(tmp_path):
  # Given zoology's setting as it is: four rates, three widths, eight models, seven test sets
  config = mqar.load_config("mqar_zoology")
  assert config.widths == (64, 128, 256) and len(config.learning_rates) == 4
  assert config.train.data.mqar.vocab_size == 8192 and len(config.plan("w")) == 8 * 3 * 4
  assert max(T for T, _ in config.train.data.mqar.test_settings) == 1024
  # When a tiny copy runs (one model, the cheapest to compile, at one width)
  tiny = mqar.load_config("mqar_zoology", TINY_TRAIN + [
      'models=[["attention", "AA"]]', "widths=[16]", "learning_rates=[1e-2]",
      "train.data.mqar.vocab_size=32", "train.data.mqar.train_settings=[[16, 2]]",
      "train.data.mqar.test_settings=[[16, 2], [32, 4]]"])
  results = mqar.run_sweep(tiny, str(tmp_path), progress=False)
  # Then its row has the width, zoology's count of state bytes, and a plot
  assert [(r["model"], r["width"]) for r in results["best"]] == [("attention", 16)]
  assert os.path.basename(results["runs"][0]["workdir"]) == "attention_d16_lr0.01"
  assert all(r["state_bytes"] == 4 * r["state_size"] and r["zoology"] is None
             for r in results["best"])
  assert results["plot"] is None or os.path.getsize(results["plot"]) > 0


def test_the_published_values_sit_beside_ours_and_large_differences_are_flagged():
  from experiments import zoology_reference as z
  config = mqar.load_config("mqar_zoology")
  assert z.lookup("deltanet", 64, 8192, config.train.data.mqar.test_settings)[0] == 0.79
  assert z.lookup("deltanet", 64, 64, config.train.data.mqar.test_settings) is None
  assert z.lookup("retention", 64, 8192, config.train.data.mqar.test_settings) is None
  row = {"model": "deltanet", "pattern": "DD", "width": 64, "learning_rate": 1e-2, "rates_done": 4,
         "accuracy": {"T64_kv4": 0.9}, "mean_accuracy": 0.9, "state_size": 10, "state_bytes": 40,
         "params": 1, "zoology": {"accuracy": 0.79, "state_bytes": 8960, "source": "x"}}
  table = mqar.markdown_table({"test_settings": [[64, 4]], "state_size_at": 64, "best": [row]})
  assert "| 0.79 | **+0.110** |" in table and "bold: differs by more than 0.03" in table


def test_the_retrieval_config_runs_tiny_and_tabulates_every_task_and_length(tmp_path):
  config = recall.load_config("recall_tasks")
  assert {p for _, p in config.models} >= {"GGGA", "KKKA", "AAAA", "LLLL"} and len(config.models) == 9
  tiny = recall.load_config("recall_tasks", TINY_TRAIN + [
      'models=[["attention", "AA"]]', "workers=1", "train.model.width=16",
      "train.data.retrieval.train_lengths=[24]", "train.data.retrieval.test_lengths=[48]"])
  results = recall.run_sweep(tiny, str(tmp_path), progress=False)
  (row,) = results["best"]
  assert set(row["accuracy"]) == set(rd.TASKS) and set(row["accuracy"]["copy"]) == {"48"}
  table = open(tmp_path / "recall.md", encoding="utf-8").read()
  assert "T=48 (beyond training)" in table and "**two_hop**" in table
  assert results["plot"] is None or os.path.getsize(results["plot"]) > 0
  # And a second call reads the run back
  again = recall.run_sweep(tiny, str(tmp_path), progress=False)
  assert again["best"][0]["mean_accuracy"] == row["mean_accuracy"]


def test_the_gpu_sweep_puts_mqar_at_64_and_128_first_and_writes_tables_of_what_finished(tmp_path):
  work, tables = recall_sweep.phases([], [], workers=4)
  first = work[0][3]
  assert first.widths == (64, 128) and len(first.models) == 8 and first.workers == 4
  assert work[1][2] is recall and work[-2][3].widths == (256,)
  assert [name for name, *_ in tables] == ["mqar", "recall"]
  # With no time at all nothing trains, and the (empty) tables are still written and exported
  recall_sweep.run(str(tmp_path / "w"), 0, export_dir=str(tmp_path / "out"))
  with open(tmp_path / "out" / "mqar" / "mqar.json", encoding="utf-8") as f:
    assert json.load(f)["runs"] == []
  assert os.path.exists(tmp_path / "out" / "recall" / "recall.md")


def test_the_export_comes_back_in_few_shallow_files_and_a_fresh_workdir_resumes_from_it(tmp_path):
  # A device machine returns at most 8 files, none more than two folders down: the runs travel as
  # one archive, and restoring it makes a finished run read back instead of trained again.
  tiny = mqar.load_config("mqar_sweep", [
      'models=[["attention", "AA"]]', "learning_rates=[0.01]", "train.steps=2",
      "train.optimizer.warmup_steps=0", "train.model.width=16", "train.eval_batches=1",
      "train.data.batch_size=4"])
  mqar.run_sweep(tiny, str(tmp_path / "w" / "mqar"), progress=False)
  written = recall_sweep.export(str(tmp_path / "w"), str(tmp_path / "out"))
  assert len(written) <= 8
  assert all(len(os.path.relpath(p, tmp_path / "out").split(os.sep)) <= 2 for p in written)
  fresh = tmp_path / "fresh"
  assert recall_sweep.restore(str(tmp_path / "out" / recall_sweep.RUNS_ARCHIVE), str(fresh)) == 1
  (run_dir, run_config), = [(d, c) for *_, c, d in tiny.plan(str(fresh / "mqar"))]
  assert sweep.finished(run_dir, run_config) is not None
  assert not os.path.exists(os.path.join(run_dir, "checkpoints"))


def test_the_gate_probe_s_zoology_base_is_zoology_s_model_at_a_small_vocabulary():
  from experiments import gdn_gate_probe as probe
  name, overrides = probe.BASES["zoology512"]
  sweep_config = mqar.load_config(name, overrides)
  run = sweep_config.run_config("GG", 1e-2, sweep_config.widths[0])
  assert sweep_config.train.data.mqar.vocab_size == 512 and run.model["width"] == 64
  assert run.model["num_heads"] == 2 and run.data.batch_size == 64
  # the control trains the same model with the decay off, next to DeltaNet and the layer as it is
  assert {probe.VARIANTS[n][0] for n in probe.ZOOLOGY_VARIANTS} == {"DD", "GG"}
  assert probe.VARIANTS["zoo512_no_decay_lr1e-2"][4] == (1e-9, 1e-3)
  # the GPU base is the sweep's own config at width 128, and its runs are the sweep's steps
  gpu = mqar.load_config(*probe.BASES["zoology_d128"])
  assert gpu.widths == (128,) and gpu.train.data.mqar.vocab_size == 8192
  assert {probe.VARIANTS[n][2] for n in probe.GPU_VARIANTS if "steps" not in n} == {gpu.train.steps}
  assert probe.DEFAULTS["zoology_d128"] is probe.GPU_VARIANTS
  # and DeltaNet with Gated DeltaNet's output gate: the patched constructor gives the layer its gate
  from flax import nnx
  from linear_attention_jax.layers import delta_net
  assert probe.VARIANTS["zoo512_deltanet_output_gate_lr1e-2"][::4] == ("DD", probe.OUTPUT_GATE)
  original, patched = probe._deltanet_with_output_gate()
  assert original is delta_net.DeltaNet.__init__
  assert delta_net.DeltaNet(16, 2, rngs=nnx.Rngs(0)).g_proj is None
  delta_net.DeltaNet.__init__ = patched
  try:
    assert delta_net.DeltaNet(16, 2, rngs=nnx.Rngs(0)).g_proj is not None
  finally:
    delta_net.DeltaNet.__init__ = original


def test_a_run_that_fails_is_reported_and_stops_no_other_run(tmp_path, monkeypatch, capsys):
  # A run that dies (out of GPU memory, say) is left out, named with its error, and the next runs
  # still train and are returned; the failed one is not marked finished, so a rerun tries it again.
  config = mqar.load_config("mqar_sweep", ["train.steps=2", "train.optimizer.warmup_steps=1"])
  runs = [(str(tmp_path / name), config.run_config("AA", 3e-3)) for name in ("a", "b", "c")]
  trained = []

  def fake_train_run(run_dir, run_dict, progress):
    if run_dir.endswith("b"):
      raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore lines")
    trained.append(run_dir)
    return {"eval/accuracy": 0.5, "seconds": 1.0}

  monkeypatch.setattr(sweep, "train_run", fake_train_run)
  out = sweep.run_all(runs, workers=1, progress=False)
  assert list(out) == [runs[0][0], runs[2][0]] and trained == [runs[0][0], runs[2][0]]
  printed = capsys.readouterr().out
  assert "FAILED: b: RuntimeError: RESOURCE_EXHAUSTED: out of memory" in printed
  assert "1 of 3 runs failed" in printed and "more lines" not in printed
  assert sweep.finished(runs[1][0], runs[1][1]) is None


def test_the_gpu_sweep_exports_what_finished_even_when_its_work_raises(tmp_path, monkeypatch):
  def broken(*args, **kwargs):
    if kwargs.get("deadline") != float("-inf"):
      raise RuntimeError("a phase broke")
    return real(*args, **kwargs)

  real = mqar.run_sweep
  monkeypatch.setattr(mqar, "run_sweep", broken)
  with pytest.raises(RuntimeError, match="a phase broke"):
    recall_sweep.run(str(tmp_path / "w"), 100, export_dir=str(tmp_path / "out"))
  assert os.path.exists(tmp_path / "out" / recall_sweep.RUNS_ARCHIVE)
  assert os.path.exists(tmp_path / "out" / "mqar" / "mqar.json")


def test_the_gpu_sweep_runs_only_the_phases_asked_for_and_rejects_unknown_ones(tmp_path, monkeypatch):
  started = []

  def record(module):
    real = module.run_sweep

    def run_sweep(config, workdir, **kwargs):
      if kwargs.get("deadline") != float("-inf"):  # a phase's work, not the closing tables
        started.append((module.__name__.split(".")[-1], tuple(config.learning_rates)))
        return {}
      return real(config, workdir, **kwargs)
    monkeypatch.setattr(module, "run_sweep", run_sweep)

  record(mqar)
  record(recall)
  recall_sweep.run(str(tmp_path / "w"), 1000, only=["5", "3"])
  # in the sweep's order, whatever order they were named in
  assert started == [("mqar", tuple(recall_sweep.OUTER_RATES)), ("recall", (1e-3,))]
  with pytest.raises(ValueError, match="phases must be numbers from 1 to 5"):
    recall_sweep.run(str(tmp_path / "w2"), 1000, only=["6"])
  with pytest.raises(ValueError, match="phases must be numbers from 1 to 5"):
    recall_sweep.run(str(tmp_path / "w3"), 1000, only=["retrieval"])


def test_gathered_runs_give_each_model_its_best_rate_and_refuse_a_best_without_accuracies(tmp_path):
  from experiments import mqar_tables
  settings = [[64, 4], [128, 8]]
  acc = lambda a, b: {"T64_kv4": a, "T128_kv8": b}
  run = lambda lr, accuracy, mean: {"model": "deltanet", "pattern": "DD", "width": 64,
                                    "learning_rate": lr, "accuracy": accuracy, "mean_accuracy": mean,
                                    "state_size": 10, "state_bytes": 40, "params": 5}
  def write(runs):
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"vocab_size": 8192, "test_settings": settings, "state_size_at": 128,
                                "runs": runs}))
    return str(path)
  # a run known by its mean alone still competes; the best one is shown with its accuracies
  out = mqar_tables.tables(write([run(1e-3, acc(0.9, 0.5), 0.7), run(1e-2, None, 0.2)]),
                           str(tmp_path / "t"))
  (best,) = out["best"]
  assert best["learning_rate"] == 1e-3 and best["rates_done"] == 2
  assert "| 0.001 (2) | 0.900 | 0.500 | 0.700 |" in (tmp_path / "t" / "mqar.md").read_text()
  with pytest.raises(ValueError, match="has no accuracy"):
    mqar_tables.tables(write([run(1e-3, acc(0.9, 0.5), 0.7), run(1e-2, None, 0.8)]), str(tmp_path / "u"))
  with pytest.raises(ValueError, match=r"runs\[0\].*lacks \['params'\]"):
    mqar_tables.tables(write([{k: v for k, v in run(1e-3, None, 0.1).items() if k != "params"}]),
                       str(tmp_path / "v"))


def test_a_run_out_of_memory_beside_others_is_tried_again_alone_at_the_end(tmp_path, monkeypatch, capsys):
  # Threads stand in for the worker processes; b fails for memory in the shared pool, c for a bug.
  import concurrent.futures
  import threading
  config = mqar.load_config("mqar_sweep", ["train.steps=2", "train.optimizer.warmup_steps=1"])
  runs = [(str(tmp_path / name), config.run_config("AA", 3e-3)) for name in ("a", "b", "c", "d")]
  pools, calls, lock = [], [], threading.Lock()

  def fake_pool(workers):
    pools.append(workers)
    return concurrent.futures.ThreadPoolExecutor(workers)

  def fake_train_run(run_dir, run_dict, progress):
    with lock:
      calls.append((os.path.basename(run_dir), len(pools)))
    time.sleep(0.05)
    if run_dir.endswith("b") and len(pools) == 1:  # beside "a" in the first pool
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.50GiB")
    if run_dir.endswith("c"):
      raise ValueError("a bug, not memory")  # never tried again
    return {"eval/accuracy": 0.5, "seconds": 0.05}

  monkeypatch.setattr(sweep, "_pool", fake_pool)
  monkeypatch.setattr(sweep, "train_run", fake_train_run)
  out = sweep.run_all(runs, workers=2, progress=False)
  assert sorted(os.path.basename(d) for d in out) == ["a", "b", "d"]
  # b ran twice: in the first pool, then alone in a pool of its own after every other run
  assert pools == [2, 1] and calls[-1] == ("b", 2) and [c for c, _ in calls].count("c") == 1
  printed = capsys.readouterr().out
  assert "b: again, alone" in printed and "1 of 4 runs failed" in printed and "FAILED: c" in printed
