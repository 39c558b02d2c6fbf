"""Where the time of the Pallas GPU op goes: each stage of `pallas_kernels.gpu.chunked_attention` timed
alone (jitted, median of `--iters` after warm-up) on the benchmark's inputs.

Stages (pallas_kernels/gpu/NOTES.md): the whole op's forward and forward + backward (`jax.grad` of
`sum(o * do)` w.r.t. q, k, v, g, beta), prepared and fused (the forward's kernels: the additive family with no or
scalar decay without any XLA preparation; the delta family with no or scalar decay with its forward's
tensors from the preparation kernel; "-" for the others; each stage's `gpu.GpuConfig`, the plan's table
in pallas_kernels/gpu/plan.py), the delta family's fwd+bwd with its gradients from kernels (the
default) and without (XLA's vjp), the same as a training step
(`jax.value_and_grad`: `jax.grad` alone drops a forward whose outputs the backward does not read), the
delta family's preparation kernel (with `(I + L)^-1`) and per-chunk gradient kernel alone, the XLA
preparation forward and its vjp, the forward walk with outputs (and, when it is split into sequence
pieces, its pieces' maps walk alone), the forward walk
that stores states, the reverse walk, and the reverse walk plus the batched cotangent matmuls. With
`--jla`, jax-linear-attention's Mosaic GPU kernels are timed
on the same inputs in the same process (jla l2-normalises q and k of the delta variants itself). Prints a
table and writes `{workdir}/kernel_breakdown.json`. Meant for a Hopper GPU;
elsewhere `--interpret` runs the kernels in the Mosaic GPU interpreter (tiny shapes only: a smoke run).

Example:
  python experiments/kernel_breakdown.py --shape=4,8192,16,128 --variants=simple_gla,gated_delta_rule,kda
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np
from absl import app, flags

from experiments import benchmark, common
from linear_attention_jax.pallas_kernels import common as kernel_common
from linear_attention_jax.pallas_kernels import gpu, prep, vjp
from linear_attention_jax.pallas_kernels.gpu import channel_prep, delta_grads, delta_prep, fused, walk

STAGES = ("op fwd", "op fwd fused", "op fwd fused streamed", "op fwd+bwd",
          "op fwd+bwd fused", "op fwd+bwd delta_backward", "op value+grad fused",
          "op value+grad fused streamed",
          "op value+grad delta_backward", "delta prep kernel",
          "delta grads kernel", "op value+grad delta pair", "delta grads pair kernel",
          "delta grads kernel 2 blocks", "channel prep kernel", "op fwd channel kernel",
          "op fwd merge gram", "op fwd+bwd merge gram", "gram merge fwd+bwd", "gram auto fwd+bwd", "prep fwd", "walk o",
          "pieces maps", "walk states", "reverse walk", "reverse + cotangents", "prep vjp")


def _time(fn, args, iters: int, label: str = "") -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))  # compile
  compile_s = time.perf_counter() - start
  ms = common.median_ms(fn, args, warmup=1, iters=iters)
  if label:
    print(f"{label}: {ms:.3f} ms (first call {compile_s:.1f} s)", flush=True)
  return ms


def _gram_step(method):
  """The per-channel decayed gram of q and k and its gradient (XLA; `prep.decayed_gram`'s `method`)."""
  def loss(a, b, G):
    M = prep.decayed_gram(a, b, G, inclusive=True, dtype=jnp.bfloat16, method=method)
    return jnp.sum(M * 1e-3)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def breakdown(variant: str, shape, *, dtype, iters: int, interpret, seed: int = 0, jla_ops=None,
              only=None, sequence_pieces=None) -> dict:
  """`{stage: median ms}` for one variant at `shape = (B, T, H, D)`."""
  B, T, H, D = shape
  rng = np.random.default_rng(seed)
  x = common.make_inputs(variant, rng, B=B, T=T, H=H, K=D, V=D, dtype=dtype)
  k = x["k"].astype(jnp.float32)
  k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)  # as use_qk_l2norm would
  beta = x.get("beta")
  beta = None if beta is None else beta.astype(jnp.float32)
  args = (x["q"], k, x["v"], x.get("g"), beta)
  prepare = lambda *a: prep.prepare(*a, None, chunk_size=64, dtype=dtype, inverse_dtype=jnp.float32)
  prep_fwd = jax.jit(lambda *a: kernel_common.cast_tensors(prepare(*a), dtype))
  t = prep_fwd(*args)
  do = jnp.asarray(rng.standard_normal(t.u.shape), dtype)
  states_fn = jax.jit(lambda t: walk.forward(t, None, with_o=False, with_states=True, out_dtype=dtype,
                                             interpret=interpret)[1])
  states = states_fn(t)
  cot = jax.tree.map(lambda a: jnp.full(a.shape, 1e-2, jnp.float32), prepare(*args))
  do_o = jnp.asarray(rng.standard_normal(x["v"].shape), jnp.float32)
  def config(kernels, delta_backward=False, warpgroups=1, fwd_wg=1, **kw):
    """The stage's `gpu.GpuConfig`: `kernels=False` the prepared path (XLA's preparation and vjp around
    the walks); else the forward's kernels, with the delta family's gradients from kernels only with
    `delta_backward` (else XLA's vjp)."""
    if not kernels:
      base = gpu.GpuConfig(forward="xla_prep", backward="xla_vjp")
    else:
      base = gpu.GpuConfig(backward="kernel" if beta is None or delta_backward else "xla_vjp")
    return dataclasses.replace(base, sequence_pieces=sequence_pieces, delta_warpgroups=warpgroups,
                               forward_warpgroups=fwd_wg, **kw)

  forward = lambda *c, **kw: lambda *a: gpu.chunked_attention(*a, config=config(*c, **kw),
                                                              interpret=interpret)[0]
  op = lambda use_fused, fwd_wg=1: jax.jit(forward(use_fused, fwd_wg=fwd_wg))
  argnums = tuple(i for i, a in enumerate(args) if a is not None)
  op_grad = lambda use_fused, delta_backward=False: jax.jit(jax.grad(
      lambda *a: jnp.sum(forward(use_fused, delta_backward)(*a).astype(jnp.float32) * do_o),
      argnums=argnums))
  # value and gradients (a training step): the forward cannot be dropped as dead code, as it can
  # under jax.grad when the backward recomputes everything it needs
  op_value_grad = lambda use_fused, delta_backward=False, warpgroups=1, fwd_wg=1: jax.jit(
      jax.value_and_grad(lambda *a: jnp.sum(forward(use_fused, delta_backward, warpgroups, fwd_wg)(
          *a).astype(jnp.float32) * do_o), argnums=argnums))
  serves = fused.serves(args[3], beta, None) or delta_prep.serves(args[3], beta, None)
  delta_kernels = beta is not None and delta_prep.serves(args[3], beta, None)

  def grads_args():
    """`delta_grads.chunk_grads`'s inputs as the backward forms them (T a multiple of 64)."""
    t_k, X = jax.jit(lambda *a: delta_prep.prepare(*a, chunk_size=64, dtype=dtype, with_inverse=True,
                                                   interpret=interpret))(*args)
    st = states_fn(t_k)
    do_c = prep.to_chunks(do_o.astype(dtype), 64, T)
    dst, _ = jax.jit(lambda t, d: walk.backward_states(t, d, None, interpret=interpret))(t_k, do_c)
    G = fused.local_cumsum(args[3], B, T, H, 64)
    flat = lambda a: a.reshape(a.shape[:2] + (T, a.shape[-1]))
    return (args[0], args[1], args[2], G, jnp.swapaxes(beta, 1, 2), flat(X), st, dst, flat(do_c))
  per_channel = args[3] is not None and args[3].ndim == 4

  def gram_args():
    """prep.decayed_gram's inputs as prep.prepare forms them for q, k (chunks of 64, float32)."""
    chunks = lambda x: prep.to_chunks(x.astype(jnp.float32), 64, T)
    return chunks(args[0]), chunks(args[1]), jnp.cumsum(chunks(args[3]), axis=3)

  pieces = walk.pieces(B * H * max(D // walk.BLOCK_V, 1), t.qg.shape[2], sequence_pieces)
  stages = {
      "op fwd": (op(False), args),
      "op fwd fused": (op(True), args) if serves else None,
      "op fwd fused streamed": (op(True, 3), args) if fused.serves(args[3], beta, None) else None,
      "op fwd+bwd": (op_grad(False), args),
      "op fwd+bwd fused": (op_grad(True), args) if serves else None,
      "op fwd+bwd delta_backward": ((op_grad(True, True), args) if beta is not None
                                    and delta_prep.serves(args[3], beta, None) else None),
      "op value+grad fused": (op_value_grad(True), args) if serves else None,
      "op value+grad fused streamed": ((op_value_grad(True, fwd_wg=3), args)
                                       if fused.serves(args[3], beta, None) else None),
      "op value+grad delta_backward": ((op_value_grad(True, True), args) if beta is not None
                                       and delta_prep.serves(args[3], beta, None) else None),
      "delta prep kernel": (jax.jit(lambda *a: delta_prep.prepare(
          *a, chunk_size=64, dtype=dtype, with_inverse=True, interpret=interpret)), args)
                            if delta_kernels else None,
      "delta grads kernel": ((jax.jit(lambda *a: delta_grads.chunk_grads(
          *a, dtype=dtype, dv_dtype=dtype, partial_dtype=dtype, interpret=interpret)), grads_args)
                             if delta_kernels else None),
      "op value+grad delta pair": ((op_value_grad(True, True, 2), args) if delta_kernels
                                   and delta_grads.pair_serves(D, 64, dtype, dtype) else None),
      "delta grads pair kernel": ((jax.jit(lambda *a: delta_grads.chunk_grads_pair(
          *a, dtype=dtype, interpret=interpret)), grads_args)
                                  if delta_kernels and delta_grads.pair_serves(D, 64, dtype, dtype) else None),
      "delta grads kernel 2 blocks": ((jax.jit(lambda *a: delta_grads.chunk_grads(
          *a, dtype=dtype, dv_dtype=dtype, partial_dtype=dtype, interpret=interpret,
          blocks_per_program=2)), grads_args) if delta_kernels else None),
      "channel prep kernel": ((jax.jit(lambda *a: vjp.channel_tensors(
          *a, chunk_size=64, dtype=dtype, interpret=interpret)), args)
                              if channel_prep.serves(args[3], beta, None) else None),
      "op fwd channel kernel": ((jax.jit(forward(True, True)), args)
                                if channel_prep.serves(args[3], beta, None) else None),
      "op fwd merge gram": ((jax.jit(forward(True, True, gram_method="merge")), args)
                            if per_channel else None),
      "op fwd+bwd merge gram": ((jax.jit(jax.grad(lambda *a: jnp.sum(forward(
          True, True, gram_method="merge")(*a).astype(jnp.float32) * do_o), argnums=argnums)), args)
                                if per_channel else None),
      "gram merge fwd+bwd": (_gram_step("merge"), gram_args) if per_channel else None,
      "gram auto fwd+bwd": (_gram_step("auto"), gram_args) if per_channel else None,
      "prep fwd": (prep_fwd, args),
      "walk o": (jax.jit(lambda t: walk.forward(t, None, with_o=True, out_dtype=dtype,
                                                interpret=interpret)[0]), (t,)),
      "pieces maps": ((jax.jit(lambda t: walk.piece_maps(t, pieces, interpret=interpret)), (t,))
                      if pieces > 1 else None),
      "walk states": (states_fn, (t,)),
      "reverse walk": (jax.jit(lambda t, do: walk.backward_states(t, do, None, interpret=interpret)),
                       (t, do)),
      "reverse + cotangents": (jax.jit(lambda t, s, do: walk.backward(t, s, do, None,
                                                                      interpret=interpret)),
                               (t, states, do)),
      "prep vjp": (jax.jit(lambda *a: jax.vjp(prepare, *a[:5])[1](a[5])), args + (cot,)),
  }
  if jla_ops is not None:
    names = tuple(n for n in ("q", "k", "v", "g", "beta") if n in x)
    jla = lambda *a: benchmark._jla_forward(jla_ops, variant, dict(zip(names, a)), "mosaic_gpu", 64)
    jla_args = tuple(x[n] for n in names)
    stages["jla fwd"] = (jax.jit(jla), jla_args)
    stages["jla fwd+bwd"] = (jax.jit(jax.grad(
        lambda *a: jnp.sum(jla(*a).astype(jnp.float32) * do_o), argnums=tuple(range(len(names))))),
        jla_args)
  out = {}
  for name, stage in stages.items():
    if only and name not in only:
      continue
    try:
      stage_args = None if stage is None else (stage[1]() if callable(stage[1]) else stage[1])
      out[name] = None if stage is None else _time(stage[0], stage_args, iters, f"{variant}, {name}")
    except Exception as e:  # a stage that fails to compile or run is reported, not hidden
      print(f"{variant}: stage {name!r} failed: {type(e).__name__}: {str(e)[:2000]}")
      out[name] = float("nan")
  def check(name, label, fast, reference):
    """Records and prints the largest relative RMS difference over the leaves of two results."""
    try:
      err = max(float(jnp.sqrt(jnp.mean((x.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)
                               / (jnp.mean(y.astype(jnp.float32) ** 2) + 1e-30)))
                for x, y in zip(jax.tree.leaves(fast()), jax.tree.leaves(reference())))
      out[f"check {name} rel rms"] = err
      print(f"{variant}: check {name} ({label}): relative RMS {err:.2e}")
    except Exception as e:
      print(f"{variant}: {name} check failed: {type(e).__name__}: {str(e)[:2000]}")

  wanted = lambda flag: not only or flag in only
  # the fused path against the prepared one on these inputs
  if serves and wanted("fused check"):
    check("o", "fast path vs reference path", lambda: op(True)(*args), lambda: op(False)(*args))
    check("grads", "fast path vs reference path", lambda: op_grad(True)(*args), lambda: op_grad(False)(*args))
    if stages["op fwd+bwd delta_backward"] is not None:  # the gradient kernel against XLA's vjp
      check("delta_backward grads", "fast path vs reference path", lambda: op_grad(True, True)(*args),
            lambda: op_grad(True)(*args))
  # the two-warpgroup delta gradients against one warpgroup per value block
  if stages["op value+grad delta pair"] is not None and wanted("pair check"):
    check("pair", "two warpgroups vs one per block", lambda: op_value_grad(True, True, 2)(*args),
          lambda: op_value_grad(True, True, 1)(*args))
  # the fused additive forward in three warpgroups against one, value and gradients (other roundings)
  if stages["op value+grad fused streamed"] is not None and wanted("forward streamed check"):
    check("forward streamed", "3 warpgroups vs one", lambda: op_value_grad(True, fwd_wg=3)(*args),
          lambda: op_value_grad(True)(*args))
  # the per-channel preparation kernel's o against XLA's preparation
  if channel_prep.serves(args[3], beta, None) and wanted("channel check"):
    check("channel o", "channel kernel vs XLA's preparation", lambda: stages["op fwd channel kernel"][0](*args),
          lambda: op(False)(*args))
  return out


def _define_flags():
  flags.DEFINE_list("variants", ["simple_gla", "gated_delta_rule", "kda"], "Variants (ops.VARIANTS).")
  flags.DEFINE_list("shape", ["4", "8192", "16", "128"], "B,T,H,D (K = V = D).")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16"], "dtype of q, k, v.")
  flags.DEFINE_integer("iters", 10, "Timed rounds per stage; the median is reported.")
  flags.DEFINE_bool("interpret", False, "Run the kernels in the Mosaic GPU interpreter (any backend).")
  flags.DEFINE_bool("jla", False, "Also time jax-linear-attention's Mosaic GPU kernels (when installed).")
  flags.DEFINE_list("stages", [], "Only these stages (names as printed; 'fused check' for the fused "
                    "path's agreement with the prepared one, 'channel check' for the per-channel "
                    "kernel's, 'pair check' for the two-warpgroup delta gradients', 'forward streamed "
                    "check' for the three-warpgroup fused forward's); empty: all.")
  flags.DEFINE_integer("sequence_pieces", None, "The walks' sequence pieces (default: their own "
                       "choice, `pallas_kernels.gpu.walk.pieces`).")
  flags.DEFINE_string("workdir", "runs/kernel_breakdown", "Where kernel_breakdown.json is written.")


def main(argv):
  # the interpreter runs each warpgroup of a multi-warpgroup kernel on XLA's CPU pool (tests/conftest.py)
  os.environ["NPROC"] = str(max(6, int(os.environ.get("NPROC") or 0)))
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  common.check_variants(f.variants)
  if "linear_attention" in f.variants:
    raise app.UsageError("linear_attention carries a normaliser column; time retention instead")
  shape = tuple(int(s) for s in f.shape)
  if len(shape) != 4:
    raise app.UsageError(f"--shape must be B,T,H,D; got {f.shape}")
  dtype = jnp.bfloat16 if f.dtype == "bfloat16" else jnp.float16
  interpret = plgpu.InterpretGPUParams() if f.interpret else None
  jla_ops = None
  if f.jla:
    jla_ops, status = benchmark.import_jla()
    print(f"jla: {status}")
  rows = {v: breakdown(v, shape, dtype=dtype, iters=f.iters, interpret=interpret, jla_ops=jla_ops,
                      only=set(f.stages), sequence_pieces=f.sequence_pieces)
          for v in f.variants}
  stages = STAGES + (("jla fwd", "jla fwd+bwd") if jla_ops is not None else ())
  if f.stages:
    stages = tuple(s for s in stages if s in f.stages)
  print(f"{jax.devices()[0].device_kind}, shape {shape}, {f.dtype}, median ms of {f.iters}"
        + (" (Mosaic GPU interpreter)" if f.interpret else ""))
  print(common.format_table(("variant",) + stages,
                            [(v,) + tuple("-" if rows[v].get(s) is None else f"{rows[v][s]:.3f}"
                                          for s in stages) for v in rows]))
  for v in rows:
    for key in sorted(k for k in rows[v] if k not in stages):
      print(f"{v}: {key} {rows[v][key]:.2e}")
  path = common.write_json(f.workdir, "kernel_breakdown.json",
                           {"shape": shape, "dtype": f.dtype, "interpret": f.interpret, "ms": rows})
  print(f"wrote {path}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
