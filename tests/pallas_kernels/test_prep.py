"""prep.py's per-channel decayed gram: the one-reference `auto` form against the `merge` form and a float64 sum, values and gradients, at ordinary, bounded-strong and extreme
decay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import prep
from tests.ops.conftest import rel_rms


@pytest.mark.parametrize("method", ["auto"])
@pytest.mark.parametrize("strong", [False, True], ids=["normal", "g down to -20"])
@pytest.mark.parametrize("inclusive", [True, False])
def test_gram_methods_equal_the_merge_gram_with_gradients(method, strong, inclusive):
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
  # "auto" takes the one-reference form at normal decay and the merge form at g down to -20
  assert bool(prep.one_reference_fits(G)) == (not strong)
  (_, got), grads = jax.value_and_grad(lambda *x: loss(method, *x), argnums=(0, 1, 2),
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


def _direct_gram(a, b, G, inclusive):
  """float64 `sum_c a_ic b_jc e^(G_ic - G_jc)` on and below the diagonal."""
  a, b, G = (np.asarray(x, np.float64) for x in (a, b, G))
  M = np.zeros(a.shape[:-1] + (a.shape[-2],))
  C = a.shape[-2]
  for i in range(C):
    for j in range(i + 1 if inclusive else i):
      M[..., i, j] = np.sum(a[..., i, :] * b[..., j, :] * np.exp(G[..., i, :] - G[..., j, :]), axis=-1)
  return M


@pytest.mark.parametrize("inclusive", [True, False])
def test_one_reference_gram_at_the_edge_of_its_bound(inclusive):
  # g = -1.85 a token on half the channels: a 64-token chunk spans 116.6 nats there (< 2 * REF_BOUND),
  # so factors up to e^58 and e^-58 meet; the result must still be the float64 sum, gradients finite
  r = np.random.default_rng(3)
  C, K = 64, 16
  a, b = (jnp.asarray(r.normal(size=(2, C, K)), jnp.float32) for _ in range(2))
  g = np.where(np.arange(K) % 2 == 0, -1.85, -0.01) * np.ones((2, C, K))
  G = jnp.cumsum(jnp.asarray(g, jnp.float32), axis=-2)
  assert bool(prep.one_reference_fits(G))
  M = prep.decayed_gram(a, b, G, inclusive=inclusive, dtype=jnp.float32, method="auto")
  assert rel_rms(M, _direct_gram(a, b, G, inclusive)) < 1e-5
  grads = jax.grad(lambda a, b, G: jnp.sum(prep.decayed_gram(a, b, G, inclusive=inclusive,
                                                             dtype=jnp.float32) ** 2),
                   argnums=(0, 1, 2))(a, b, G)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in grads)
  # one more nat and the call is the merge form's
  span = float(jnp.max(G[:, 0] - G[:, -1]))
  assert 2 * prep.REF_BOUND - 4 < span <= 2 * prep.REF_BOUND
  assert not bool(prep.one_reference_fits(G * (2 * prep.REF_BOUND + 1) / span))


def test_auto_gram_under_vmap_runs_both_forms_without_nan():
  # under vmap the cond becomes a select: the one-reference branch then sees the strong rows too (its
  # exponents clamped), and neither it nor its gradient may leak inf or NaN into the merge form's rows
  r = np.random.default_rng(5)
  C, K = 16, 8   # a short chunk: the merge form's levels compile faster
  a, b = (jnp.asarray(r.normal(size=(2, C, K)), jnp.float32) for _ in range(2))
  g = np.stack([r.uniform(-20.0, 0.0, (C, K)), r.uniform(-0.1, 0.0, (C, K))])   # 16 x -20 > 120
  G = jnp.cumsum(jnp.asarray(g, jnp.float32), axis=-2)
  f = lambda method: lambda a, b, G: jnp.sum(prep.decayed_gram(a, b, G, inclusive=True,
                                                               dtype=jnp.float32, method=method) ** 2)
  got = jax.vmap(jax.value_and_grad(f("auto"), argnums=(0, 1, 2)))(a, b, G)
  ref = jax.vmap(jax.value_and_grad(f("merge"), argnums=(0, 1, 2)))(a, b, G)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert bool(jnp.all(jnp.isfinite(x)))
    assert rel_rms(x, y) < 1e-5
