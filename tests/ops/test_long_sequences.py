"""No NaN or Inf for valid inputs at T = 65536: fp32, g in [-20, 0], beta in [0, 1], unit-norm keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.ops.conftest import call, make_inputs

T = 65536


@pytest.mark.parametrize("variant", ["gla", "kda", "gated_delta_rule", "linear_attention"])
def test_long_sequence_is_finite(variant):
  inp = make_inputs(variant, B=1, T=T, H=1, Hv=1, K=16, V=16, gates="strong", seed=21)
  if inp["g"] is not None:  # mix strong, mild and zero decay along the sequence
    inp["g"][:, T // 3: 2 * T // 3] *= 0.001
    inp["g"][:, 2 * T // 3:] = 0.0
  if variant == "linear_attention":
    inp["h0"] = np.abs(np.concatenate([inp["h0"], inp["h0"][..., :1]], -1))
  kw = {"use_qk_l2norm": True} if inp["beta"] is not None else {}

  @jax.jit
  def chunk_loss(q, k, v):
    o, hT = call(variant, dict(inp, q=q, k=k, v=v), impl="chunk", output_final_state=True, **kw)
    return jnp.sum(o) + jnp.sum(hT), (o, hT)

  (_, (o, hT)), grads = jax.value_and_grad(chunk_loss, argnums=(0, 1, 2), has_aux=True)(
      inp["q"], inp["k"], inp["v"])
  for x in (o, hT) + grads:
    assert bool(jnp.isfinite(x).all())
  o_ref, h_ref = jax.jit(lambda: call(variant, inp, impl="recurrent", output_final_state=True, **kw))()
  assert bool(jnp.isfinite(o_ref).all()) and bool(jnp.isfinite(h_ref).all())
  err = float(jnp.sqrt(jnp.mean((o - o_ref) ** 2) / jnp.mean(o_ref ** 2)))
  assert err < 1e-4, err
