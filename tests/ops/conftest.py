"""Shared fixtures and helpers for the op tests: inputs per variant and error measures."""

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention_jax import ops

# Variant -> (gate kind: None | "scalar" | "channel", has beta)
FAMILY = {
    "linear_attention": (None, False),
    "retention": (None, False),
    "simple_gla": ("scalar", False),
    "gla": ("channel", False),
    "delta_rule": (None, True),
    "gated_delta_rule": ("scalar", True),
    "kda": ("channel", True),
}


def rel_rms(a, b):
  """Relative RMS error of `a` against the reference `b`, in float64."""
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b ** 2), 1e-300)))


def make_inputs(variant, *, B=2, T=65, H=2, Hv=4, K=8, V=12, gates="normal", seed=0, rows=None):
  """Random inputs as float32 NumPy arrays: q, k (unit-norm keys for the delta family), v, g, beta, h0.

  gates: "normal" (log_sigmoid(N(0,1) + 2)), "strong" (uniform in [-20, 0]) or "zero" (g = 0).
  rows: leading size of h0 (B, or N for cu_seqlens).
  """
  rng = np.random.default_rng(seed)
  gate_kind, has_beta = FAMILY[variant]
  q = rng.normal(size=(B, T, H, K)).astype(np.float32)
  k = rng.normal(size=(B, T, H, K)).astype(np.float32)
  if has_beta:
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
  else:
    k *= 0.5
  v = rng.normal(size=(B, T, Hv, V)).astype(np.float32)
  g = None
  if gate_kind is not None:
    shape = (B, T, Hv) if gate_kind == "scalar" else (B, T, Hv, K)
    if gates == "normal":
      g = np.log(1 / (1 + np.exp(-(rng.normal(size=shape) + 2.0))))
    elif gates == "strong":
      g = rng.uniform(-20.0, 0.0, size=shape)
    else:
      g = np.zeros(shape)
    g = g.astype(np.float32)
  beta = (1 / (1 + np.exp(-rng.normal(size=(B, T, Hv))))).astype(np.float32) if has_beta else None
  h0 = rng.normal(size=(B if rows is None else rows, Hv, K, V)).astype(np.float32)
  return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)


def call(variant, inp, **kw):
  """Calls `ops.<variant>` with the arrays of `inp` (gates only where the variant takes them)."""
  fn = getattr(ops, variant)
  args = [inp["q"], inp["k"], inp["v"]]
  gate_kind, has_beta = FAMILY[variant]
  if gate_kind is not None:
    args.append(inp["g"])
  if has_beta:
    args.append(inp["beta"])
  return fn(*args, initial_state=inp.get("h0"), **kw)
