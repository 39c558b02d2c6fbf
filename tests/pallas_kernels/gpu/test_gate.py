"""KDA's gate inside the cumsum walks (`cumsum.gated_forward`, `cumsum.gated_reverse`; `ops.kda(...,
A_log=, dt_bias=)`) in the Mosaic GPU interpreter: the walks against XLA's gate and sums with its
autodiff (both kinds, float32 and bfloat16 pre-activations, ragged T, gates below the floor); the
whole op against the float64 loop and against the same op given the gate's values; the lowering for a
Hopper GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

from linear_attention_jax import ops
from linear_attention_jax.pallas_kernels import gate, gpu, prep
from linear_attention_jax.pallas_kernels.gpu import channel, cumsum
from tests.ops.conftest import rel_rms
from tests.ops.test_equivalence import _reference
from tests.pallas_kernels.gpu.util import BF16_TOL, PARAMS

C = 64


def _gate_inputs(B, T, Hv, K, dtype, seed, layer=False):
  """A = 1 and 16 (the ends of the layer's init), and a pre-activation of N(0, 3) with dt_bias N(0, 1):
  under the softplus gate a fifth of the tokens fall below the floor (-20); or with `layer`, f of
  N(0, 1) and the layer's dt_bias (softplus(dt_bias) = dt ~ logU(1e-3, 0.1))."""
  rng = np.random.default_rng(seed)
  f = jnp.asarray(rng.normal(0.0, 1.0 if layer else 3.0, (B, T, Hv, K)), dtype)
  A_log = jnp.log(jnp.asarray(np.resize([1.0, 16.0], Hv), jnp.float32))
  dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), Hv * K))
  return f, A_log, jnp.asarray(np.log(np.expm1(dt)) if layer else rng.normal(size=(Hv * K,)), jnp.float32)


@pytest.mark.parametrize("kind,dtype", [("softplus", "float32"), ("softplus", "bfloat16"),
                                        (-5.0, "bfloat16")])
def test_walks_match_xlas_gate_sums_and_autodiff(kind, dtype):
  B, T, Hv, K, T_pad = 1, 150, 2, 64, 3 * C
  f, A_log, dt_bias = _gate_inputs(B, T, Hv, K, dtype, 0)
  g = gate.values(f, A_log, dt_bias, kind)
  if kind == "softplus":
    assert float(jnp.mean(g < prep.LOG_DECAY_FLOOR)) > 0.05   # the floor's gradient is exercised
  G = gate.Gate(A_log, dt_bias, kind)
  for a, b in zip(channel.chunk_cumsum(f, T_pad, C, kernel=True, interpret=PARAMS, gate=G),
                  channel.chunk_cumsum(g, T_pad, C)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=3e-4)
  dG = jax.random.normal(jax.random.key(1), (B, T_pad, Hv, K))
  _, _, (df, dA_log, ddt_bias) = channel.key_grads(dG, dG, dG, f, f, f, C, kernel=True, interpret=PARAMS,
                                                   gate=G)

  def loss(f, A_log, dt_bias):
    return jnp.sum(channel.chunk_cumsum(gate.values(f, A_log, dt_bias, kind), T_pad, C)[0] * dG)

  want = jax.grad(loss, argnums=(0, 1, 2))(f, A_log, dt_bias)
  assert df.dtype == f.dtype and df.shape == f.shape
  for got, ref in zip((df, dA_log, ddt_bias), want):
    assert rel_rms(np.asarray(got, np.float32), np.asarray(ref, np.float32)) < 1e-5
  # XLA's path of key_grads (dG's sums by XLA's product) through the same gate
  xla = channel.key_grads(dG, dG, dG, f, f, f, C, gate=G)[2]
  for got, ref in zip(xla, want):
    assert rel_rms(np.asarray(got, np.float32), np.asarray(ref, np.float32)) < 1e-5


def test_the_op_takes_the_gate_into_its_kernels():
  B, T, H, Hv, K = 1, 100, 1, 2, 64
  f, A_log, dt_bias = _gate_inputs(B, T, Hv, K, jnp.bfloat16, 2, layer=True)
  ks = jax.random.split(jax.random.key(3), 6)
  unit = lambda x: (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(jnp.bfloat16)   # a contraction
  q, k = (unit(jax.random.normal(x, (B, T, H, K))) for x in ks[:2])
  v = jax.random.normal(ks[2], (B, T, Hv, K)).astype(jnp.bfloat16)
  beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, Hv)))
  h0 = jax.random.normal(ks[4], (B, Hv, K, K))
  do, dh = jax.random.normal(ks[5], (B, T, Hv, K)), jax.random.normal(ks[4], (B, Hv, K, K)) / 8

  def grads(given_values: bool):
    def op(q, k, v, f, beta, A_log, dt_bias, h0):
      if given_values:
        g = gate.values(f, A_log, dt_bias, "softplus")
        return ops.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl="pallas")
      return ops.kda(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                     output_final_state=True, impl="pallas")
    args = (q, k, v, f, beta, A_log, dt_bias, h0)
    (o, final), pull = jax.vjp(op, *args)
    return (o, final) + pull((do.astype(o.dtype), dh))

  with gpu.interpret_kernels(PARAMS):
    plan = gpu.call_plan(q, k, v, f, beta)
    assert gpu.fused_gate(plan, Hv * K, C)
    fused = jax.jit(lambda: grads(False))()
    by_values = jax.jit(lambda: grads(True))()
  names = ("o", "state", "dq", "dk", "dv", "df", "dbeta", "dA_log", "ddt_bias", "dh0")
  for name, a, b in zip(names, fused, by_values):   # the same kernels, g computed in the walk
    assert rel_rms(np.asarray(a, np.float32), np.asarray(b, np.float32)) < 2e-3, name
  # against the float64 loop under the layer's gates, its dg pulled back through XLA's gate (under the
  # strong gates above, df weighs the strongest tokens' small dg by A sigmoid(u) and shows the kernels'
  # bfloat16 dg there, with or without the gate in the walks)
  g = gate.values(f, A_log, dt_bias, "softplus")
  inp = {n: np.asarray(x, np.float32) for n, x in dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0).items()}
  ro, rfinal, rgrads = _reference("kda", inp, np.asarray(do), np.asarray(dh))
  rf = gate.vjp(f, A_log, dt_bias, "softplus", jnp.asarray(rgrads["g"], jnp.float32))[0]
  refs = dict(o=ro, state=rfinal, dq=rgrads["q"], dk=rgrads["k"], dv=rgrads["v"], df=rf,
              dbeta=rgrads["beta"], dh0=rgrads["h0"])
  for name, got in zip(names, fused):
    if name in refs:
      assert rel_rms(np.asarray(got, np.float32), np.asarray(refs[name], np.float32)) < BF16_TOL, name


