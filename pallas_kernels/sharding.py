"""A backend's `chunked_attention` under `jax.shard_map`: XLA cannot partition a Pallas kernel, so a
sharded call runs the kernels per shard.

Batch and heads shard with no communication (every (b, h) walks alone; q/k heads and value heads split
into the same number of contiguous groups, so grouped heads stay together), and so does the value
dimension V of v and of the state (the walk is independent per value column). K and T do not shard here:
q . S sums over K, and the walk over T is sequential (context parallelism exchanges per-shard affine
summaries; that lives with the sharding helpers of the library, not in the kernel).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P


def shard_chunked(chunked_attention, mesh, *, batch_axis=None, head_axis=None, value_axis=None,
                  check_vma: bool = True, **options):
  """Returns `f(q, k, v, g=None, beta=None, initial_state=None, segment_ids=None) -> (o, final_state)`
  that runs `chunked_attention(..., **options)` on each shard of `mesh`.

  Args:
    chunked_attention: a backend's op (`pallas_kernels.tpu.chunked_attention`, `...gpu...`).
    mesh: a `jax.sharding.Mesh` (or abstract mesh) holding the named axes.
    batch_axis, head_axis, value_axis: mesh axis names (or None) that shard B, the heads (H and H_v
      alike; both must divide by the axis size) and V.
    check_vma: passed to `jax.shard_map`; the kernels declare their outputs' varying axes, so True works.
    options: keywords of `chunked_attention` (scale, chunk_size, compute_dtype, interpret, ...).
  """
  b, h, vv = batch_axis, head_axis, value_axis

  def f(q, k, v, g=None, beta=None, initial_state=None, segment_ids=None):
    arrays = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
              "segment_ids": segment_ids}
    specs = {"q": P(b, None, h, None), "k": P(b, None, h, None), "v": P(b, None, h, vv),
             "g": None if g is None else (P(b, None, h) if g.ndim == 3 else P(b, None, h, None)),
             "beta": P(b, None, h), "initial_state": P(b, h, None, vv), "segment_ids": P(b, None)}
    names = [n for n, x in arrays.items() if x is not None]

    def local(*xs):
      kw = dict(zip(names, xs))
      return chunked_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw, **options)

    run = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs[n] for n in names),
                        out_specs=(P(b, None, h, vv), P(b, h, None, vv)), check_vma=check_vma)
    return run(*(arrays[n] for n in names))

  return f
