"""Per-channel decay's grams at any gate strength: the 8-token-group form the per-channel kernels take
for a chunk whose decay does not fit one reference.

Notation as prep.py's: `G [C, K]` the chunk-local cumulative log-decay (float32, non-increasing down the
chunk), and a decayed gram `A_ij = sum_c a_ic b_jc e^(G_ic - G_jc)` over `j <= i`. One reference per
channel factors it as one product only while the chunk spans at most `2 * prep.ref_bound` nats (at
g = -20 a token, about six tokens). Here the `[C, C]` tile splits into

- the lower-left block of every sibling pair of blocks of `s = C/2, C/4, ..., 8` tokens ("levels"),
  each level one whole-tile product about the pair's reference `e`, G at the last row of the earlier
  block: `(a e^(G - e)) (b e^(e - G))^T` kept on those blocks only. For a later row i and an earlier
  column j, `G_i <= e <= G_j`, so both exponents are <= 0: a factor can only underflow (to a term
  smaller than float32 resolves), never overflow, at any decay;
- the 8 x 8 diagonal blocks ("diag"): one product about each group's middle `m = (e_prev + e) / 2`, e
  the group's last row and e_prev the previous group's (0 before the first), kept on the same-group
  strictly causal entries. Its factors lie within `e^(+-span/2)`, the span (e_prev - e) being 8 tokens
  of decay: 80 nats at g = -20 a token, within `GROUP_BOUND`. The tile's own diagonal (a token with
  itself, no decay) is a float32 row sum, and in the backward its terms (`dP_ii k_i` in dq, `dP_ii q_i`
  in dk) are float32 too, so they cancel exactly in `dG = q dq - k dk` (rounded apart in two products,
  they leave an error comparable to the whole of dg where the decay is strong).

log2(C / 8) + 1 products (4 at C = 64) cover the tile exactly once. The same construction with
diagonal blocks of `HALVES` = 32 tokens ("halves": one level and one diagonal product, 2 at C = 64)
serves a chunk whose two halves each span at most twice the diagonal bound (168 nats for bfloat16
operands, 5.25 nats a token), where one reference (120 nats over the whole chunk) does not: every
function below takes the diagonal blocks' size as `block`. The entries a product does not keep
are dropped by a select (the accumulator's entries are independent), so their factors need only be
finite: the levels clamp exponents to <= 0, the diagonal to the bound. `prep.LOG_DECAY_FLOOR` (-20 a
token) makes every chunk of bfloat16 operands fit; float16 operands (largest ~e^11) fit 2.2 nats a
token and beyond it the caller takes XLA's merge form (`fits`).

The per-chunk reference vectors ride in the kernels' `refs` rows (`channel.chunk_cumsum`): row 0 the
one-reference `R`, row 1 `G_C`, rows `2 + t` the last row of group t (NG = C / 8 groups; the middles
are formed from them in the kernel, sparing shared memory). The functions below build, inside a
kernel, the `[C, W]` reference tiles and the `[C, C]` keep masks of each product from those rows.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu

from .. import prep
from .tiles import WGMMA

GROUP = 8             # tokens of a diagonal block
HALVES = 32           # tokens of a diagonal block in the halves' form (one level and the two halves)
GROUP_BOUND = 84.0    # |G - m| on the diagonal blocks, bfloat16 and float32 operands (e^84 ~ 3e36)
GROUP_BOUND_F16 = 8.0   # float16 operands (largest 65504 ~ e^11)
FIRST_ROW = 2         # refs rows: R, G_C, then the groups' last rows, then their middles


def group_bound(dtype) -> float:
  """The diagonal blocks' bound on `|G - m|` for matmul operands of `dtype`."""
  return GROUP_BOUND_F16 if jnp.dtype(dtype) == jnp.float16 else GROUP_BOUND


def groups(C: int) -> int:
  if C % GROUP or C < 2 * GROUP or C & (C - 1):
    raise ValueError(f"the group form takes chunks of a power of two >= {2 * GROUP} tokens; got {C}")
  return C // GROUP


def levels(C: int, block: int = GROUP) -> tuple[int, ...]:
  """The block sizes of the levels, largest first: C/2, ..., `block` (the diagonal blocks' tokens)."""
  out, s = [], C // 2
  while s >= block:
    out.append(s)
    s //= 2
  return tuple(out)


def ref_rows(Gc):
  """XLA: the groups' reference rows of chunked `Gc [B, NC, C, H_v, K]`: `[B, NC, NG, H_v, K]`, each
  group's last row."""
  B, NC, C, Hv, K = Gc.shape
  return Gc.reshape(B, NC, groups(C), GROUP, Hv, K)[:, :, :, -1]


def always_fits(dtype) -> bool:
  """True when every group fits by construction: gates at or above prep.LOG_DECAY_FLOOR decay at most
  `GROUP * 20` nats over a group (bfloat16 operands: 160 <= 2 * 84)."""
  return GROUP * -prep.LOG_DECAY_FLOOR <= 2.0 * group_bound(dtype)


def fits(G, C: int, dtype):
  """True when every 8-token group of `G [B, T_pad, H_v, K]` (token layout) spans at most twice the
  diagonal bound (always, for bfloat16 operands and gates at or above prep.LOG_DECAY_FLOOR)."""
  B, T_pad, Hv, K = G.shape
  last = G.reshape(B, T_pad // C, C // GROUP, GROUP, Hv, K)[:, :, :, -1]
  prev = jnp.pad(last[:, :, :-1], [(0, 0), (0, 0), (1, 0), (0, 0), (0, 0)])
  return jnp.all(prev - last <= 2.0 * group_bound(dtype))


def _pick(shape, pieces, size):
  """A `[C, W]` float32 tile whose rows `[p size, (p + 1) size)` hold `pieces[p]` (broadcast tiles)."""
  i = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WGMMA)
  out = pieces[-1]
  for p in range(len(pieces) - 2, -1, -1):
    out = jnp.where(i < (p + 1) * size, pieces[p], out)
  return out


