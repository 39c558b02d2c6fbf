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

from experiments.mqar_data import distinct

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


def _batch(rng, task, n, T, V, digits, num_keys, num_pairs, num_queries):
  """`n` examples at once: `(tokens [n, T], answer [n, T] bool)`, answer marking the scored tokens."""
  r = word_ranges(V)
  number = lambda *shape: DIGIT0 + rng.integers(0, 10, size=(*shape, digits))
  if task == "copy":
    L = (T - 1) // 2
    words = rng.integers(WORD0, V, size=(n, L))
    pad = np.full((n, T - 2 * L - 1), PAD)
    tokens = np.concatenate([pad, words, np.full((n, 1), COPY), words], axis=1)
    answer = np.zeros((n, T), bool)
    answer[:, T - L:] = True  # the copied words
    return tokens, answer
  if task == "two_hop":
    a = distinct(rng, n, num_pairs, *r["A"])
    b = distinct(rng, n, num_pairs, *r["B"])
    c = distinct(rng, n, num_pairs, *r["C"])
    blocks = np.concatenate([np.stack([a, b], -1), np.stack([b, c], -1)], axis=1)  # [n, 2P, 2]
    if num_queries <= num_pairs:
      asked = np.argsort(rng.random((n, num_pairs)), axis=1)[:, :num_queries]
    else:
      asked = rng.integers(0, num_pairs, size=(n, num_queries))
    pick = lambda x: np.take_along_axis(x, asked, axis=1)
    # c follows its query in the input (teacher forcing), so it is the target at a's position
    tail = np.stack([np.full(asked.shape, QUERY), pick(a), pick(c)], -1).reshape(n, -1)
    tail_answer = np.tile([False, False, True], num_queries)
    filler = rng.integers(*r["F"], size=(n, T))
  elif task == "passkey":
    key = number(n)
    blocks = np.concatenate([np.full((n, 1), NEEDLE), key], axis=1)[:, None]  # [n, 1, 1 + digits]
    tail = np.concatenate([np.full((n, 1), QUERY), key], axis=1)
    tail_answer = np.r_[False, np.ones(digits, bool)]
    phrase = np.arange(r["F"][0], r["F"][0] + 8)  # the same phrase in every example, as in RULER
    filler = np.broadcast_to(np.resize(phrase, T), (n, T))
  else:  # number_needle, multikey_needle
    m = 1 if task == "number_needle" else num_keys
    keys, numbers = distinct(rng, n, m, *r["A"]), number(n, m)
    blocks = np.concatenate([np.full((n, m, 1), NEEDLE), keys[..., None], numbers], axis=2)
    which = rng.integers(0, m, size=n)
    rows = np.arange(n)
    tail = np.concatenate([np.full((n, 1), QUERY), keys[rows, which, None], numbers[rows, which]],
                          axis=1)
    tail_answer = np.r_[False, False, np.ones(digits, bool)]
    filler = rng.integers(*r["F"], size=(n, T))
  return _haystack(rng, blocks, filler, tail, tail_answer, T)


def _haystack(rng, blocks, filler, tail, tail_answer, T):
  """`blocks: [n, m, b]` at uniform random places, in random order, among filler tokens (taken in
  order from `filler: [n, >= room]`), then `tail: [n, t]`; T tokens in all. `tail_answer: [t]` marks
  the tail's scored tokens."""
  n, m, width = blocks.shape
  room = T - tail.shape[1] - m * width
  blocks = np.take_along_axis(blocks, np.argsort(rng.random((n, m)), axis=1)[..., None], axis=1)
  cuts = np.sort(rng.integers(0, room + 1, size=(n, m)), axis=1)  # filler tokens before each block
  starts = cuts + width * np.arange(m)  # earlier blocks push later ones right
  body = np.zeros((n, T - tail.shape[1]), np.int64)
  in_block = np.zeros(body.shape, bool)
  at = (starts[..., None] + np.arange(width)).reshape(n, -1)
  rows = np.arange(n)[:, None]
  body[rows, at] = blocks.reshape(n, -1)
  in_block[rows, at] = True
  body[~in_block] = np.asarray(filler)[:, :room].reshape(-1)  # row-major: each row's filler in order
  tokens = np.concatenate([body, tail], axis=1)
  answer = np.zeros((n, T), bool)
  answer[:, T - tail.shape[1]:] = tail_answer
  return tokens, answer


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
  tokens, answer = _batch(rng, task, num_examples, seq_len, vocab_size, digits, num_keys, num_pairs,
                          num_queries)
  targets = np.full(tokens.shape, IGNORE, np.int64)
  targets[:, :-1] = np.where(answer[:, 1:], tokens[:, 1:], IGNORE)  # each answer from the token before
  return tokens.astype(np.int32), targets.astype(np.int32)


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
