"""prep.py's per-channel decayed gram: the whole-tile `levels` form against the `merge` form, values and
gradients, at ordinary and extreme decay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import prep
from tests.ops.conftest import rel_rms


@pytest.mark.parametrize("strong", [False, True], ids=["normal", "g down to -20"])
@pytest.mark.parametrize("inclusive", [True, False])
def test_levels_gram_equals_the_merge_gram_with_gradients(strong, inclusive):
  r = np.random.default_rng(7)
  batch, C, K = (2, 3), 64, 16
  a, b = (jnp.asarray(r.normal(size=batch + (C, K)), jnp.float32) for _ in range(2))
  g = r.uniform(-20.0, 0.0, batch + (C, K)) if strong else np.log(1 / (1 + np.exp(-(r.normal(
      size=batch + (C, K)) + 2.0))))
  G = jnp.cumsum(jnp.asarray(g, jnp.float32), axis=-2)
  w = jnp.asarray(r.normal(size=batch + (C, C)), jnp.float32)

  def loss(method, a, b, G):
    M = prep.decayed_gram(a, b, G, inclusive=inclusive, dtype=jnp.float32, method=method)
    return jnp.sum(jnp.tril(M) * w), M

  (_, ref), ref_grads = jax.value_and_grad(lambda *x: loss("merge", *x), argnums=(0, 1, 2),
                                           has_aux=True)(a, b, G)
  (_, got), grads = jax.value_and_grad(lambda *x: loss("levels", *x), argnums=(0, 1, 2),
                                       has_aux=True)(a, b, G)
  assert bool(jnp.all(jnp.isfinite(got)))
  assert rel_rms(jnp.tril(got), jnp.tril(ref)) < 1e-5
  assert float(jnp.max(jnp.abs(jnp.triu(got, 1)))) == 0.0   # nothing above the diagonal
  for name, x, y in zip("a b G".split(), grads, ref_grads):
    assert bool(jnp.all(jnp.isfinite(x))), name
    assert rel_rms(x, y) < 1e-5, (name, rel_rms(x, y))


def test_decayed_gram_rejects_an_unknown_method():
  x = jnp.zeros((4, 2))
  with pytest.raises(ValueError, match="method"):
    prep.decayed_gram(x, x, x, inclusive=True, method="direct")
