"""The sequence pieces' affine maps (`walk.piece_maps`) in the Mosaic GPU interpreter: the delta
family's walk that zeroes u in the identity's columns against the same walk over an explicit
`[u, 0]` array (identical numbers) and against a float64 loop; the additive family's diagonal maps."""

import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import prep
from linear_attention_jax.pallas_kernels.gpu import walk
from tests.ops.conftest import make_inputs, rel_rms
from tests.pallas_kernels.gpu.util import PARAMS

F32 = jnp.float32


def _tensors(variant, T, K, V, seed):
  inp = make_inputs(variant, B=1, T=T, H=1, Hv=2, K=K, V=V, seed=seed)
  f = lambda n: None if inp.get(n) is None else jnp.asarray(inp[n], F32)
  t = prep.prepare(f("q"), f("k"), f("v"), f("g"), f("beta"), None, chunk_size=64, dtype=jnp.bfloat16)
  return t._replace(**{n: None if getattr(t, n) is None else getattr(t, n).astype(jnp.bfloat16)
                       for n in ("qg", "kd", "w", "u", "p")})


def _loop(t, S):
  """float64 `(A, F)` of every piece: S <- Diag(decay) S + Kd^T (U - W S), from I with U = 0 and from 0."""
  f = lambda x: None if x is None else np.asarray(x, np.float64)
  kd, w, u, decay = f(t.kd), f(t.w), f(t.u), f(t.decay)
  B, H, NC, C, K = kd.shape
  A = np.zeros((B, H, S, K, K))
  F = np.zeros((B, H, S, K, u.shape[-1]))
  for b in range(B):
    for h in range(H):
      for p in range(S):
        a, o = np.eye(K), np.zeros((K, u.shape[-1]))
        for n in range(p * NC // S, (p + 1) * NC // S):
          step = lambda x, U: decay[b, h, n][:, None] * x + kd[b, h, n].T @ (
              U - (0 if w is None else w[b, h, n] @ x))
          a, o = step(a, np.zeros((C, K))), step(o, u[b, h, n])
        A[b, h, p], F[b, h, p] = a, o
  return A, F


@pytest.mark.parametrize("variant,K,V,S", [("gated_delta_rule", 64, 128, 2), ("delta_rule", 128, 64, 3),
                                           ("gla", 64, 64, 2)])
def test_piece_maps_match_the_explicit_walk_and_the_float64_loop(variant, K, V, S):
  t = _tensors(variant, 64 * 2 * S, K, V, seed=5)
  A, F = walk.piece_maps(t, S, interpret=PARAMS)
  A_only, none = walk.piece_maps(t, S, interpret=PARAMS, with_offsets=False)
  assert none is None
  rA, rF = _loop(t, S)
  assert rel_rms(np.asarray(A), rA) < 1e-2 and rel_rms(np.asarray(F), rF) < 1e-2
  np.testing.assert_array_equal(np.asarray(A_only), np.asarray(A))
  if t.w is None:
    return
  # the walk over an explicit [u, 0] array (how the maps were formed before): the same products
  B, H, NC, C, _ = t.qg.shape
  u = jnp.concatenate([t.u, jnp.zeros(t.u.shape[:4] + (K,), t.u.dtype)], axis=-1)
  start = jnp.concatenate([jnp.zeros((K, V), F32), jnp.eye(K, dtype=F32)], axis=-1)
  start = jnp.broadcast_to(start.T, (B, H, S, V + K, K))
  ends = walk._forward_kernel(t._replace(u=u), start, S=S, with_o=False, with_states=False, out_dtype=F32,
                              interpret=PARAMS, bv=64)[2]
  ends = np.asarray(jnp.swapaxes(ends, -1, -2))
  np.testing.assert_array_equal(np.asarray(A), ends[..., V:])
  np.testing.assert_array_equal(np.asarray(F), ends[..., :V])


def test_zeroed_u_only_in_the_maps_walk():
  t = _tensors("delta_rule", 128, 64, 64, seed=6)
  with pytest.raises(ValueError, match="u_blocks"):
    walk._forward_kernel(t, None, S=1, with_o=True, with_states=False, out_dtype=F32, interpret=PARAMS,
                         bv=64, state_cols=128, u_blocks=1)


@pytest.mark.parametrize("S", [1, 2])
def test_the_walk_keeps_the_last_chunks_start_in_float32(S):
  # kda's backward reads it (`channel.final_state_grads`): the state entering the last
  # chunk in float32, of which the last saved state is the operand-dtype copy; with sequence pieces,
  # the last piece's (its start chained in XLA)
  t = _tensors("gated_delta_rule", 64 * 2 * S, 64, 128, seed=7)
  o, states, final, _, last = walk.forward(t, None, with_states=True, interpret=PARAMS, sequence_pieces=S,
                                           return_transitions=True, with_last_start=True)
  last = np.asarray(last)
  np.testing.assert_array_equal(np.asarray(states[:, :, -1]).astype(np.float32),
                                last.astype(jnp.bfloat16).astype(np.float32))
  assert (last != last.astype(jnp.bfloat16).astype(np.float32)).mean() > 0.5
  plain = walk.forward(t, None, with_states=True, interpret=PARAMS, sequence_pieces=S)
  for a, b in zip(plain, (o, states, final)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  NC = t.qg.shape[2]
  _, F = _loop(t._replace(**{n: getattr(t, n)[:, :, :NC - 1] for n in ("kd", "w", "u", "decay")}), 1)
  assert rel_rms(np.swapaxes(last, -1, -2), F[:, :, 0]) < 1e-2
