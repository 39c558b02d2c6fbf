"""Multi-query associative recall (MQAR): the synthetic recall task of Arora et al. 2023 ("Zoology").

One example of `T` tokens with `N` key-value pairs and a vocabulary of size `V`:

    k1 v1 k2 v2 ... kN vN | x x k3 x k1 x x x k2 ...
    └─ 2N context tokens ─┘ └─ T - 2N tokens: each key queried once, noise elsewhere ─┘

- Keys are drawn without replacement from the lower half of the vocabulary `[1, V/2)`, values without
  replacement from the upper half `[V/2, V)`; token 0 never appears as a key.
- Query slots are the even offsets `2j` of the query region, `j < (T - 2N) / 2`. The N slots are drawn
  without replacement with probability ∝ `a · j^(a - 1)` (a power law, `a = power_a`, 0.01 by default):
  most queries come soon after the context, a few far from it. Queries come in random order.
- The target at a query position is the value of the key it holds; every other position has no target
  (-1). The model must read the value off the key it saw once in the context.
- With `random_non_queries`, the filler positions hold uniform random tokens of the whole vocabulary
  instead of 0.

Every draw comes from `numpy.random.default_rng` seeded by the caller, so a batch is a pure function of
its seed: training and test sets are fixed by `(seed, split, index)`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

IGNORE = -1  # target of a position that is not scored


def distinct(rng: np.random.Generator, n: int, N: int, low: int, high: int) -> np.ndarray:
  """`[n, N]` ints from `[low, high)`, distinct within each row, every ordered choice equally likely.

  Draws N per row and redraws every later repeat of a value until none is left: the procedure treats
  all values alike (only equalities decide what is redrawn), so its result is uniform over the
  ordered N-tuples of distinct values; it costs O(n N log N) where a permutation per row costs
  O(n (high - low) log(high - low)) (0.4 s for a batch of zoology's vocabulary of 8192).
  """
  x = rng.integers(low, high, size=(n, N))
  while True:
    order = np.argsort(x, axis=1, kind="stable")  # equal values keep their order: the first stays
    ranked = np.take_along_axis(x, order, axis=1)
    repeat = np.zeros(x.shape, bool)
    repeat[:, 1:] = ranked[:, 1:] == ranked[:, :-1]
    if not repeat.any():
      return x
    again = np.zeros(x.shape, bool)
    np.put_along_axis(again, order, repeat, axis=1)
    x[again] = rng.integers(low, high, size=int(again.sum()))


def multiquery_ar(rng: np.random.Generator, *, num_examples: int, seq_len: int, num_kv_pairs: int,
                  vocab_size: int, power_a: float = 0.01,
                  random_non_queries: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """`num_examples` MQAR examples (module docstring).

  Returns:
    `(tokens, targets)`, both `[num_examples, seq_len]` int32; `targets` is -1 except at the queries,
    where it is the value to recall.
  """
  n, T, N, V = num_examples, seq_len, num_kv_pairs, vocab_size
  context = 2 * N
  slots = (T - context) // 2
  if N < 1 or slots < N:
    raise ValueError(f"seq_len={T} leaves room for {max(slots, 0)} queries after the {context} context "
                     f"tokens; need num_kv_pairs={N} (seq_len >= 4 * num_kv_pairs)")
  half = V // 2
  if half - 1 < N or V - half < N:
    raise ValueError(f"vocab_size={V} has {half - 1} keys and {V - half} values; need "
                     f"num_kv_pairs={N} of each")
  keys = distinct(rng, n, N, 1, half)
  values = distinct(rng, n, N, half, V)
  # Weighted sampling without replacement = the top N of log p + Gumbel noise (Gumbel-top-k).
  j = np.arange(1, slots + 1, dtype=np.float64)
  log_p = np.log(power_a) + (power_a - 1.0) * np.log(j)
  scores = log_p + rng.gumbel(size=(n, slots))
  gaps = np.argsort(-scores, axis=1)[:, :N]  # query slot of each key, in key order

  full = np.zeros((n, T + 1), np.int64)  # one extra token so targets are the inputs shifted by one
  full[:, 0:context:2], full[:, 1:context:2] = keys, values
  rows = np.arange(n)[:, None]
  full[rows, context + 2 * gaps] = keys
  labels = np.full((n, T + 1), IGNORE, np.int64)
  labels[rows, context + 2 * gaps + 1] = values
  tokens, targets = full[:, :-1], labels[:, 1:]
  if random_non_queries:
    filler = np.ones((n, T), bool)
    filler[:, :context] = False
    filler[rows, context + 2 * gaps] = False
    tokens = np.where(filler, rng.integers(0, V, size=(n, T)), tokens)
  return tokens.astype(np.int32), targets.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class MQARConfig:
  """What the MQAR source generates (fields as in the config files)."""
  vocab_size: int = 256  # V: keys from [1, V/2), values from [V/2, V)
  train_settings: tuple[tuple[int, int], ...] = ((64, 4), (64, 8))  # (seq_len, kv pairs) mixed in a batch
  test_settings: tuple[tuple[int, int], ...] = ((64, 4), (64, 8))  # each is its own evaluation split
  power_a: float = 0.01  # power-law exponent of the query gaps
  random_non_queries: bool = True  # filler tokens are random instead of 0

  def __post_init__(self):
    for name in ("train_settings", "test_settings"):
      settings = getattr(self, name)
      if not settings or any(len(s) != 2 or 4 * s[1] > s[0] or s[1] < 1 for s in settings):
        raise ValueError(f"{name} must be a non-empty list of (seq_len, kv_pairs) with "
                         f"seq_len >= 4 * kv_pairs >= 4; got {settings}")
      if any(self.vocab_size // 2 - 1 < kv for _, kv in settings):
        raise ValueError(f"vocab_size={self.vocab_size} is too small for {name}={settings}")
    if not 0 < self.power_a <= 1:
      raise ValueError(f"power_a must lie in (0, 1]; got {self.power_a}")


def split_name(seq_len: int, num_kv_pairs: int) -> str:
  """The evaluation split of one test setting, e.g. `"T64_kv8"`."""
  return f"T{seq_len}_kv{num_kv_pairs}"


class MQARSource:
  """MQAR batches (see `experiments.data.DataSource`): train mixes the train settings in every batch;
  each test setting is an evaluation split. Shorter examples are padded on the right (token 0, no
  target) to the longest setting, which a causal model cannot see from the earlier positions."""

  def __init__(self, config: MQARConfig, batch_size: int):
    self.config, self.batch_size = config, batch_size
    self.vocab_size = config.vocab_size
    self.eval_splits = tuple(split_name(*s) for s in config.test_settings)
    self._tests = dict(zip(self.eval_splits, config.test_settings))
    self.train_len = max(T for T, _ in config.train_settings)
    self.test_len = max(T for T, _ in config.test_settings)

  def batch(self, split: str, seed: int, index: int) -> dict[str, np.ndarray]:
    """Batch `index` of `split` ("train" or a test split name); a pure function of its arguments."""
    c = self.config
    if split == "train":
      n = len(c.train_settings)
      sizes = [self.batch_size // n + (i < self.batch_size % n) for i in range(n)]
      parts = [self._examples([seed, 0, i, index], size, T, kv, self.train_len)
               for i, ((T, kv), size) in enumerate(zip(c.train_settings, sizes)) if size]
      tokens, targets = (np.concatenate(x) for x in zip(*parts))
    elif split in self._tests:
      T, kv = self._tests[split]
      which = self.eval_splits.index(split)
      tokens, targets = self._examples([seed, 1, which, index], self.batch_size, T, kv, self.test_len)
    else:
      raise ValueError(f"unknown split {split!r}; MQAR has 'train' and {list(self.eval_splits)}")
    return {"tokens": tokens, "targets": targets}

  def _examples(self, entropy, n, T, kv, padded_len):
    tokens, targets = multiquery_ar(np.random.default_rng(entropy), num_examples=n, seq_len=T,
                                    num_kv_pairs=kv, vocab_size=self.config.vocab_size,
                                    power_a=self.config.power_a,
                                    random_non_queries=self.config.random_non_queries)
    pad = padded_len - T
    return (np.pad(tokens, ((0, 0), (0, pad))),
            np.pad(targets, ((0, 0), (0, pad)), constant_values=IGNORE))
