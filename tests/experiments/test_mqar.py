"""MQAR: the generator follows zoology's semantics, and the sweep trains, tabulates and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import mqar
from experiments.mqar_data import IGNORE, MQARConfig, MQARSource, distinct, multiquery_ar

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_examples_hold_keys_then_values_and_score_only_the_queries():
  # Given 200 examples of 64 tokens with 8 pairs over a vocabulary of 100
  tokens, targets = multiquery_ar(np.random.default_rng(0), num_examples=200, seq_len=64,
                                  num_kv_pairs=8, vocab_size=100)
  assert tokens.shape == targets.shape == (200, 64) and tokens.dtype == np.int32
  keys, values = tokens[:, 0:16:2], tokens[:, 1:16:2]
  # Then keys come from the lower half (never 0), values from the upper half, each without repeats
  assert keys.min() >= 1 and keys.max() < 50 and values.min() >= 50 and values.max() < 100
  assert all(len(set(row)) == 8 for row in keys) and all(len(set(row)) == 8 for row in values)
  # And exactly the 8 queries are scored: each holds a key, its target is that key's value
  scored = targets != IGNORE
  assert (scored.sum(axis=1) == 8).all() and not scored[:, :16].any()
  for row in range(200):
    pairs = dict(zip(keys[row], values[row]))
    for t in np.flatnonzero(scored[row]):
      assert pairs[tokens[row, t]] == targets[row, t]
      assert (t - 16) % 2 == 0  # queries sit at even offsets of the query region
  # And most queries come soon after the context (power-law gaps)
  gaps = (np.nonzero(scored)[1] - 16) // 2
  assert np.mean(gaps < 8) > 0.5


def test_batches_are_fixed_by_seed_split_and_index():
  source = MQARSource(MQARConfig(vocab_size=32, train_settings=((16, 2), (32, 4)),
                                 test_settings=((16, 2), (32, 8))), batch_size=5)
  a, b = source.batch("train", 0, 3), source.batch("train", 0, 3)
  np.testing.assert_array_equal(a["tokens"], b["tokens"])
  assert not np.array_equal(a["tokens"], source.batch("train", 0, 4)["tokens"])
  assert not np.array_equal(a["tokens"], source.batch("train", 1, 3)["tokens"])
  # Shorter settings are padded on the right, unscored, to the longest
  assert a["tokens"].shape == (5, 32) and (a["targets"][:3, 16:] == IGNORE).all()
  assert source.eval_splits == ("T16_kv2", "T32_kv8")
  assert (source.batch("T32_kv8", 1, 0)["targets"] != IGNORE).sum() == 5 * 8
  with pytest.raises(ValueError, match="unknown split"):
    source.batch("valid", 0, 0)


def test_query_gaps_follow_the_power_law_and_seeds_fix_the_examples():
  # Given 20,000 examples with one pair, so that each query slot j has probability a j^(a-1) / Z
  a, slots = 0.3, 15
  tokens, targets = multiquery_ar(np.random.default_rng(1), num_examples=20_000, seq_len=2 + 2 * slots,
                                  num_kv_pairs=1, vocab_size=64, power_a=a)
  # Then the query's slot is distributed as zoology's p_j (zoology/data/multiquery_ar.py)
  gaps = (np.nonzero(targets != IGNORE)[1] - 2) // 2
  p = a * np.arange(1, slots + 1) ** (a - 1)
  np.testing.assert_allclose(np.bincount(gaps, minlength=slots) / len(gaps), p / p.sum(), atol=0.01)
  # And the value sits only right after each query: the target at a query is the next input token
  rows, cols = np.nonzero(targets != IGNORE)
  assert (tokens[rows, cols] == tokens[rows, 0]).all() and (targets[rows, cols] == tokens[rows, 1]).all()
  # And the same seed gives the same examples, another seed others
  again = multiquery_ar(np.random.default_rng(1), num_examples=20_000, seq_len=2 + 2 * slots,
                        num_kv_pairs=1, vocab_size=64, power_a=a)
  np.testing.assert_array_equal(tokens, again[0])
  np.testing.assert_array_equal(targets, again[1])
  other = multiquery_ar(np.random.default_rng(2), num_examples=20_000, seq_len=2 + 2 * slots,
                        num_kv_pairs=1, vocab_size=64, power_a=a)
  assert not np.array_equal(tokens, other[0])


def test_distinct_draws_every_ordered_choice_alike():
  # 2 of {0, 1, 2}: the six ordered pairs equally often; 15 of 15: a permutation every row
  x = distinct(np.random.default_rng(0), 60_000, 2, 0, 3)
  counts = np.bincount(3 * x[:, 0] + x[:, 1], minlength=9)
  assert counts[[0, 4, 8]].sum() == 0
  np.testing.assert_allclose(counts[[1, 2, 3, 5, 6, 7]] / 60_000, 1 / 6, atol=0.01)
  assert all(sorted(row) == list(range(1, 16)) for row in distinct(np.random.default_rng(1), 100, 15, 1, 16))


def test_too_many_pairs_for_the_length_or_vocabulary():
  with pytest.raises(ValueError, match="seq_len >= 4"):
    multiquery_ar(np.random.default_rng(0), num_examples=1, seq_len=16, num_kv_pairs=5, vocab_size=64)
  with pytest.raises(ValueError, match="vocab_size=8"):
    multiquery_ar(np.random.default_rng(0), num_examples=1, seq_len=64, num_kv_pairs=4, vocab_size=8)


TINY = ['models=[["attention", "AA"], ["linear_attention", "LL"]]', "learning_rates=[3e-3]",
        "workers=1", "train.steps=3", "train.optimizer.warmup_steps=1", "train.eval_batches=1",
        "train.model.width=32", "train.data.batch_size=4", "train.data.mqar.vocab_size=32",
        "train.data.mqar.train_settings=[[16, 2]]", "train.data.mqar.test_settings=[[16, 2], [16, 4]]"]


def test_sweep_reports_accuracy_per_setting_against_state_size(tmp_path):
  # Given two tiny models and a single learning rate
  config = mqar.load_config("mqar_sweep", TINY)
  # When the sweep runs
  results = mqar.run_sweep(config, str(tmp_path), progress=False)
  # Then there is one row per model with an accuracy per test setting and its state size
  assert [r["model"] for r in results["best"]] == ["attention", "linear_attention"]
  for row in results["best"]:
    assert set(row["accuracy"]) == {"T16_kv2", "T16_kv4"}
    assert all(0 <= a <= 1 for a in row["accuracy"].values()) and row["state_size"] > 0
  with open(tmp_path / "mqar.md", encoding="utf-8") as f:
    table = f.read()
  assert "| attention | `AA` | 32 | 0.003 (1) |" in table and "T16 kv4" in table
  assert all(row["state_bytes"] == 4 * row["state_size"] for row in results["best"])
  with open(tmp_path / "mqar.json", encoding="utf-8") as f:
    assert len(json.load(f)["runs"]) == 2
  assert results["plot"] is None or os.path.getsize(results["plot"]) > 0
  # And a second call reads the finished runs back instead of training again
  again = mqar.run_sweep(config, str(tmp_path), progress=False)
  assert [r["mean_accuracy"] for r in again["best"]] == [r["mean_accuracy"] for r in results["best"]]


def test_main_runs_the_sweep_with_two_workers(tmp_path):
  sets = [f"--set={s}" for s in TINY if not s.startswith("workers")] + ["--set=workers=2"]
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "mqar.py"), f"--workdir={tmp_path}",
         "--noprogress", *sets, '--set=models=[["hybrid", "GA"], ["attention", "AA"]]']
  done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "| hybrid | `GA` |" in done.stdout and os.path.exists(tmp_path / "mqar.json")
