"""The walks' chunk pipeline: the sequence pieces (`pieces`, `chain_pieces`), a program's coordinates,
the state's entry and exit through shared memory, the double-buffered TMA loop over chunks
(`walk_chunks`) and the fetching warpgroup's loop of the streamed walks (`stream_chunks`,
`deepest_stages`), and the prepared walk's per-chunk fetch and value steps.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from .tiles import F32, SMEM_BYTES, WGMMA, matmul, scratch_bytes

SM_COUNT = 132   # an H200's multiprocessors: walks with fewer programs split the sequence (`pieces`)


def pieces(programs: int, NC: int, pieces_: int | None = None) -> int:
  """How many pieces each sequence's walk is split into: the given number, or (None) the largest power
  of two that divides NC, keeps `programs * pieces` within one wave of the GPU and leaves at least 16
  chunks per piece. A walk is sequential over its chunks, so at (1, 32768, 16, 128) the 32 programs of
  an unsplit walk would leave three quarters of the multiprocessors idle."""
  if pieces_ is not None:
    if pieces_ < 1:
      raise ValueError(f"sequence_pieces must be >= 1; got {pieces_}")
    return pieces_
  S = 1
  while programs * S * 2 <= SM_COUNT and NC >= 2 * S * 16 and NC % (2 * S) == 0:
    S *= 2
  return S


def chain_pieces(first, offsets, apply, *, reverse: bool = False):
  """`[B, H, S, ...]`: the state entering every piece (`reverse`: the gradient leaving it) from the one
  entering the first (leaving the last), `first` None (zeros) or `[B, H, ...]`; each piece's linear map
  `apply(x, p)` and its own contribution from a zero start `offsets[:, :, p]`:
  `in[p + 1] = apply(in[p], p) + offsets[p]` (reverse: `out[p - 1] = apply(out[p], p) + offsets[p]`).
  The pieces are few: a loop in XLA over single states."""
  S = offsets.shape[2]
  carry = jnp.zeros_like(offsets[:, :, 0]) if first is None else first.astype(F32)
  out = [None] * S
  for p in (range(S - 1, -1, -1) if reverse else range(S)):
    out[p] = carry
    carry = apply(carry, p) + offsets[:, :, p]
  return jnp.stack(out, axis=2)


def program(bv):
  """This program's batch row, head and slice of value columns."""
  return lax.axis_index("b"), lax.axis_index("h"), pl.ds(lax.axis_index("v") * bv, bv)


def initial(src, state_s, bar, bv, K):
  """The float32 `[bv, K]` tile `src` (a GMEM ref, or None for zeros) in registers, WGMMA layout."""
  if src is None:
    return plgpu.layout_cast(jnp.zeros((bv, K), F32), WGMMA)
  plgpu.copy_gmem_to_smem(src, state_s, bar)
  plgpu.barrier_wait(bar)
  return plgpu.load(state_s, layout=WGMMA)


def store_last(x, state_s, dst):
  """Writes the float32 registers `x` to the GMEM ref `dst` through `state_s`, and waits for every
  store of the program."""
  state_s[...] = x
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(state_s, dst)
  plgpu.wait_smem_to_gmem(0)


def stream_chunks(NC, stages, issue, in_free):
  """A fetching warpgroup's loop over chunks 0 .. NC-1: `issue(n)` fetches chunk n into slot
  `n % stages`; the first `stages` at once, then chunk n + stages once every reader has freed chunk n's
  slot (`in_free`, one phase per chunk). It then waits for the frees it did not need, so that it has
  seen every phase of `in_free` (the interpreter checks that no phase goes unobserved)."""
  for n in range(min(stages, NC)):
    issue(n)

  def refill(n, carry):
    plgpu.barrier_wait(in_free.at[lax.rem(n, stages)])
    issue(n + stages)
    return carry

  if NC > stages:
    lax.fori_loop(0, NC - stages, refill, 0)
  for n in range(max(NC - stages, 0), NC):
    plgpu.barrier_wait(in_free.at[n % stages])


