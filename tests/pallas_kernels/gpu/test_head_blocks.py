"""Head dims of 256 on the GPU kernels (`plan.head_blocks`): value blocks side by side in both families,
key blocks summed in the additive family, in the Mosaic GPU interpreter against the float64 loop (o, the
final state and every gradient, initial state included) and through the public ops."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import plan
from tests.ops.conftest import make_inputs, rel_rms
from tests.pallas_kernels.gpu.util import KERNELS, PARAMS, check, packed_runs


def test_head_blocks_and_what_the_kernels_take():
  assert plan.head_blocks(128, 256) == (128, 128)
  assert plan.head_blocks(256, 64) == (128, 64)
  assert plan.head_blocks(64, 128) == (64, 128)
  # the delta family without per-channel decay walks V = 256 in one program per value block and chunk,
  # the key side once per chunk (the preparation's u in two blocks, the gradients' pairs of blocks)
  assert plan.head_blocks(128, 256, delta=True, decay="scalar") == (128, 256)
  assert plan.head_blocks(64, 256, delta=True) == (64, 256)
  assert plan.head_blocks(128, 256, delta=True, decay="channel") == (128, 128)
  for K, V in [(64, 256), (128, 256), (256, 256), (256, 64)]:
    assert gpu.supports(K=K, V=V, chunk_size=64, backend="hopper") is None, (K, V)
  for K, V in [(64, 256), (128, 256)]:
    assert gpu.supports(K=K, V=V, chunk_size=64, backend="hopper", delta=True) is None, (K, V)
  reason = gpu.supports(K=256, V=128, chunk_size=64, backend="hopper", delta=True)
  assert "does not split" in reason and "K=256" in reason
  assert "K and V in (64, 128, 256)" in gpu.supports(K=128, V=512, chunk_size=64, backend="hopper")


@pytest.mark.parametrize("warpgroups", [1, 2])
def test_value_blocks_of_the_delta_family(warpgroups):
  # V = 256 in one call: the preparation forms u in two blocks of 128 columns, the walks take four
  # blocks of 64, the gradients one program per block (partial sums added outside) or, the default, one
  # per pair of blocks; packed runs, an initial state
  inp = make_inputs("gated_delta_rule", B=1, T=120 + warpgroups, H=1, Hv=2, K=64, V=256, seed=41)
  config = dataclasses.replace(KERNELS, delta_warpgroups=warpgroups)
  assert gpu.call_plan(*(jnp.zeros(inp[n].shape, jnp.float16) for n in "qkv"), jnp.asarray(inp["g"]),
                       jnp.asarray(inp["beta"]), config=config).grads_warpgroups == warpgroups
  check("gated_delta_rule", inp, seg=packed_runs(120 + warpgroups), config=config)


@pytest.mark.parametrize("packed", [False, True])
def test_the_late_value_block_changes_no_bit(packed):
  # V = 256 at K = 128: the preparation loads the second value block into q's tile once qg is out (one
  # resident v tile: two programs a multiprocessor). Every tensor equals, bit for bit, those of two
  # calls of V = 128 (each value block alone), u block by block; packed runs, l2 on load
  from linear_attention_jax.pallas_kernels.gpu import delta_prep
  from linear_attention_jax.pallas_kernels.gpu.tiles import SMEM_BYTES
  assert delta_prep.smem_bytes(128, 256) == delta_prep.smem_bytes(128, 128) + 8   # + the late block's barrier
  assert 2 * delta_prep.smem_bytes(128, 256) <= SMEM_BYTES
  B, T, H, K = 1, 128, 1, 128
  r = np.random.default_rng(44)
  bf = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.bfloat16)
  q, k, v = bf(B, T, H, K), bf(B, T, H, K), bf(B, T, H, 256)
  g = jnp.asarray(-r.uniform(0, 0.3, (B, T, H)), jnp.float32)
  beta = jnp.asarray(r.uniform(0, 1, (B, T, H)), jnp.float32)
  seg = jnp.asarray(packed_runs(T)) if packed else None
  run = lambda v: delta_prep.prepare(q, k, v, g, beta, chunk_size=64, dtype=jnp.bfloat16, segment_ids=seg,
                                     interpret=PARAMS, with_inverse=True, qk_l2norm=True)
  (t, X), halves = run(v), [run(v[..., :128]), run(v[..., 128:])]
  for (h, Xh) in halves:
    np.testing.assert_array_equal(np.asarray(X), np.asarray(Xh))
    for name in ("qg", "kd", "w", "p", "decay"):
      np.testing.assert_array_equal(np.asarray(getattr(t, name)), np.asarray(getattr(h, name)), name)
  u = np.asarray(t.u)
  assert np.isfinite(u.astype(np.float32)).all()
  np.testing.assert_array_equal(u[..., :128], np.asarray(halves[0][0].u))
  np.testing.assert_array_equal(u[..., 128:], np.asarray(halves[1][0].u))


def test_key_blocks_of_the_additive_family():
  # K = 256 = two calls whose read-outs add and whose states stack; gla's per-channel gates split with
  # the keys (linear attention's key blocks, without gates, are in the test below)
  inp = make_inputs("gla", B=1, T=70, H=1, Hv=2, K=256, V=64, seed=42)
  check("gla", inp)


def test_public_ops_reach_the_blocks():
  # linear attention's normaliser rides as column 65: the kernels walk two key blocks of 128, XLA the
  # appended column; Gated DeltaNet's paper default V = 2K (here 2 x 64) with l2-normalised q, k
  from linear_attention_jax import ops
  rng = np.random.default_rng(43)
  x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float16)
  do = lambda s: jnp.asarray(rng.normal(size=s), jnp.float16)
  cases = [
      ("linear_attention", (x(1, 70, 1, 256), 0.5 * x(1, 70, 1, 256), x(1, 70, 1, 64)), {}),
      ("gated_delta_rule", (x(1, 70, 1, 64), x(1, 70, 1, 64), x(1, 70, 2, 256),
                            jnp.asarray(-rng.uniform(0, 1, (1, 70, 2)), jnp.float32),
                            jnp.asarray(rng.uniform(0, 1, (1, 70, 2)), jnp.float32)),
       dict(use_qk_l2norm=True)),
  ]
  for variant, args, kw in cases:
    fn = getattr(ops, variant)
    cot = do(args[2].shape)

    def run(impl):
      o, pull = jax.vjp(lambda *a: fn(*a, impl=impl, **kw)[0], *args)
      return o, pull(cot)

    with gpu.interpret_kernels():
      assert ops.select_impl("auto", variant, K=args[0].shape[-1], V=args[2].shape[-1] + (
          variant == "linear_attention"), chunk_size=64, dtype=jnp.float16, v_extra=int(
              variant == "linear_attention"), delta=variant != "linear_attention") == "pallas"
      o, grads = run("pallas")
    ro, rgrads = run("recurrent")
    assert rel_rms(o, ro) < 4e-3, (variant, rel_rms(o, ro))
    for i, (a, b) in enumerate(zip(grads, rgrads)):
      assert rel_rms(a, b) < 6e-3, (variant, i, rel_rms(a, b))


def test_value_blocks_with_per_channel_gates():
  # KDA at V = 2K: the per-channel gates and betas repeat over the value heads the blocks become, and
  # their gradients add back over them
  inp = make_inputs("kda", B=1, T=70, H=1, Hv=1, K=64, V=256, seed=44)
  check("kda", inp, config=KERNELS)