def level_reference(vec, shape, s: int):
  """The reference tile of level `s`: row i holds the last row of the earlier block of i's pair of
  `s`-token blocks (`vec(t)`: the broadcast `[C, W]` tile of refs row `FIRST_ROW + t`)."""
  C = shape[0]
  return _pick(shape, [vec((2 * p + 1) * s // GROUP - 1) for p in range(C // (2 * s))], 2 * s)


def middle_reference(vec, shape, block: int = GROUP):
  """The diagonal blocks' reference tile: row i holds the middle `(e_prev + e) / 2` of i's block of
  `block` tokens, e its last row and e_prev the previous block's (`vec(t)`: the broadcast tile of
  8-token group t's last row, refs row `FIRST_ROW + t`)."""
  per = block // GROUP   # groups a block
  ends = [vec((b + 1) * per - 1) for b in range(shape[0] // block)]
  mids = [ends[0] * 0.5] + [(ends[b - 1] + ends[b]) * 0.5 for b in range(1, len(ends))]
  return _pick(shape, mids, block)


def level_mask(C: int, s: int):
  """`[C, C]` bool: the lower-left block of every pair of `s`-token blocks."""
  i = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
  j = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
  return (lax.div(i, 2 * s) == lax.div(j, 2 * s)) & later_rows((C, C), s) & (lax.rem(lax.div(j, s), 2) == 0)


def diagonal_mask(C: int, inclusive: bool, block: int = GROUP):
  """`[C, C]` bool: the causal entries of the `block` x `block` diagonal blocks."""
  i = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
  j = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
  causal = (i >= j) if inclusive else (i > j)
  return causal & (lax.div(i, block) == lax.div(j, block))


def by_form(form, one, grouped):
  """Inside a kernel, for a chunk's (or a half's) form `form` (`channel.ONE`, `HALVES` or `GROUPS` as a
  float32 scalar, `channel.form_row` / `form_tokens`): `one()`, or `grouped(block)` with the halves'
  (`HALVES`) or the groups' (`GROUP`) diagonal blocks, in a `lax.cond`."""
  return lax.cond(form < 0.5, one, lambda: lax.cond(form < 1.5, lambda: grouped(HALVES),
                                                    lambda: grouped(GROUP)))


def products(C: int, block: int = GROUP):
  """The products of the group form with diagonal blocks of `block` tokens, in order: `(s or None for
  the diagonal, ...)`."""
  return levels(C, block) + (None,)


def factors(G, vec_end, s, bound: float, block: int = GROUP):
  """`(up, down)` float32 `[C, W]` for product `s` (a level's block size, or None: the diagonal):
  `a` takes `up = e^(G - ref)` and `b` takes `down = e^(ref - G)`, exponents clamped (the levels' to
  <= 0, exact on the entries they keep; the diagonal's to the bound)."""
  shape = G.shape
  if s is None:
    ref = middle_reference(vec_end, shape, block)
    return jnp.exp(jnp.minimum(G - ref, bound)), jnp.exp(jnp.minimum(ref - G, bound))
  ref = level_reference(vec_end, shape, s)
  return jnp.exp(jnp.minimum(G - ref, 0.0)), jnp.exp(jnp.minimum(ref - G, 0.0))


def later_rows(shape, s: int):
  """`[C, W]` bool: the rows in the later block of their pair of `s`-token blocks (level `s`'s rows i)."""
  i = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WGMMA)
  return lax.rem(lax.div(i, s), 2) == 1


def level_factor(G, vec_end, s: int):
  """Level `s`'s two factors in one float32 `[C, W]` tile: `e^(G - ref)` on its later rows (a level's
  rows i: `up`), `e^(ref - G)` on its earlier rows (its columns j: `down`), each exponent clamped to
  <= 0 as `factors` clamps them. A level keeps only entries of a later row and an earlier column, so
  `up` is read on later rows alone and `down` on earlier rows alone: one exponential a channel and
  token where `factors` takes two, and for kda one staged tile `k E` that is both `Kr` (earlier rows)
  and `Ar` (later rows). Equal to `up` and `down` wherever a level's product reads them."""
  ref = level_reference(vec_end, G.shape, s)
  return jnp.exp(jnp.minimum(jnp.where(later_rows(G.shape, s), G - ref, ref - G), 0.0))


def keep_mask(C: int, s, block: int = GROUP):
  """The entries product `s` keeps (`level_mask`, or the strict `diagonal_mask` for None: the tile's
  own diagonal, undecayed, is `with_diagonal`'s)."""
  return diagonal_mask(C, inclusive=False, block=block) if s is None else level_mask(C, s)


def diagonal(C: int):
  """`[C, C]` bool: i == j."""
  i = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
  j = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
  return i == j


def with_diagonal(A, a, b):
  """`A` (a strict gram) with the diagonal `A_ii = sum_c a_ic b_ic` (no decay between a token and
  itself) added in float32, `a`, `b` float32 `[C, W]` tiles (a W-column slice adds its part)."""
  C = A.shape[0]
  d = jnp.sum(a * b, axis=1)
  return A + jnp.where(diagonal(C), lax.broadcast_in_dim(d, (C, C), [0]), 0.0)


def diagonal_of(A):
  """The diagonal of the `[C, C]` float32 tile `A` as a rows vector."""
  return jnp.sum(jnp.where(diagonal(A.shape[0]), A, 0.0), axis=1)

