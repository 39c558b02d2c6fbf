"""`impl="pallas"` and `impl="auto"` with the TPU kernels, run in the TPU interpreter
(`pallas_kernels.tpu.interpret_kernels`): every variant through the public ops against the recurrent
reference (o, final state, every gradient), and dispatch that says why a call is not served."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from linear_attention_jax import ops
from linear_attention_jax.ops import dispatch
from linear_attention_jax.pallas_kernels import tpu
from tests.ops.conftest import FAMILY, call, make_inputs, rel_rms

PARAMS = pltpu.InterpretParams(random_seed=3)
VARIANT_OPTIONS = {"linear_attention": {"feature_map": "elu_plus_one", "normalize": True},
                   "retention": {}, "simple_gla": {}, "gla": {}, "delta_rule": {"use_qk_l2norm": True},
                   "gated_delta_rule": {"use_qk_l2norm": True}, "kda": {"use_qk_l2norm": True}}


@functools.partial(jax.jit, static_argnames=("variant", "impl", "params", "packed"),
                   compiler_options={"xla_backend_optimization_level": 0})
def _run_with_grads(inp, do, dhT, seg, *, variant, impl, params, packed):
  names = [n for n in ("q", "k", "v", "g", "beta", "h0") if inp[n] is not None]

  def f(*xs):
    x = dict(inp, **dict(zip(names, xs)))
    return call(variant, x, impl=impl, chunk_size=16, output_final_state=True,
                segment_ids=seg if packed else None, **VARIANT_OPTIONS[variant])

  with tpu.interpret_kernels(params):  # traced inside: the kernels run in the TPU interpreter
    (o, hT), vjp = jax.vjp(f, *[inp[n] for n in names])
  return o, hT, dict(zip(names, vjp((do, dhT))))


@pytest.mark.parametrize("variant", ops.VARIANTS)
def test_every_variant_matches_the_recurrent_form(variant):
  # Given grouped heads, an initial state, packed rows and T = 70 (not a multiple of C = 16)
  inp = make_inputs(variant, B=2, T=70, H=1, Hv=2, K=8, V=6, seed=21)
  if variant == "linear_attention":  # the normaliser column z rides in the state: keep it positive
    inp["h0"] = np.concatenate([inp["h0"], np.abs(inp["h0"][..., :1])], axis=-1)
  seg = np.zeros((2, 70), np.int32)
  seg[0, 25:] = 1
  rng = np.random.default_rng(0)
  V_out = inp["v"].shape[-1]
  do = rng.normal(size=inp["v"].shape[:3] + (V_out,)).astype(np.float32)
  dhT = rng.normal(size=inp["h0"].shape).astype(np.float32)
  # When the same call runs with impl="pallas" and with the recurrent reference
  o, hT, grads = _run_with_grads(inp, do, dhT, jnp.asarray(seg), variant=variant, impl="pallas",
                                 params=PARAMS, packed=True)
  ro, rhT, rgrads = _run_with_grads(inp, do, dhT, jnp.asarray(seg), variant=variant,
                                    impl="recurrent", params=PARAMS, packed=True)
  # Then outputs, final state and every gradient agree
  errors = {"o": rel_rms(o, ro), "state": rel_rms(hT, rhT)}
  errors.update({f"d{n}": rel_rms(grads[n], rgrads[n]) for n in grads})
  print(variant, " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
  assert max(errors.values()) < 1e-5, errors


def _select(impl, **call):
  kw = dict(K=64, V=64, chunk_size=64, packing="none", dtype=jnp.float32)
  return ops.select_impl(impl, "kda", **dict(kw, **call))


def test_auto_uses_the_kernel_only_where_it_serves_the_call():
  # Off TPU: auto takes the chunked form and pallas says why not.
  assert _select("auto") == "chunk"
  with pytest.raises(ValueError, match=r"^impl='pallas' cannot serve kda: no Pallas kernel runs on "
                     r"backend 'cpu'.*; use impl='chunk' or impl='auto'$"):
    _select("pallas")
  # On a (interpreted) TPU: the kernel, unless the call is one it does not serve.
  with tpu.interpret_kernels(PARAMS):
    assert _select("auto") == _select("pallas") == "pallas"
    assert _select("auto", packing="segments", dtype=jnp.bfloat16) == "pallas"
    for unsupported, why in [({"packing": "cu_seqlens"}, "cu_seqlens"),
                             ({"chunk_size": 8}, "chunk_size >= 16"),
                             ({"dtype": jnp.float16}, "float16"),
                             ({"K": 2048, "V": 2048}, "VMEM")]:
      assert _select("auto", **unsupported) == "chunk", unsupported
      with pytest.raises(ValueError, match=why):
        _select("pallas", **unsupported)
    assert _select("recurrent") == "recurrent" and _select("chunk") == "chunk"


def _has_kernel(fn, *args):
  return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_auto_dispatch_reaches_the_kernel():
  inp = make_inputs("kda", B=1, T=20, H=1, Hv=1, rows=2)
  args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
  cu = jnp.array([0, 7, 20], jnp.int32)
  with tpu.interpret_kernels(PARAMS):
    assert _has_kernel(functools.partial(ops.kda, chunk_size=16), *args)
    assert not _has_kernel(functools.partial(ops.kda, chunk_size=16, impl="chunk"), *args)
    assert not _has_kernel(functools.partial(ops.kda, chunk_size=16, cu_seqlens=cu), *args)
    with pytest.raises(ValueError, match=r"cannot serve kda: the TPU kernel does not take cu_seqlens"):
      ops.kda(*args, chunk_size=16, cu_seqlens=cu, impl="pallas")
  assert not _has_kernel(functools.partial(ops.kda, chunk_size=16), *args)  # outside: chunked form


def test_auto_avoids_the_kernel_for_explicitly_sharded_inputs():
  # XLA cannot partition a pallas_call: operands split over an explicit mesh outside jax.shard_map
  # go to the chunked form (the kernels run per shard under linear_attention_jax.sharding.shard_op).
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  inp = make_inputs("kda", B=1, T=20, H=1, Hv=1)
  put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  args = [put(inp[n]) for n in ("q", "k", "v", "g", "beta")]
  with tpu.interpret_kernels(PARAMS):
    assert not _has_kernel(functools.partial(ops.kda, chunk_size=16), *args)
    with pytest.raises(ValueError, match=r"cannot serve kda: the inputs are sharded over mesh axes"):
      ops.kda(*args, chunk_size=16, impl="pallas")


def test_auto_on_a_cpu_takes_the_scan_forward_up_to_the_measured_bound():
  # The rule (README, "impl="auto" on a CPU"): the scan's forward up to CPU_SCAN_MAX_T tokens, else,
  # or with T unknown, the chunked form; only on a CPU.
  bound = dispatch.CPU_SCAN_MAX_T
  assert dispatch.cpu_scan_forward(1, "cpu") and dispatch.cpu_scan_forward(bound, "cpu")
  assert not dispatch.cpu_scan_forward(bound + 1, "cpu")
  assert not dispatch.cpu_scan_forward(None, "cpu")
  assert not dispatch.cpu_scan_forward(64, "gpu") and not dispatch.cpu_scan_forward(64, "tpu")
  assert _select("auto", T=64) == "recurrent" and _select("auto", T=bound + 1) == "chunk"
  assert _select("chunk", T=64) == "chunk" and _select("recurrent", T=bound + 1) == "recurrent"
  with tpu.interpret_kernels(PARAMS):  # a kernel that serves the call still comes first
    assert _select("auto", T=64) == "pallas"


def test_auto_on_a_cpu_runs_the_scan_forward_and_the_chunked_gradient():
  # Given a short call on the CPU
  inp = make_inputs("simple_gla", B=1, T=20, H=1, Hv=2)
  args = tuple(inp[n] for n in ("q", "k", "v", "g"))
  op = lambda impl: functools.partial(ops.simple_gla, chunk_size=8, impl=impl)
  jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})  # compiles fast
  loss = lambda impl: jit(jax.grad(lambda *a: jnp.sum(op(impl)(*a)[0] ** 2), argnums=(0, 1, 2, 3)))
  # When auto runs it, forward and differentiated
  # Then its output is the scan's, bit for bit, and its gradients the chunked form's
  np.testing.assert_array_equal(jit(op("auto"))(*args)[0], jit(op("recurrent"))(*args)[0])
  for got, want in zip(loss("auto")(*args), loss("chunk")(*args)):
    np.testing.assert_array_equal(got, want)
