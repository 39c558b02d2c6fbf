"""`joint_dense`: several projections of one input as one product, and Gated DeltaNet's gates taken that
way against the same layer with each projection its own product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention_jax import layers
from linear_attention_jax.layers import base, gated_delta_net


def _separate(x, projections, heads=1):
  """What `joint_dense` replaces: each layer its own product, grouped the same way."""
  return [p(x).reshape(*x.shape[:-1], heads, -1) for p in projections]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads", [1, 3])
def test_joint_dense_equals_each_projection_and_its_gradients(dtype, heads):
  # Given three projections of one input, one with a bias, widths that are multiples of `heads`
  rngs = nnx.Rngs(1)
  kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
  projections = (nnx.Linear(24, 6 * heads, **kw), nnx.Linear(24, heads, use_bias=True, **kw),
                 nnx.Linear(24, 2 * heads, **kw))
  projections[1].bias[...] = jax.random.normal(jax.random.key(2), (heads,))
  x = jax.random.normal(jax.random.key(3), (2, 7, 24), dtype)
  cot = [jax.random.normal(jax.random.key(4 + i), (2, 7, heads, n)) for i, n in enumerate((6, 1, 2))]

  def loss(fn, params, x):
    ps = [nnx.merge(g, p) for g, p in zip(graphs, params)]
    return sum(jnp.sum(y.astype(jnp.float32) * c) for y, c in zip(fn(x, ps), cot))

  graphs, params = zip(*(nnx.split(p) for p in projections))
  joint = lambda x, ps: base.joint_dense(x, ps, heads)
  separate = lambda x, ps: _separate(x, ps, heads)
  # When both forms run, and their gradients to every kernel, the bias and x are taken
  got, want = joint(x, projections), separate(x, projections)
  g_got = jax.grad(lambda p, x: loss(joint, p, x), argnums=(0, 1))(list(params), x)
  g_want = jax.grad(lambda p, x: loss(separate, p, x), argnums=(0, 1))(list(params), x)
  # Then each output has its projection's shape and dtype and equals it, as do the gradients
  tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  for a, b in zip(got, want):
    assert a.shape == b.shape and a.dtype == b.dtype == dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def test_joint_dense_refuses_layers_it_cannot_join():
  rngs = nnx.Rngs(0)
  x = jnp.ones((2, 3, 8))
  with pytest.raises(ValueError, match="multiple of heads=2"):
    base.joint_dense(x, (nnx.Linear(8, 4, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)), 2)
  with pytest.raises(ValueError, match=r"x's last axis \(8\)"):
    base.joint_dense(x, (nnx.Linear(8, 4, rngs=rngs), nnx.Linear(6, 4, rngs=rngs)))
  with pytest.raises(ValueError, match="share dtype"):
    base.joint_dense(x, (nnx.Linear(8, 4, rngs=rngs), nnx.Linear(8, 4, dtype=jnp.bfloat16, rngs=rngs)))


def test_gated_delta_net_with_joint_gates_equals_each_projection_alone(monkeypatch):
  # Given a Gated DeltaNet layer (grouped value heads, V != K) on the XLA chunked form, float32
  layer = layers.GatedDeltaNet(32, 2, num_v_heads=4, head_v_dim=12, impl="chunk", chunk_size=4,
                               rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(7), (2, 9, 32))
  cot = jax.random.normal(jax.random.key(8), (2, 9, 32))
  graph, params = nnx.split(layer)

  def run(p, x):
    return jnp.sum(nnx.merge(graph, p)(x)[0] * cot)

  # When it runs as built (a and b joined), then with each projection its own product
  got, g_got = jax.value_and_grad(run, argnums=(0, 1))(params, x)
  monkeypatch.setattr(gated_delta_net, "joint_dense", _separate)
  want, g_want = jax.value_and_grad(run, argnums=(0, 1))(params, x)
  # Then the output and every gradient (each projection's kernel, A_log, dt_bias, x) agree
  np.testing.assert_allclose(got, want, rtol=1e-5)
  flat_got, flat_want = jax.tree.leaves(g_got), jax.tree.leaves(g_want)
  assert len(flat_got) == len(flat_want) and len(flat_got) > 10
  for a, b in zip(flat_got, flat_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
