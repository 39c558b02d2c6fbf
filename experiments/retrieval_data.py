"""Synthetic retrieval in RULER's style (Hsieh et al. 2024, arXiv 2404.06654), exact copying and a two-hop
lookup: generated, no download. Each task puts a little evidence in a long context and scores only the
tokens that read it back; the context length is a parameter, so the same task is tested up to and
beyond the length a model was trained at.

Token layout (vocabulary `V >= 64`):

    0 pad | 1 NEEDLE | 2 QUERY | 3 COPY | 10..19 the digits 0..9 | 32..V words, in four equal ranges:
    A (keys), B (values, middle hops), C (last hops), F (filler)

Tasks (`T` = context length; every example is exactly T tokens, left-padded with 0 where needed):

- `passkey` (RULER's niah_single_1): a haystack of one fixed filler phrase repeated (8 F-words),
  holding `NEEDLE d1..dn` at a uniform random depth; it ends with `QUERY d1..dn`. Scored: the n digits
  (each predicted from the token before it, as the targets are the inputs shifted by one).
- `number_needle` (niah_single_2): the haystack is uniform random F-words; the needle is
  `NEEDLE key d1..dn` with a key from A; the end is `QUERY key d1..dn`; scored: the digits.
- `multikey_needle` (niah_multikey_1): `num_keys` needles with distinct keys and their own numbers;
  the query names one of them; scored: its digits. The other needles are distractors.
- `copy`: L random words (A..F) then `COPY` and the same L words; L = (T - 1) // 2; scored: the copy.
- `two_hop`: `num_pairs` pairs `a b` (a from A, b from B) and as many `b c` (c from C), in random order
  at random places in F-filler; the end holds `num_queries` queries `QUERY a`, each scored on c (the
  value of the value of a: two lookups for one token).

Every draw comes from `numpy.random.default_rng` seeded by the caller: a batch is a pure function of
`(seed, split, index)`, as for MQAR (experiments/mqar_data.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

IGNORE = -1
PAD, NEEDLE, QUERY, COPY = 0, 1, 2, 3
DIGIT0 = 10
WORD0 = 32
TASKS = ("passkey", "number_needle", "multikey_needle", "copy", "two_hop")


def word_ranges(vocab_size: int) -> dict[str, tuple[int, int]]:
  """The four word ranges `A, B, C, F` as `[low, high)`."""
  q = (vocab_size - WORD0) // 4
  if q < 8:
    raise ValueError(f"vocab_size={vocab_size} is too small: need >= {WORD0 + 32} (8 words per range)")
  return {name: (WORD0 + i * q, WORD0 + (i + 1) * q) for i, name in enumerate("ABCF")}


def min_length(task: str, *, digits: int = 5, num_keys: int = 4, num_pairs: int = 4,
               num_queries: int = 4) -> int:
  """The shortest context a task fits in (with at least one filler token where it has filler)."""
  return {"passkey": 2 * (digits + 1) + 1, "number_needle": 2 * (digits + 2) + 1,
          "multikey_needle": num_keys * (digits + 2) + digits + 3, "copy": 3,
          "two_hop": 4 * num_pairs + 2 * num_queries + 1}[task]


def _example(rng, task, T, V, digits, num_keys, num_pairs, num_queries):
  """One example: `(tokens [T], targets [T])` (targets = next tokens where scored, else -1)."""
  r = word_ranges(V)
  filler_words = lambda n: rng.integers(*r["F"], size=n)
  number = lambda: DIGIT0 + rng.integers(0, 10, size=digits)
  if task == "copy":
    L = (T - 1) // 2
    s = rng.integers(WORD0, V, size=L)
    seq = np.concatenate([s, [COPY], s])
    answer = np.zeros(len(seq), bool)
    answer[L + 1:] = True  # the copied words
    return _finish(seq, answer, T)
  if task == "two_hop":
    a = rng.choice(np.arange(*r["A"]), num_pairs, replace=False)
    b = rng.choice(np.arange(*r["B"]), num_pairs, replace=False)
    c = rng.choice(np.arange(*r["C"]), num_pairs, replace=False)
    blocks = [np.array([x, y]) for x, y in zip(a, b)] + [np.array([y, z]) for y, z in zip(b, c)]
    asked = rng.choice(num_pairs, num_queries, replace=num_queries > num_pairs)
    tail = np.concatenate([[QUERY, a[i], c[i]] for i in asked])
    # c follows its query in the input (teacher forcing), so it is the target at a's position
    tail_answer = np.concatenate([[False, False, True] for _ in asked])
    return _haystack(rng, blocks, filler_words, tail, tail_answer, T)
  if task == "passkey":
    phrase = np.arange(r["F"][0], r["F"][0] + 8)  # the same phrase in every example, as in RULER
    key = number()
    blocks = [np.concatenate([[NEEDLE], key])]
    tail = np.concatenate([[QUERY], key])
    fill = lambda n: np.resize(phrase, n)
    return _haystack(rng, blocks, fill, tail, np.r_[False, np.ones(digits, bool)], T)
  # number_needle, multikey_needle
  n = 1 if task == "number_needle" else num_keys
  keys = rng.choice(np.arange(*r["A"]), n, replace=False)
  numbers = [number() for _ in range(n)]
  blocks = [np.concatenate([[NEEDLE, k], d]) for k, d in zip(keys, numbers)]
  which = rng.integers(n)
  tail = np.concatenate([[QUERY, keys[which]], numbers[which]])
  return _haystack(rng, blocks, filler_words, tail, np.r_[False, False, np.ones(digits, bool)], T)


def _haystack(rng, blocks, fill, tail, tail_answer, T):
  """`blocks` at uniform random places (in random order) in filler, then `tail`; T tokens in all.
  `tail_answer` marks the tokens of `tail` that are scored."""
  room = T - len(tail) - sum(len(b) for b in blocks)
  cuts = np.sort(rng.integers(0, room + 1, size=len(blocks)))
  order = rng.permutation(len(blocks))
  filler = fill(room)
  parts, last = [], 0
  for cut, i in zip(cuts, order):
    parts += [filler[last:cut], blocks[i]]
    last = cut
  parts += [filler[last:], tail]
  seq = np.concatenate(parts)
  answer = np.zeros(len(seq), bool)
  answer[len(seq) - len(tail):] = tail_answer
  return _finish(seq, answer, T)


def _finish(seq, answer, T):
  """Left-pads `seq` (and its answer mask) to T; `targets[t] = seq[t + 1]` where token t + 1 is an
  answer, else -1: each answer token is predicted from the token before it."""
  pad = T - len(seq)
  seq = np.concatenate([np.full(pad, PAD), seq]).astype(np.int64)
  answer = np.concatenate([np.zeros(pad, bool), answer])
  targets = np.full(T, IGNORE, np.int64)
  targets[:-1] = np.where(answer[1:], seq[1:], IGNORE)
  return seq, targets


def generate(rng: np.random.Generator, task: str, *, num_examples: int, seq_len: int, vocab_size: int,
             digits: int = 5, num_keys: int = 4, num_pairs: int = 4,
             num_queries: int = 4) -> tuple[np.ndarray, np.ndarray]:
  """`num_examples` examples of `task` (module docstring), each `seq_len` tokens.

  Returns `(tokens, targets)`, both `[num_examples, seq_len]` int32; targets are -1 except where a
  scored token is to be predicted (the next token there)."""
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; known: {TASKS}")
  need = min_length(task, digits=digits, num_keys=num_keys, num_pairs=num_pairs,
                    num_queries=num_queries)
  if seq_len < need:
    raise ValueError(f"{task}: seq_len={seq_len} < {need}, the shortest context it fits in")
  word_ranges(vocab_size)
  rows = [_example(rng, task, seq_len, vocab_size, digits, num_keys, num_pairs, num_queries)
          for _ in range(num_examples)]
  tokens, targets = (np.stack(x).astype(np.int32) for x in zip(*rows))
  return tokens, targets


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
  """What the retrieval source generates (fields as in the config files)."""
  vocab_size: int = 256  # V: 32 reserved ids, then four word ranges
  tasks: tuple[str, ...] = TASKS  # mixed in every training batch; each is tested at every length
  train_lengths: tuple[int, ...] = (128,)  # context lengths mixed in training
  test_lengths: tuple[int, ...] = (64, 128, 256)  # each (task, length) is its own evaluation split
  digits: int = 5  # digits of a passkey / needle number
  num_keys: int = 4  # needles of multikey_needle
  num_pairs: int = 4  # first-hop pairs of two_hop
  num_queries: int = 4  # queries of two_hop

  def __post_init__(self):
    unknown = sorted(set(self.tasks) - set(TASKS))
    if not self.tasks or unknown:
      raise ValueError(f"tasks must be a non-empty list of {TASKS}; got {self.tasks}")
    if not self.train_lengths or not self.test_lengths:
      raise ValueError("train_lengths and test_lengths must be non-empty")
    word_ranges(self.vocab_size)
    if self.num_pairs > (self.vocab_size - WORD0) // 4 or min(self.digits, self.num_keys,
                                                              self.num_pairs, self.num_queries) < 1:
      raise ValueError(f"need digits, num_keys, num_queries >= 1 and 1 <= num_pairs <= a word range; "
                       f"got {self}")
    for task in self.tasks:
      need = min_length(task, digits=self.digits, num_keys=self.num_keys, num_pairs=self.num_pairs,
                        num_queries=self.num_queries)
      short = [L for L in self.train_lengths + self.test_lengths if L < need]
      if short:
        raise ValueError(f"{task} needs context lengths >= {need}; got {short}")


def split_name(task: str, seq_len: int) -> str:
  """The evaluation split of one (task, length), e.g. `"passkey_T128"`."""
  return f"{task}_T{seq_len}"


class RetrievalSource:
  """Retrieval batches (see `experiments.data.DataSource`): a training batch mixes every task at
  every train length (equal shares, right-padded to the longest with unscored 0s); each
  (task, test length) is an evaluation split."""

  def __init__(self, config: RetrievalConfig, batch_size: int):
    self.config, self.batch_size = config, batch_size
    self.vocab_size = config.vocab_size
    self._tests = {split_name(t, L): (t, L) for t in config.tasks for L in config.test_lengths}
    self.eval_splits = tuple(self._tests)
    self.train_len = max(config.train_lengths)

  def batch(self, split: str, seed: int, index: int) -> dict[str, np.ndarray]:
    c = self.config
    if split == "train":
      kinds = [(t, L) for t in c.tasks for L in c.train_lengths]
      n = len(kinds)
      sizes = [self.batch_size // n + (i < self.batch_size % n) for i in range(n)]
      parts = [self._examples([seed, 0, i, index], size, t, L, self.train_len)
               for i, ((t, L), size) in enumerate(zip(kinds, sizes)) if size]
      tokens, targets = (np.concatenate(x) for x in zip(*parts))
    elif split in self._tests:
      task, L = self._tests[split]
      tokens, targets = self._examples([seed, 1, self.eval_splits.index(split), index],
                                       self.batch_size, task, L, L)
    else:
      raise ValueError(f"unknown split {split!r}; retrieval has 'train' and {list(self.eval_splits)}")
    return {"tokens": tokens, "targets": targets}

  def _examples(self, entropy, n, task, T, padded_len):
    c = self.config
    tokens, targets = generate(np.random.default_rng(entropy), task, num_examples=n, seq_len=T,
                               vocab_size=c.vocab_size, digits=c.digits, num_keys=c.num_keys,
                               num_pairs=c.num_pairs, num_queries=c.num_queries)
    pad = padded_len - T
    return (np.pad(tokens, ((0, 0), (0, pad))),
            np.pad(targets, ((0, 0), (0, pad)), constant_values=IGNORE))
