"""`once.lowered_once`: a kernel entry traced once per distinct call within a trace, its keyword-only
options static and its named array ones operands; `tiles.phase_trace`'s records in the key; and a model's
layers lowering each kernel once (the export of two layers holds one layer's Mosaic GPU calls)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention_jax import layers
from linear_attention_jax.pallas_kernels.gpu import once, tiles
from tests.pallas_kernels.gpu.test_lowering import H200, _spec


def _entry(traces):
  @once.lowered_once(arrays=("masks",))
  def entry(x, y, *, scale: float, masks=None, flip: bool = False):
    traces.append((scale, flip, masks is None))
    out = x * scale + y
    out = -out if flip else out
    return out if masks is None else out * masks
  return entry


def test_an_entry_traces_once_per_distinct_call_inside_a_trace():
  traces = []
  entry = _entry(traces)
  x, y = jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3))

  def model(x, y, m):
    a = entry(x, y, scale=2.0)
    b = entry(a, y, scale=2.0)               # same types and options: the first trace
    c = entry(b, y, scale=3.0)               # another option: a trace of its own
    d = entry(c, y, scale=3.0, masks=m)      # an array option is an operand, not a key
    e = entry(d, y, scale=3.0, masks=m + 1.0)
    return entry(e, y, scale=3.0, flip=True)

  m = jnp.full((2, 3), 0.5)
  out = jax.jit(model)(x, y, m)
  assert traces == [(2.0, False, True), (3.0, False, True), (3.0, False, False), (3.0, True, True)]
  a = x * 2 + y
  b = a * 2 + y
  c = b * 3 + y
  d = (c * 3 + y) * m
  e = (d * 3 + y) * (m + 1.0)
  np.testing.assert_allclose(out, -(e * 3 + y), rtol=1e-6)
  # and its gradient goes through
  grad = jax.grad(lambda x: jnp.sum(entry(x, y, scale=2.0, masks=m)))(x)
  np.testing.assert_allclose(grad, np.full((2, 3), 1.0), rtol=1e-6)


def test_the_phase_records_are_part_of_the_key(tmp_path):
  traces = []
  entry = _entry(traces)
  x = jnp.ones((2, 3))
  jax.jit(lambda x: entry(x, x, scale=1.0))(x)
  with tiles.phase_trace(str(tmp_path)):
    assert tiles.phases_key() == (str(tmp_path), 64)
    jax.jit(lambda x: entry(x, x, scale=1.0))(x)
  assert tiles.phases_key() is None
  assert len(traces) == 2


def test_lowered_once_names_only_its_parameters():
  with pytest.raises(ValueError, match="arrays names no parameter"):
    once.lowered_once(arrays=("mask",))(lambda x, *, masks=None: x)


def test_two_layers_lower_each_kernel_once_for_hopper(monkeypatch):
  # Gated DeltaNet layers exported for Hopper: two layers' fwd+bwd hold as many Mosaic GPU calls as
  # one layer's (the second layer calls the first one's lowered kernels); the kda op's forward and
  # backward share theirs too (the same preparation kernel where both run it)
  from linear_attention_jax.ops import dispatch
  from linear_attention_jax.pallas_kernels.gpu import conv, plan
  hopper = plan.hopper_reason
  monkeypatch.setattr(dispatch, "kernel_backend", lambda: "gpu")   # this CPU exports for a Hopper GPU
  monkeypatch.setattr(plan, "hopper_reason", lambda backend=None: hopper("hopper"))
  monkeypatch.setattr(conv, "hopper_reason", lambda backend=None: None)

  def calls(count):
    jax.clear_caches()
    stack = nnx.List([layers.GatedDeltaNet(256, 2, head_v_dim=128, impl="pallas", dtype=jnp.bfloat16,
                                           rngs=nnx.Rngs(i)) for i in range(count)])
    graphdef, params = nnx.split(stack)

    def loss(params, x):
      for layer in nnx.merge(graphdef, params):
        x = x + layer(x)[0]
      return jnp.sum(x.astype(jnp.float32) ** 2)

    with jax.sharding.use_abstract_mesh(H200):
      text = jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"])(
          params, _spec(2, 256, 256)).mlir_module()
    return text.count("custom_call @mosaic_gpu"), text.count("chunk_grads_delta_pair")

  one, two = calls(1), calls(2)
  assert one[0] >= 4 and two == one, (one, two)