def walk_chunks(NC, issue, in_bar, init, chunk, *, reverse: bool = False):
  """`chunk(n, slot, carry) -> carry` over chunks 0 .. NC-1 (or NC-1 .. 0), double-buffered: the inputs
  of the next chunk are fetched by `issue(n, slot)` (TMA, arriving on `in_bar.at[slot]`) into the other
  slot while this one computes. `init()` gives the first carry; it runs after the first fetch is issued,
  so that its own load overlaps it."""
  first = NC - 1 if reverse else 0
  issue(first, first % 2)
  carry = init()

  def step(i, carry):
    n = NC - 1 - i if reverse else i
    slot = lax.rem(n, 2)
    plgpu.barrier_wait(in_bar.at[slot])

    @pl.when(n > 0 if reverse else n + 1 < NC)
    def _prefetch():
      issue(n - 1 if reverse else n + 1, 1 - slot)

    return chunk(n, slot, carry)

  return lax.fori_loop(0, NC, step, carry)


def fetch_chunk(srcs, dsts, n, slot, bar, b, h, vs, C, u_vs=None):
  """TMA copies of chunk n's walk inputs (kd, u, decay, w, qg, p; the absent ones None) of batch row b,
  head h and value columns vs (u: `u_vs`, default vs) into input slot `slot`, arriving on `bar`."""
  kd_r, u_r, decay_r, w_r, qg_r, p_r = srcs
  kd_s, u_s, decay_s, w_s, qg_s, p_s = dsts
  rows = pl.ds(n * C, C)
  plgpu.copy_gmem_to_smem(kd_r.at[b, h, rows], kd_s.at[slot], bar)
  plgpu.copy_gmem_to_smem(u_r.at[b, h, rows, vs if u_vs is None else u_vs], u_s.at[slot], bar)
  plgpu.copy_gmem_to_smem(decay_r.at[b, h, n], decay_s.at[slot], bar)
  for src, dst in ((w_r, w_s), (qg_r, qg_s), (p_r, p_s)):
    if src is not None:
      plgpu.copy_gmem_to_smem(src.at[b, h, rows], dst.at[slot], bar)


def u_block(bv, u_blocks, blocks):
  """`(u's columns for this program, None or a float32 0/1 factor)`: programs of the first `u_blocks`
  of `blocks` value blocks read theirs; the others read block 0's (any block: the TMA's arrivals stay
  the same) and multiply it by 0."""
  v = lax.axis_index("v")
  if u_blocks >= blocks:
    return pl.ds(v * bv, bv), None
  return pl.ds(jnp.minimum(v, max(u_blocks - 1, 0)) * bv, bv), (v < u_blocks).astype(F32)


def new_values(u_ref, s_lo, w_ref, keep, dst):
  """The delta family's `u_new^T = U^T - S^T W^T` (`U` times the 0/1 factor `keep` of `u_block`,
  unless None) written to the `[bv, C]` shared-memory tile `dst` in its dtype; returns dst."""
  u = plgpu.load(u_ref.T, layout=WGMMA).astype(F32)
  dst[...] = ((u if keep is None else u * keep) - matmul(s_lo, w_ref.T, dst.shape)).astype(dst.dtype)
  plgpu.commit_smem()
  return dst


def deepest_stages(scratch, what: str) -> int:
  """The deepest input pipeline (4, 3 or 2 slots) of a streamed walk whose shared memory fits a block,
  `scratch(stages)` its scratch dict. A walk that does not fit even with 2 raises a ValueError naming
  `what` and the bytes it needs."""
  for stages in (4, 3, 2):
    if scratch_bytes(scratch(stages)) <= SMEM_BYTES:
      return stages
  raise ValueError(f"{what} does not fit {SMEM_BYTES} bytes of shared memory with 2 input slots (it needs "
                   f"{scratch_bytes(scratch(2))}); use warpgroups=1")
