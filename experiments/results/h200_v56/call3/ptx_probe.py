"""Compiles kda fwd+bwd (Mosaic GPU, strong gates: the per-chunk kernels) at a small shape, for
MOSAIC_GPU_DUMP_PTXAS=1's register and spill report. Run from a tree's root."""
import sys, os
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
from linear_attention_jax import ops
r = np.random.default_rng(0)
B, T, H, K, V = 1, 256, 1, 128, 128
q, k, v = (jnp.asarray(r.normal(size=(B, T, H, d)), jnp.bfloat16) for d in (K, K, V))
g = jnp.asarray(r.uniform(-20, 0, (B, T, H, K)), jnp.float32)
beta = jnp.asarray(r.uniform(0.1, 1, (B, T, H)), jnp.float32)
f = lambda q, k, v, g, beta: ops.kda(q, k, v, g, beta, impl="pallas", use_qk_l2norm=True)[0].astype(jnp.float32).sum()
out = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)
print("grads finite:", all(bool(jnp.isfinite(x).all()) for x in out))
