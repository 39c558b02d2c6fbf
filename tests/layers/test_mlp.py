"""SwiGLU with its gate and up projections as one product against the two apart: the same output and
every gradient (float32 tightly, bfloat16 to its rounding), one product where there were two; and apart
where the tensor rules split the hidden width over devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh, AxisType

from linear_attention_jax.layers import SwiGLU
from linear_attention_jax.sharding import use_rules
from tests.layers.util import all_eqns, rel_rms


def _products(mlp, x):
  """The forward's dot_generals by output width."""
  jaxpr = jax.make_jaxpr(lambda x: mlp(x))(x).jaxpr
  return sorted(e.outvars[0].aval.shape[-1] for e in all_eqns(jaxpr) if e.primitive.name == "dot_general")


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_swiglu_joined_equals_apart(dtype, tol):
  # Given a SwiGLU of awkward widths (hidden 96 is no power of two) and bfloat16 or float32 activations
  mlp = SwiGLU(40, 96, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (3, 7, 40), jnp.float32)

  def loss(model, x):
    return jnp.sum(jnp.sin(model(x).astype(jnp.float32)))

  # When it runs joined and then apart
  assert _products(mlp, x) == [40, 192]
  joined = nnx.value_and_grad(loss, argnums=(0, 1))(mlp, x)
  mlp.join = False
  assert _products(mlp, x) == [40, 96, 96]
  apart = nnx.value_and_grad(loss, argnums=(0, 1))(mlp, x)
  # Then the loss, x's gradient and each kernel's agree (bfloat16: one rounding of a sum in another order)
  np.testing.assert_allclose(joined[0], apart[0], rtol=tol)
  leaves = jax.tree_util.tree_leaves_with_path(joined[1])
  assert len(leaves) == len(jax.tree.leaves(apart[1])) == 4
  for (path, a), b in zip(leaves, jax.tree.leaves(apart[1])):
    err = rel_rms(a, b)
    assert err < tol, (jax.tree_util.keystr(path), err)


def test_swiglu_stays_apart_where_the_hidden_width_is_split():
  mlp = SwiGLU(32, 64, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  x = jnp.ones((2, 4, 32))
  device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  # rows over "data" keep the join; the mlp axis over "tensor" would interleave the devices' columns
  for sizes, widths in (((2, 1), [32, 128]), ((1, 2), [32, 64, 64])):
    mesh = AbstractMesh(sizes, ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, abstract_device=device)
    with use_rules(mesh, "tp"):
      assert _products(mlp, x) == widths, sizes
