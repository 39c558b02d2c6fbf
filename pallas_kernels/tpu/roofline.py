"""Roofline of the TPU chunk walk (and of the XLA preparation around it) at published chip rates.

`python -m linear_attention_jax.pallas_kernels.tpu.roofline` prints the table kept in NOTES.md. Nothing here was measured:
no TPU was available. Times are `max(FLOPs / peak, bytes / HBM bandwidth)` per op, i.e. lower bounds
that assume perfect overlap of DMA and compute and ignore per-grid-step overhead.
"""

from __future__ import annotations

import math

from . import walk

# Published per-chip rates: bf16 peak FLOP/s, HBM bandwidth (bytes/s), HBM capacity (bytes). Google
# Cloud's "TPU v5e" / "TPU v6e" architecture pages give 197 TFLOP/s, 16 GB at 819 GB/s and 918 TFLOP/s,
# 32 GB at 1638 GB/s; jax's own chip table (jax/_src/tpu_info.py, 0.11.2) has 1.97e14, 8.2e11 B/s,
# 17.2e9 B and 9.2e14, 1.64e12 B/s, 34.4e9 B, i.e. 16 GiB and 32 GiB.
CHIPS = {
    "v5e": {"flops": 197e12, "hbm": 819e9, "capacity": 16 * 2**30},
    "v6e": {"flops": 918e12, "hbm": 1640e9, "capacity": 32 * 2**30},
}


def prep_cost(*, B, H, NC, C, K, V, itemsize, delta, gate, backward=False):
  """`(FLOPs, bytes)` of the XLA preparation, as if fused (a lower bound): reads q, k, v, g, beta,
  writes the per-chunk tensors; P and L are C x C grams (log2(C) of them for per-channel decay, see
  prep.decayed_gram) and the delta family inverts a unit-triangular C x C matrix (2 log2(C) C x C
  matmuls, prep.unit_lower_inverse) and applies it to V + K columns.
  backward: recomputation plus its vjp (~2x the FLOPs), reading the walk's float32 cotangents and
  writing the input gradients."""
  grams = (int(math.log2(C)) if gate == "channel" else 1) * (2 if delta else 1)
  log_c = int(math.log2(C))
  flops = grams * 2 * C * C * K + ((2 * log_c * 2 * C ** 3 + 2 * C * C * (V + K)) if delta else 0)
  g_bytes = {None: 0, "scalar": C * 4, "channel": C * K * 4}[gate]
  inputs = (2 * C * K + C * V) * itemsize + g_bytes + (C * 4 if delta else 0)
  tensors = ((3 if delta else 2) * C * K + C * V + C * C) * itemsize + K * 4
  if not backward:
    return B * H * NC * flops, B * H * NC * (inputs + tensors)
  grads32 = ((3 if delta else 2) * C * K + C * V + C * C + K) * 4
  return B * H * NC * 3 * flops, B * H * NC * (2 * inputs + grads32 + inputs)


def rows(*, B=8, T=4096, H=16, K=128, V=128, C=64, itemsize=2, block_sizes=None):
  """One row per (variant kind, pass) at the given shape; bf16 operands by default."""
  bs = walk.BlockSizes() if block_sizes is None else block_sizes
  NC = T // C
  out = []
  for name, delta, gate in (("simple_gla", False, "scalar"), ("gla", False, "channel"),
                            ("gated_delta_rule", True, "scalar"), ("kda", True, "channel")):
    fwd_nb, bwd_nb = bs.forward_steps(NC), bs.backward_steps(NC)
    vmem_f = walk.vmem_bytes(C=C, K=K, V=V, nb=fwd_nb, bv=bs.v_block(V), itemsize=itemsize, delta=delta,
                             backward=False)
    vmem_b = walk.vmem_bytes(C=C, K=K, V=V, nb=bwd_nb, bv=bs.v_block(V), itemsize=itemsize, delta=delta,
                             backward=True)
    common = dict(B=B, H=H, NC=NC, C=C, K=K, V=V, itemsize=itemsize, delta=delta)
    out.append((name, "walk fwd (kernel)", *walk.cost(**common, walk="forward", out_itemsize=itemsize),
                vmem_f))
    out.append((name, "walk bwd: states (kernel)", *walk.cost(**common, walk="states"), vmem_f))
    out.append((name, "walk bwd: reverse (kernel)", *walk.cost(**common, walk="backward"), vmem_b))
    out.append((name, "prep fwd (XLA, fused bound)", *prep_cost(**common, gate=gate), None))
    out.append((name, "prep bwd (XLA, fused bound)", *prep_cost(**common, gate=gate, backward=True),
                None))
    g_bytes = {"scalar": 4, "channel": K * 4}[gate]
    one_pass = B * H * T * ((2 * K + 2 * V) * itemsize + g_bytes + (4 if delta else 0))
    out.append((name, "reference: one fused pass (read q k v g beta, write o)", 0, one_pass, None))
  return out


def table(**shape) -> str:
  """The roofline as a markdown table."""
  head = ("| variant | pass | GFLOP | HBM MB | FLOP/byte | VMEM/step MiB | v5e µs | v6e µs | bound |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---|\n")
  lines, totals = [], {}
  for name, what, flops, bytes_, vmem in rows(**shape):
    times = {chip: max(flops / r["flops"], bytes_ / r["hbm"]) * 1e6 for chip, r in CHIPS.items()}
    bound = "/".join("HBM" if bytes_ / r["hbm"] > flops / r["flops"] else "MXU" for r in CHIPS.values())
    lines.append(f"| {name} | {what} | {flops / 1e9:.1f} | {bytes_ / 1e6:.0f} | {flops / bytes_:.0f} | "
                 f"{'-' if vmem is None else f'{vmem / 2**20:.1f}'} | {times['v5e']:.0f} | "
                 f"{times['v6e']:.0f} | {bound} |")
    if not what.startswith("reference"):
      tot = totals.setdefault(name, {"fwd": [0.0, 0.0], "fwd+bwd": [0.0, 0.0]})
      for key in ("fwd", "fwd+bwd") if "fwd" in what else ("fwd+bwd",):
        tot[key] = [tot[key][0] + times["v5e"], tot[key][1] + times["v6e"]]
  summary = ["", "| variant | v5e fwd µs | v5e fwd+bwd µs | v6e fwd µs | v6e fwd+bwd µs |",
             "|---|---:|---:|---:|---:|"]
  for name, tot in totals.items():
    summary.append(f"| {name} | {tot['fwd'][0]:.0f} | {tot['fwd+bwd'][0]:.0f} | {tot['fwd'][1]:.0f} | "
                   f"{tot['fwd+bwd'][1]:.0f} |")
  return head + "\n".join(lines + summary)


if __name__ == "__main__":
  print(table())
