"""Forward mode: `jax.jvp` and `jax.jacfwd` through every variant in the forms the CPU runs, equal to
reverse mode's Jacobian (the chunk form's triangular inverse has a JVP rule; reverse mode transposes it).
impl="pallas" (a custom_vjp over the kernels) is reverse mode only: its error is documented in README."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax import ops

B, T, H, K, V = 1, 8, 1, 4, 3


def call(variant, impl):
  ks = jax.random.split(jax.random.PRNGKey(1), 4)
  k = jax.random.normal(ks[1], (B, T, H, K))
  v = jax.random.normal(ks[2], (B, T, H, V))
  gs = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H, K)))
  beta = jnp.full((B, T, H), 0.5)
  extra = {"simple_gla": (gs[..., 0],), "gla": (gs,), "gated_delta_rule": (gs[..., 0], beta),
           "kda": (gs, beta), "delta_rule": (beta,)}.get(variant, ())
  fn = getattr(ops, variant)
  return lambda q: fn(q, k, v, *extra, impl=impl, chunk_size=4)[0], jax.random.normal(ks[0], (B, T, H, K))


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("variant", ops.VARIANTS)
def test_jacfwd_equals_jacrev(variant, impl):
  f, q = call(variant, impl)
  fwd, rev = jax.jacfwd(f)(q), jax.jacrev(f)(q)
  np.testing.assert_allclose(fwd, rev, rtol=1e-4, atol=1e-5)
  _, tangent = jax.jvp(f, (q,), (jnp.ones_like(q),))
  np.testing.assert_allclose(tangent, jnp.einsum("...abcd,abcd->...", rev, jnp.ones_like(q)),
                             rtol=1e-4, atol=1e-5)
