"""`GpuConfig.call_test=False`: the per-channel stages whose kernels choose each chunk's form run them
without the call-wide `lax.cond` (whose test and branches cost device time and compiles).

- Exported for a Hopper GPU on this CPU, kda's fwd+bwd holds two XLA conditionals by default and none
  without the test (and fewer Mosaic GPU kernels: the one-reference kernels are not compiled). (gla
  keeps its backward's: its gradient kernel has no per-chunk form.)
- In the Mosaic GPU interpreter, on gates that every chunk fits one reference with (the default then
  runs the one-reference kernels), the per-chunk kernels give the same o, final state and gradients.
- The plan keeps the test for float16 operands (beyond the groups' bound they take the merge form
  per head), and the option must be a bool.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import (GpuConfig, channel, channel_delta_grads, channel_prep,
                                                    plan)
from tests.pallas_kernels.gpu.util import KERNELS, PARAMS

H200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu",
                                                           num_cores=132))
UNTESTED = dataclasses.replace(KERNELS, call_test=False)


def _export_kda(config: GpuConfig) -> str:
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  B, T, H, D = 1, 128, 1, 64
  args = (spec(B, T, H, D), spec(B, T, H, D), spec(B, T, H, D), spec(B, T, H, D, dtype=jnp.float32),
          spec(B, T, H, dtype=jnp.float32))

  def loss(q, k, v, g, beta):
    o, final = gpu.chunked_attention(q, k, v, g, beta, qk_l2norm=True, config=config)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

  with jax.sharding.use_abstract_mesh(H200):
    return jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))),
                             platforms=["cuda"])(*args).mlir_module()


def test_without_the_call_test_kda_holds_no_conditional():
  tested, untested = _export_kda(GpuConfig()), _export_kda(GpuConfig(call_test=False))
  conditionals = lambda text: len(re.findall(r"stablehlo\.(?:case|if)\b", text))
  kernels = lambda text: text.count("custom_call @mosaic_gpu")
  assert conditionals(tested) == 2, conditionals(tested)   # the forward's and the backward's
  assert conditionals(untested) == 0, conditionals(untested)
  assert kernels(untested) < kernels(tested), (kernels(untested), kernels(tested))


def test_per_chunk_kernels_without_the_test_equal_the_one_reference_kernels(monkeypatch):
  seen = []   # the grams each kernel was traced with
  for module, name in ((channel_prep, "prepare"), (channel_delta_grads, "key_side")):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: seen.append(
        (_n, kw.get("grams", "one"))) or _f(*a, **kw))
  r = np.random.default_rng(7)
  B, T, H, K = 1, 128, 1, 64
  q, k, v = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.bfloat16) for _ in range(3))
  g = jnp.asarray(r.uniform(-0.3, 0.0, (B, T, H, K)), jnp.float32)   # every chunk fits one reference
  beta = jnp.asarray(r.uniform(0.1, 1.0, (B, T, H)), jnp.float32)
  G = channel.chunk_cumsum(g, T, 64)[0]
  assert bool(channel.fits(G, 64, jnp.bfloat16))
  do = jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32)
  dhT = jnp.asarray(r.normal(size=(B, H, K, K)), jnp.float32)

  def run(config):
    f = lambda q, k, v, g, beta: gpu.chunked_attention(q, k, v, g, beta, qk_l2norm=True, config=config,
                                                       interpret=PARAMS)
    (o, hT), vjp = jax.vjp(f, q, k, v, g, beta)
    return (o, hT) + vjp((do.astype(o.dtype), dhT))

  want = run(KERNELS)
  traced, seen[:] = list(seen), []
  got = run(UNTESTED)
  # the default traced both branches of its tests; without the test only the per-chunk kernels run
  assert {("prepare", "one"), ("prepare", "chunk"), ("key_side", "one"), ("key_side", "chunk")} <= set(traced)
  assert set(seen) == {("prepare", "chunk"), ("key_side", "chunk")}, seen
  for name, a, b in zip("o final dq dk dv dg dbeta".split(), want, got):
    half = a.dtype == jnp.bfloat16
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(b).all(), name
    off = ~np.isclose(b, a, rtol=1e-6, atol=1e-6 * np.abs(a).max())
    # dk, dv: the final state's float32 last-chunk terms added to each kernel's bfloat16 output, whose
    # float32 sums differ in their last bits between the forms: rarely one bfloat16 step apart
    assert off.mean() <= (1e-3 if half and name in ("dk", "dv") else 0.0), (name, off.mean())
    assert np.all(np.abs(b - a)[off] <= 2.0 ** -7 * np.abs(a)[off]), name


def test_the_plan_keeps_the_test_for_float16_and_the_option_is_a_bool():
  select = lambda config, dtype: plan.select(delta=True, decay="channel", config=config, dtype=dtype,
                                             v_dtype=dtype)
  assert select(GpuConfig(), jnp.bfloat16).call_test
  assert not select(GpuConfig(call_test=False), jnp.bfloat16).call_test
  assert select(GpuConfig(call_test=False), jnp.float16).call_test
  with pytest.raises(ValueError, match="call_test"):
    GpuConfig(call_test=0)