def test_gated_walks_export_for_hopper():
  h200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu",
                                                             num_cores=132))
  S = jax.ShapeDtypeStruct
  f, vec, dG = S((2, 4096, 1024), jnp.bfloat16), S((1024,), jnp.float32), S((2, 4096, 1024), jnp.float32)
  with jax.sharding.use_abstract_mesh(h200):
    for kind in ("softplus", -5.0):
      fwd = jax.export.export(jax.jit(lambda x, a, b: cumsum.gated_forward(x, a, b, C=C, kind=kind, T=4000)),
                              platforms=["cuda"])(f, vec, vec).mlir_module()
      bwd = jax.export.export(jax.jit(lambda d, x, a, b: cumsum.gated_reverse(d, x, a, b, C=C, kind=kind,
                                                                               T=4000)),
                              platforms=["cuda"])(dG, f, vec, vec).mlir_module()
      assert "chunk_cumsum_gate_fwd" in fwd and "chunk_cumsum_gate_bwd" in bwd


def test_gate_arguments_are_checked():
  q = jnp.zeros((1, 8, 1, 64))
  v, f, beta = jnp.zeros((1, 8, 2, 64)), jnp.zeros((1, 8, 2, 64)), jnp.zeros((1, 8, 2))
  with pytest.raises(ValueError, match="A_log must be"):
    ops.kda(q, q, v, f, beta, A_log=jnp.zeros((3,)), dt_bias=jnp.zeros((128,)), impl="chunk")
  with pytest.raises(ValueError, match="dt_bias must be"):
    ops.kda(q, q, v, f, beta, A_log=jnp.zeros((2,)), dt_bias=jnp.zeros((2, 64)), impl="chunk")
  with pytest.raises(ValueError, match="gate_lower_bound"):
    ops.kda(q, q, v, f, beta, A_log=jnp.zeros((2,)), dt_bias=jnp.zeros((128,)), gate_lower_bound=-6.0,
            impl="chunk")
  with pytest.raises(ValueError, match="pass A_log and dt_bias"):
    ops.kda(q, q, v, f, beta, gate_lower_bound=-1.0, impl="chunk")
  with pytest.raises(ValueError, match="needs both"):
    ops.kda(q, q, v, f, beta, A_log=jnp.zeros((2,)), impl="chunk")


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
def test_xla_forms_take_the_gates_values(impl):
  B, T, H, Hv, K = 1, 20, 1, 2, 16
  f, A_log, dt_bias = _gate_inputs(B, T, Hv, K, jnp.float32, 4)
  ks = jax.random.split(jax.random.key(5), 4)
  q, k = (jax.random.normal(x, (B, T, H, K)) for x in ks[:2])
  v, beta = jax.random.normal(ks[2], (B, T, Hv, K)), jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, Hv)))
  for kind in (None, -2.0):
    by_gate = lambda f, A_log, dt_bias: ops.kda(q, k, v, f, beta, A_log=A_log, dt_bias=dt_bias,
                                                gate_lower_bound=kind, impl=impl)[0]
    by_values = lambda f, A_log, dt_bias: ops.kda(
        q, k, v, gate.values(f, A_log, dt_bias, "softplus" if kind is None else kind), beta, impl=impl)[0]
    np.testing.assert_allclose(by_gate(f, A_log, dt_bias), by_values(f, A_log, dt_bias), rtol=1e-6)
    loss = lambda op: lambda *x: jnp.sum(op(*x) ** 2)
    for a, b in zip(jax.grad(loss(by_gate), argnums=(0, 1, 2))(f, A_log, dt_bias),
                    jax.grad(loss(by_values), argnums=(0, 1, 2))(f, A_log, dt_bias)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_step_takes_the_gate_as_the_op_does():
  B, Hv, K = 2, 2, 16
  f, A_log, dt_bias = _gate_inputs(B, 1, Hv, K, jnp.float32, 6)
  ks = jax.random.split(jax.random.key(7), 3)
  q, k = (jax.random.normal(x, (B, 1, K)) for x in ks[:2])
  v, beta = jax.random.normal(ks[2], (B, Hv, K)), jnp.full((B, Hv), 0.5)
  for kind in (None, -3.0):
    g = gate.values(f, A_log, dt_bias, "softplus" if kind is None else kind)[:, 0]
    by_gate = ops.kda_step(q, k, v, f[:, 0], beta, A_log=A_log, dt_bias=dt_bias, gate_lower_bound=kind)
    for a, b in zip(by_gate, ops.kda_step(q, k, v, g, beta)):
      np.testing.assert_allclose(a, b, rtol=1e-6)
