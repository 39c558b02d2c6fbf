"""The KDA layer (K = 128, bfloat16) fwd+bwd in the Mosaic GPU interpreter under the default kernels and
under key_warpgroups=2 / prep_warpgroups=2, each against the float32 XLA chunked form and against the
default; A_log = 0 and dt_bias raised to argv[2] on a fifth of the channels (strong gates). Run from the
repository root: `NPROC=6 python experiments/results/h200_v61/interpreter_layer_check.py 200 3`."""
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from linear_attention_jax import layers
from linear_attention_jax.pallas_kernels import gpu
from linear_attention_jax.pallas_kernels.gpu import GpuConfig
from linear_attention_jax.pallas_kernels.gpu.interpret import interpret_kernels
import sys
T = int(sys.argv[1]); scale_a = float(sys.argv[2])
layer = layers.KimiDeltaAttention(256, 2, head_dim=128, impl="pallas", dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
# stronger gates: raise A_log (decay rate) to make trained-like strong channels on some channels
st = nnx.state(layer)
print([p for p in jax.tree_util.tree_leaves_with_path(st) if 'A_log' in jax.tree_util.keystr(p[0])][:1])
ref_layer = layers.KimiDeltaAttention(256, 2, head_dim=128, impl="chunk", dtype=jnp.float32, rngs=nnx.Rngs(3))
def strengthen(l):
  l.A_log.value = jnp.zeros_like(l.A_log.value)
  db = np.array(l.dt_bias.value); idx = np.random.default_rng(1).permutation(db.size)[: db.size * 20 // 128]
  db[idx] = scale_a; l.dt_bias.value = jnp.asarray(db)
print("dt_bias", layer.dt_bias.value.shape)
x = jnp.asarray(np.random.default_rng(4).normal(size=(1, T, 256)), jnp.float32)
def loss(layer):
  y, _ = layer(x)
  return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.shape[-1], dtype=jnp.float32)))
strengthen(layer); strengthen(ref_layer)
runs = []
for config in (GpuConfig(), GpuConfig(key_warpgroups=2), GpuConfig(prep_warpgroups=2), None):
  if config is None:
    runs.append(jax.jit(nnx.value_and_grad(loss))(ref_layer)); continue   # float32 XLA chunked form
  with interpret_kernels(), gpu.default_config(config):
    runs.append(jax.jit(nnx.value_and_grad(loss))(layer))
rel = lambda a, b: float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))
for ref_name, (ref_l, ref_g) in (("f32 chunk", runs[-1]), ("default", runs[0])):
 print("against", ref_name)
 for name, (l, g) in zip(("default", "k", "f"), runs[:3]):
  leaves = zip(jax.tree_util.tree_leaves_with_path(nnx.state(g)), jax.tree.leaves(nnx.state(ref_g)))
  errs = {jax.tree_util.keystr(p): rel(np.asarray(a, np.float64), np.asarray(b, np.float64))
          for (p, a), b in leaves}
  print(name, float(l), float(ref_l), {k: f"{v:.1e}" for k, v in errs.items()})
