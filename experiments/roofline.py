"""The roofline floor of a benchmark row: its bytes at the measured copy bandwidth, or its FLOPs at the
measured matmul rate, whichever is longer; `experiments/benchmark.py` reports each time as a multiple of
it, with the ceilings measured in the same run.

The cost model (a floor, not any implementation's count):
- Bytes. Forward: every input read once, o written once. Forward + backward: the forward, then a
  backward that reads every input and the cotangent once and writes one gradient per input.
- FLOPs. The chunked form's products, per token and value head, chunk C, key width K, value width V:
  additive family `2CK + 2CV + 4KV` (q k^T and P v inside the chunk; q S and the state's k^T v update);
  the delta family adds `k k^T`, `(I + L)^-1 (beta k)`, `(I + L)^-1 (beta v)` and `W S`:
  `6CK + 4CV + 6KV` (the inversion, `~C^2 / 3` a token, is left out). The backward is counted as
  twice the forward's products (each product has two operand gradients), so forward + backward is 3x.
  Causal softmax attention: q k^T and P v, `4 B H T^2 K` (K = V) halved by the mask; its backward
  (flash form: five products to the forward's two) makes forward + backward 3.5x.
At (4, 8192, 16, 128) bf16 this gives Gated DeltaNet 0.54 GB and 94 GFLOP forward, as BENCHMARKS.md's
floor.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from experiments import common

FWD_BWD_FLOPS = 3.0      # forward + backward over forward, chunked linear attention
SOFTMAX_FWD_BWD_FLOPS = 3.5


def _nbytes(tree) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def op_cost(variant: str, shape, mode: str, inputs: dict, do, *, chunk_size: int = 64) -> tuple[float, float]:
  """`(bytes, flops)` of one call of `variant` (or "softmax") at `shape = (B, T, H, K)`, V = K and
  H_v = H as in benchmark.py; `inputs` the arrays it reads, `do` the cotangent of o (fwd_bwd;
  "fwd_bwd_state" also writes the final state and reads its cotangent)."""
  if mode not in ("fwd", "fwd_bwd", "fwd_bwd_state"):
    raise ValueError(f"mode must be 'fwd', 'fwd_bwd' or 'fwd_bwd_state'; got {mode!r}")
  B, T, H, K = shape
  V, C = K, chunk_size
  state_bytes = 2 * B * H * K * V * 4 if mode == "fwd_bwd_state" else 0
  mode = "fwd_bwd" if mode == "fwd_bwd_state" else mode
  in_bytes = _nbytes(inputs)
  o_bytes = B * T * H * V * jnp.dtype(inputs["v"].dtype).itemsize
  nbytes = in_bytes + o_bytes + state_bytes
  if mode == "fwd_bwd":
    nbytes += in_bytes + _nbytes(do) + in_bytes
  if variant == "softmax":
    flops = 2.0 * B * H * T * T * K
    return float(nbytes), flops * (SOFTMAX_FWD_BWD_FLOPS if mode == "fwd_bwd" else 1.0)
  per_token = (6 * C * K + 4 * C * V + 6 * K * V if variant in common.DELTA_VARIANTS
               else 2 * C * K + 2 * C * V + 4 * K * V)
  flops = float(B * T * H * per_token)
  return float(nbytes), flops * (FWD_BWD_FLOPS if mode == "fwd_bwd" else 1.0)


def measure_ceilings(*, copy_elements: int | None = None, matmul_n: int | None = None, warmup: int = 2,
                     iters: int = 10, warm_s: float | None = None) -> dict:
  """The device's copy bandwidth (bf16 `x + 1`: read + write, bytes/s) and bf16 matmul rate (FLOP/s),
  medians; sizes default to 2^28 elements and 8192^2 on a GPU, 2^22 and 512 elsewhere. warm_s: seconds
  of matmuls run first (default 1 on a GPU, 0 elsewhere), so the GPU leaves its idle clocks first.
  Each timed round issues 10 calls back to back (`common.median_ms`'s `calls`): a copy of 1 GB takes
  about 0.25 ms on an H200, and waiting for each call alone adds the host's dispatch to it."""
  on_gpu = jax.default_backend() == "gpu"
  copy_elements = copy_elements or (2**28 if on_gpu else 2**22)
  matmul_n = matmul_n or (8192 if on_gpu else 512)
  warm_s = (1.0 if on_gpu else 0.0) if warm_s is None else warm_s
  if copy_elements < 1 or matmul_n < 1:
    raise ValueError(f"copy_elements and matmul_n must be positive; got {copy_elements}, {matmul_n}")
  a = jnp.full((matmul_n, matmul_n), 0.5, jnp.bfloat16)
  mm = jax.jit(lambda a, b: a @ b)
  start = time.perf_counter()
  while True:
    jax.block_until_ready(mm(a, a))
    if time.perf_counter() - start >= warm_s:
      break
  x = jnp.ones((copy_elements,), jnp.bfloat16)
  copy_ms = common.median_ms(jax.jit(lambda x: x + 1), (x,), warmup=warmup, iters=iters, calls=10)
  matmul_ms = common.median_ms(mm, (a, a), warmup=warmup, iters=iters, calls=10)
  return {"bandwidth_bytes_per_s": 2 * copy_elements * 2 / (copy_ms * 1e-3),
          "matmul_flops_per_s": 2.0 * matmul_n**3 / (matmul_ms * 1e-3),
          "copy_elements": copy_elements, "matmul_n": matmul_n}


def floor_ms(nbytes: float, flops: float, ceilings: dict) -> float:
  """The longer of the bytes at the bandwidth and the FLOPs at the matmul rate, in ms."""
  return 1e3 * max(nbytes / ceilings["bandwidth_bytes_per_s"], flops / ceilings["matmul_flops_per_s"])
