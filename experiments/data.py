"""Data sources behind one small interface, and the iterator whose position is all its state.

A source has `vocab_size`, `eval_splits` (names) and `batch(split, seed, index)`, which returns
`{"tokens": [B, T] int32, "targets": [B, T] int32}` (-1 where a position is not scored) and is a pure
function of its arguments. `batches(source, split, seed, start)` walks the indices from `start`, so a
checkpoint that records `{"split", "seed", "position"}` resumes on exactly the batch that comes next.

Sources:
  mqar   multi-query associative recall (`experiments.mqar_data`); generated, no download.
  retrieval  needle-in-a-haystack (passkey, number, multi-key), copying, two-hop lookup
         (`experiments.retrieval_data`); generated, no download.
  text   bytes of a local file (`text.path`), vocabulary 256; without a path, an embedded corpus:
         source files of Python's standard library, present wherever Python is installed.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from typing import Protocol

import numpy as np

from experiments.mqar_data import IGNORE, MQARConfig, MQARSource
from experiments.retrieval_data import RetrievalConfig, RetrievalSource

SOURCES = ("mqar", "text", "retrieval")
# The embedded corpus: these standard-library modules' sources, concatenated in this order (~0.6 MB).
CORPUS_MODULES = ("textwrap", "string", "difflib", "argparse", "pprint", "inspect", "functools",
                  "dataclasses", "typing", "this")


@dataclasses.dataclass(frozen=True)
class TextConfig:
  """Byte-level language modelling (fields as in the config files)."""
  path: str = ""  # a local text file; "" = the embedded corpus (Python's stdlib sources)
  seq_len: int = 128  # tokens per example
  valid_fraction: float = 0.1  # the last part of the bytes, held out as the "valid" split

  def __post_init__(self):
    if self.seq_len < 1 or not 0 < self.valid_fraction < 1:
      raise ValueError(f"need text.seq_len >= 1 and 0 < text.valid_fraction < 1; got "
                       f"seq_len={self.seq_len} valid_fraction={self.valid_fraction}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which source, and its settings."""
  source: str = "mqar"  # "mqar" | "text" | "retrieval"
  batch_size: int = 32  # examples per step (and per evaluation batch)
  seed: int = 0  # data seed; the evaluation sets use seed + 1
  mqar: MQARConfig = MQARConfig()
  text: TextConfig = TextConfig()
  retrieval: RetrievalConfig = RetrievalConfig()

  def __post_init__(self):
    if self.source not in SOURCES:
      raise ValueError(f"data.source must be one of {SOURCES}; got {self.source!r}")
    if self.batch_size < 1:
      raise ValueError(f"data.batch_size must be >= 1; got {self.batch_size}")


class DataSource(Protocol):
  vocab_size: int
  eval_splits: tuple[str, ...]

  def batch(self, split: str, seed: int, index: int) -> dict[str, np.ndarray]:
    ...


class Batches:
  """Batches `start, start + 1, ...` of one split; `state()` is `{"split", "seed", "position"}`."""

  def __init__(self, source: DataSource, split: str, seed: int, start: int = 0):
    self.source, self.split, self.seed, self.position = source, split, seed, start

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = self.source.batch(self.split, self.seed, self.position)
    self.position += 1
    return batch

  def state(self) -> dict:
    return {"split": self.split, "seed": self.seed, "position": self.position}

  @classmethod
  def from_state(cls, source: DataSource, state: dict) -> Batches:
    return cls(source, state["split"], int(state["seed"]), int(state["position"]))


def batches(source: DataSource, split: str, seed: int, start: int = 0) -> Batches:
  return Batches(source, split, seed, start)


def embedded_corpus() -> bytes:
  """The standard-library sources named in CORPUS_MODULES (those present), as one byte string."""
  stdlib = sysconfig.get_path("stdlib")
  parts = []
  for name in CORPUS_MODULES:
    path = os.path.join(stdlib, f"{name}.py")
    if os.path.isfile(path):
      with open(path, "rb") as f:
        parts.append(f.read())
  if not parts:
    raise ValueError(f"no embedded corpus: none of {CORPUS_MODULES} found under {stdlib}; "
                     f"pass a text file")
  return b"\n".join(parts)


class ByteTextSource:
  """Random windows of `seq_len + 1` bytes from the train part (the first `1 - valid_fraction`) or
  the "valid" part (the rest); the targets are the tokens shifted by one."""

  vocab_size = 256
  eval_splits = ("valid",)

  def __init__(self, config: TextConfig, batch_size: int):
    if config.path:
      with open(config.path, "rb") as f:
        data = f.read()
    else:
      data = embedded_corpus()
    self.config, self.batch_size = config, batch_size
    self.description = config.path or f"embedded corpus ({len(data):,} bytes of Python's stdlib)"
    tokens = np.frombuffer(data, np.uint8)
    cut = int(len(tokens) * (1 - config.valid_fraction))
    self._splits = {"train": tokens[:cut], "valid": tokens[cut:]}
    for split, part in self._splits.items():
      if len(part) < config.seq_len + 1:
        raise ValueError(f"the {split} part of {self.description} has {len(part)} bytes; "
                         f"need at least seq_len + 1 = {config.seq_len + 1}")

  def batch(self, split: str, seed: int, index: int) -> dict[str, np.ndarray]:
    if split not in self._splits:
      raise ValueError(f"unknown split {split!r}; text has {sorted(self._splits)}")
    part = self._splits[split]
    T = self.config.seq_len
    rng = np.random.default_rng([seed, list(self._splits).index(split), index])
    starts = rng.integers(0, len(part) - T, size=self.batch_size)
    windows = part[starts[:, None] + np.arange(T + 1)].astype(np.int32)
    return {"tokens": windows[:, :-1], "targets": windows[:, 1:]}


def make_source(config: DataConfig) -> DataSource:
  """The source `config.source` names."""
  if config.source == "mqar":
    return MQARSource(config.mqar, config.batch_size)
  if config.source == "retrieval":
    return RetrievalSource(config.retrieval, config.batch_size)
  return ByteTextSource(config.text, config.batch_size)


__all__ = ["IGNORE", "Batches", "ByteTextSource", "DataConfig", "DataSource", "MQARConfig",
           "MQARSource", "RetrievalConfig", "RetrievalSource", "TextConfig", "batches", "embedded_corpus", "make_source"]
