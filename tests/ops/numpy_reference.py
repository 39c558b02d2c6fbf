"""A plain NumPy float64 per-token loop for both families, forward and backward, written for the tests.

It shares nothing with the library: the forward follows shared/DESIGN.md's recurrence literally and the
backward is the hand-derived reverse of that loop. Heads are already expanded (`H = H_v`).
"""

import numpy as np


def _decay(g_t):
  """exp(g_t) shaped to multiply a `[H, K, V]` state (`g_t`: `[H]` or `[H, K]`)."""
  d = np.exp(g_t)
  return d[:, None, None] if d.ndim == 1 else d[:, :, None]


def forward_backward(q, k, v, g, beta, h0, scale, do, dhT):
  """One sequence. `q, k: [T, H, K]`, `v: [T, H, V]`, `g: None | [T, H] | [T, H, K]`,
  `beta: None | [T, H]`, `h0: [H, K, V]`; `do: [T, H, V]` and `dhT: [H, K, V]` are the cotangents.

  Returns `(o, hT, grads)` with grads a dict over "q", "k", "v", "g", "beta", "h0".
  """
  T, H, K = q.shape
  V = v.shape[-1]
  S = h0.astype(np.float64).copy()
  o = np.zeros((T, H, V))
  saved = []
  for t in range(T):
    S_prev = S
    Sp = S_prev * _decay(g[t]) if g is not None else S_prev.copy()
    if beta is None:
      u = v[t]
      pred = None
    else:
      pred = np.einsum("hkv,hk->hv", Sp, k[t])
      u = beta[t][:, None] * (v[t] - pred)
    S = Sp + k[t][:, :, None] * u[:, None, :]
    o[t] = scale * np.einsum("hkv,hk->hv", S, q[t])
    saved.append((S_prev, Sp, S, u, pred))
  hT = S

  grads = {name: np.zeros_like(x, dtype=np.float64) for name, x in
           (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)) if x is not None}
  dS = dhT.astype(np.float64).copy()
  for t in reversed(range(T)):
    S_prev, Sp, S, u, pred = saved[t]
    dS = dS + scale * q[t][:, :, None] * do[t][:, None, :]
    grads["q"][t] = scale * np.einsum("hkv,hv->hk", S, do[t])
    du = np.einsum("hkv,hk->hv", dS, k[t])
    grads["k"][t] = np.einsum("hkv,hv->hk", dS, u)
    dSp = dS.copy()
    if beta is None:
      grads["v"][t] = du
    else:
      grads["v"][t] = beta[t][:, None] * du
      grads["beta"][t] = np.sum(du * (v[t] - pred), axis=-1)
      dpred = -beta[t][:, None] * du
      dSp = dSp + k[t][:, :, None] * dpred[:, None, :]
      grads["k"][t] += np.einsum("hkv,hv->hk", Sp, dpred)
    if g is not None:
      dgk = np.sum(dSp * Sp, axis=-1)  # d/dg of exp(g) * S_prev, per channel: [H, K]
      grads["g"][t] = dgk if g.ndim == 3 else dgk.sum(-1)
      dS = dSp * _decay(g[t])
    else:
      dS = dSp
  grads["h0"] = dS
  return o, hT, grads


def packed_forward_backward(q, k, v, g, beta, h0, scale, do, dhT, *, segment_ids=None,
                            cu_seqlens=None):
  """Batched / packed driver. `q: [B, T, H, K]` etc. Packing splits rows into independent sequences.

  segment_ids: each row's runs of equal id restart from zero, the first from `h0[b]`; the final state is
  the row's last run's. cu_seqlens (B == 1): sequence n starts from `h0[n]`, final state per sequence.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  o = np.zeros((B, T, H, V))
  grads = {name: np.zeros(x.shape) for name, x in
           (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)) if x is not None}
  grads["h0"] = np.zeros(h0.shape)
  final = np.zeros(h0.shape)
  pick = lambda x, b, sl: None if x is None else x[b, sl]
  if cu_seqlens is not None:
    runs = [(0, slice(cu_seqlens[n], cu_seqlens[n + 1]), n) for n in range(len(cu_seqlens) - 1)]
  else:
    runs = []
    for b in range(B):
      ids = np.zeros(T, int) if segment_ids is None else np.asarray(segment_ids[b])
      starts = [0] + [t for t in range(1, T) if ids[t] != ids[t - 1]] + [T]
      for i in range(len(starts) - 1):
        runs.append((b, slice(starts[i], starts[i + 1]), b if i == 0 else None))
  for b, sl, state_row in runs:
    last = cu_seqlens is not None or sl.stop == T
    init = h0[state_row] if state_row is not None else np.zeros(h0.shape[1:])
    if sl.stop == sl.start:
      final[state_row] = init
      if last:
        grads["h0"][state_row] += dhT[state_row]
      continue
    d_final = dhT[state_row if cu_seqlens is not None else b] if last else np.zeros(h0.shape[1:])
    o_r, hT, g_r = forward_backward(pick(q, b, sl), pick(k, b, sl), pick(v, b, sl), pick(g, b, sl),
                                    pick(beta, b, sl), init, scale, do[b, sl], d_final)
    o[b, sl] = o_r
    for name in grads:
      if name != "h0":
        grads[name][b, sl] = g_r[name]
    if state_row is not None:
      grads["h0"][state_row] += g_r["h0"]
    if last:
      final[state_row if cu_seqlens is not None else b] = hT
  return o, final, grads
