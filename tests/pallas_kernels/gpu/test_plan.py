"""The GPU kernels' plan (`pallas_kernels/gpu/plan.py`) against its own table, cell by cell: every variant,
decay kind, packing and configuration, differentiated or not, within and beyond the per-channel
one-reference bound (beyond it: the same kernels choosing each chunk's form, or with the 8-token
groups' products on every chunk).

The table in plan.py's docstring is parsed and `plan.select` must give each row; then every cell's call
is traced (no kernel runs: tracing only, on any machine) with a spy on every stage function, and the
stages the trace reaches must be exactly those the plan names (a per-channel `lax.cond` traces both of
its branches: the one-reference grams' kernels and the groups')."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention_jax.pallas_kernels import prepared, vjp
from linear_attention_jax.pallas_kernels.gpu import (GpuConfig, call_plan, channel, channel_delta_grads, channel_grads,
                                channel_prep, chunked_attention, delta_grads, delta_prep, fused, plan, walk)

ONE_WARPGROUP = dict(forward_warpgroups=1, delta_warpgroups=1)


def _table():
  """plan.py's table: {(variant, forward, backward): row from plan.forward on}."""
  rows = {}
  for line in plan.__doc__.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 9 or cells[0] == "variants" or set(cells[0]) <= {"-", " "}:
      continue
    for variant in cells[0].split(", "):
      key = (variant, cells[1], cells[2])
      assert key not in rows, f"{key} twice in plan.py's table"
      rows[key] = tuple(cells[3:])
  return rows


TABLE = _table()


def test_the_table_covers_every_variant_and_configuration():
  assert {v for v, _, _ in TABLE} == set(plan.VARIANTS)
  for variant, (delta, decay) in plan.VARIANTS.items():
    for forward in plan.FORWARDS:
      for backward in plan.BACKWARDS:
        config = GpuConfig(forward=forward, backward=backward)
        if (variant, forward, backward) not in TABLE:
          # the one configuration no kernel pair serves: kda's gradient kernels read its
          # preparation kernel's inverse
          assert (variant, forward, backward) == ("kda", "xla_prep", "kernel")
          with pytest.raises(ValueError, match="inverse"):
            plan.select(delta=delta, decay=decay, config=config)
          continue
        for packing in ("none", "segments"):
          got = plan.select(delta=delta, decay=decay, config=config, packing=packing).row()
          assert got == TABLE[variant, forward, backward], (variant, forward, backward, packing)
  with pytest.raises(ValueError, match="segment_ids"):
    plan.select(delta=True, decay="scalar", config=GpuConfig(), packing="cu_seqlens")


def test_config_is_validated():
  for field, bad in (("forward", "fused"), ("backward", "kernels"), ("forward_warpgroups", 2),
                     ("delta_warpgroups", 3), ("gram_method", "direct"),
                     ("sequence_pieces", 0), ("grads_programs", 0), ("grads_programs", True)):
    with pytest.raises(ValueError, match=f"GpuConfig.{field}"):
      GpuConfig(**{field: bad})
  x = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="config must be"):
    chunked_attention(x, x, x, config={"forward": "kernel"})


def test_the_plan_says_where_the_warpgroups_and_the_l2_norm_go():
  kernels = GpuConfig()
  p = plan.select(delta=True, decay="scalar", config=kernels, V=128, v_dtype=jnp.bfloat16)
  assert p.grads_warpgroups == 2 and p.l2 == "on_load"
  assert p.interpreter_threads() == {"delta_warpgroups=2": 3}
  assert plan.select(delta=True, decay="scalar", config=kernels, V=64).grads_warpgroups == 1
  assert plan.select(delta=True, decay="scalar", config=kernels, qk_l2norm=False).l2 == "none"
  # kda's kernels normalise on load and floor g themselves, except beside float16's per-head merge form
  kda = lambda dtype=jnp.bfloat16, **c: plan.select(delta=True, decay="channel", dtype=dtype,
                                                    config=GpuConfig(**c))
  assert (kda().l2, kda().gate_floor) == ("on_load", "stages")
  assert (kda(jnp.float16).l2, kda(jnp.float16).gate_floor) == ("xla", "xla")
  assert (kda(backward="xla_vjp").l2, kda(backward="xla_vjp").gate_floor) == ("xla", "xla")
  gla = plan.select(delta=False, decay="channel", config=kernels, qk_l2norm=False)
  assert (gla.l2, gla.gate_floor) == ("none", "stages")
  assert plan.select(delta=True, decay="scalar", config=kernels).gate_floor == "xla"
  # dG's reverse cumsum: XLA's unless asked, and in the kernels only where they can take it
  assert kda().dg_cumsum == "xla" and kda(dg_cumsum="kernel").dg_cumsum == "kernel"
  assert kda(jnp.float16, dg_cumsum="kernel").dg_cumsum == "xla"
  assert kda(backward="xla_vjp", dg_cumsum="kernel").dg_cumsum == "xla"
  gla_r = lambda **kw: plan.select(delta=False, decay="channel", config=GpuConfig(dg_cumsum="kernel"),
                                   qk_l2norm=False, **kw).dg_cumsum
  assert gla_r() == "kernel" and gla_r(dtype=jnp.float16) == "xla"
  assert plan.select(delta=True, decay="scalar", config=GpuConfig(dg_cumsum="kernel")).dg_cumsum == "xla"
  with pytest.raises(ValueError, match="dg_cumsum"):
    GpuConfig(dg_cumsum="triton")
  assert plan.select(delta=False, decay="scalar", config=kernels).interpreter_threads() == {
      "forward_warpgroups=3": 4}
  assert plan.select(delta=True, decay="channel", config=kernels).interpreter_threads() == {}
  # kda's two-warpgroup kernels: the default at K = 128 with bfloat16 operands and C = 64 (the key side
  # also needs dG's cumsum in XLA), one warpgroup elsewhere or where asked
  k128 = lambda dtype=jnp.bfloat16, K=128, **c: plan.select(delta=True, decay="channel", dtype=dtype, K=K,
                                                            config=GpuConfig(**c))
  both = lambda p: (p.key_warpgroups, p.prep_warpgroups)
  assert both(k128()) == (2, 2)
  assert k128().interpreter_threads() == {"key_warpgroups=2": 3, "prep_warpgroups=2": 3}
  assert both(k128(jnp.float16)) == both(k128(jnp.float32)) == both(k128(K=64)) == (1, 1)
  assert both(k128(dg_cumsum="kernel")) == (1, 2)
  assert both(k128(key_warpgroups=1, prep_warpgroups=1)) == (1, 1)
  assert both(k128(key_warpgroups=2, prep_warpgroups=1)) == (2, 1)
  assert both(plan.select(delta=False, decay="channel", K=128, config=kernels)) == (1, 1)   # gla
  assert both(plan.select(delta=True, decay="channel", K=128, config=GpuConfig(backward="xla_vjp"))) == (1, 2)
  with pytest.raises(ValueError, match="key_warpgroups must be one of"):
    GpuConfig(key_warpgroups=0)
  with pytest.raises(TypeError):
    GpuConfig(walk_warpgroups=3)   # the walks' three-warpgroup form is gone (NOTES.md v30, v37)


# stage name -> the functions it calls (module, attribute); a stage's functions are spied on by name
FORWARD_STAGES = {"fused": [(fused, "forward")], "delta_prep": [(delta_prep, "prepare"), (walk, "forward")],
                  "channel_prep": [(channel_prep, "prepare"), (walk, "forward")],
                  "xla_prep": [(prepared, "prepare"), (walk, "forward")],
                  "xla_merge_per_head": [(prepared, "merge_tensors_per_head")]}
BACKWARD_STAGES = {"fused": [(fused, "backward")], "delta_grads": [(delta_grads, "backward")],
                   "channel_grads": [(channel_grads, "backward")],
                   "channel_delta_grads": [(channel_delta_grads, "backward")],
                   "xla_vjp": [(prepared, "backward")], "xla_vjp_per_head": [(prepared, "backward_per_head")]}


def test_float16_beyond_the_groups_bound_plans_the_per_head_merge_form():
  for delta in (False, True):
    assert plan.select(delta=delta, decay="channel", config=GpuConfig(), dtype=jnp.float16).per_head_beyond
    assert not plan.select(delta=delta, decay="channel", config=GpuConfig()).per_head_beyond
  assert not plan.select(delta=True, decay="scalar", config=GpuConfig(), dtype=jnp.float16).per_head_beyond
SPIED = sorted({f for stages in (FORWARD_STAGES, BACKWARD_STAGES) for fs in stages.values() for f in fs},
               key=lambda f: (f[0].__name__, f[1]))


def _inputs(variant, T=70):
  delta, decay = plan.VARIANTS[variant]
  x = jnp.zeros((1, T, 1, 64), jnp.bfloat16)
  g = {"none": None, "scalar": jnp.zeros((1, T, 1)), "channel": jnp.zeros((1, T, 1, 64))}[decay]
  return x, g, (jnp.zeros((1, T, 1)) if delta else None)


CELLS = [(variant, forward, backward) for variant, forward, backward in TABLE]


@pytest.mark.parametrize("differentiated", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("variant,forward,backward", CELLS)
def test_the_trace_reaches_exactly_the_planned_stages(monkeypatch, variant, forward, backward, packed,
                                                      differentiated):
  calls, grams_seen = [], {}

  def spy(*a, _f, _n, **k):
    calls.append(_n)
    if "grams" in k:
      grams_seen.setdefault((_n[0].rsplit(".", 1)[-1], _n[1]), set()).add(k["grams"])
    return _f(*a, **k)

  for module, name in SPIED:
    original = getattr(module, name)
    monkeypatch.setattr(module, name,
                        lambda *a, _f=original, _n=(module.__name__, name), **k: spy(*a, _f=_f, _n=_n, **k))
  x, g, beta = _inputs(variant)
  seg = jnp.asarray(np.repeat([[0, 1]], 35, axis=1)) if packed else None
  config = GpuConfig(forward=forward, backward=backward, **ONE_WARPGROUP)
  p = call_plan(x, x, x, g, beta, segment_ids=seg, config=config)
  op = lambda q, k, v, g, beta: chunked_attention(q, k, v, g, beta, segment_ids=seg, config=config)
  args = (x, x, x, g, beta)
  if differentiated:
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(op(*a)[0].astype(jnp.float32)), argnums=argnums))(*args)
  else:
    jax.make_jaxpr(op)(*args)
  want = set(FORWARD_STAGES[p.forward])
  # beyond the one-reference bound the same stage's kernels run with the plan's grams (spied below);
  # bfloat16 operands never go beyond the groups' bound, so no per-head stage is traced
  assert not p.per_head_beyond
  if differentiated:
    want |= set(BACKWARD_STAGES[p.backward])
  reached = {(m.__name__, n) for m, n in SPIED if (m.__name__, n) in calls}
  want = {(m.__name__, n) for m, n in want}
  # walk.forward and prepared.prepare also serve backward stages that recompute (xla_vjp: the
  # preparation and the states walk; fused and delta_grads after xla_prep: their own kernels)
  helpers = {("linear_attention_jax.pallas_kernels.gpu.walk", "forward"), ("linear_attention_jax.pallas_kernels.prepared", "prepare"),
             ("linear_attention_jax.pallas_kernels.gpu.delta_prep", "prepare"), ("linear_attention_jax.pallas_kernels.gpu.fused", "forward")}
  assert want <= reached, (p, sorted(want - reached))
  extra = reached - want
  assert extra <= helpers, (p, sorted(extra))
  if not differentiated:
    assert extra == set(), (p, sorted(extra))
  # the one-reference grams and the groups' are chosen by the one-reference bound on the data: both
  # branches are traced, each with its grams
  if p.forward_beyond is not None:
    G, _ = channel.chunk_cumsum(jnp.zeros((1, 70, 1, 64)), 128, 64)
    assert bool(channel.fits(G, 64, jnp.bfloat16))
    G, _ = channel.chunk_cumsum(jnp.full((1, 70, 1, 64), -20.0), 128, 64)
    assert not bool(channel.fits(G, 64, jnp.bfloat16))
    kernel_stages = {("channel_prep", "prepare")} if p.forward == "channel_prep" else set()
    if differentiated and p.backward in ("channel_grads", "channel_delta_grads"):
      kernel_stages.add((p.backward, "backward"))
    beyond = {("channel_prep", "prepare"): p.forward_beyond}
    beyond[(p.backward, "backward")] = p.backward_beyond
    for stage in kernel_stages:
      assert {"one", beyond[stage]} <= set(grams_seen.get(stage, ())), (p, stage, grams_seen)


def test_the_plan_rides_in_the_static_argument(monkeypatch):
  # the backward reads the forward's plan: one Plan object per call, hashable, in the custom_vjp's static
  x, g, beta = _inputs("kda")
  seen = []
  original = vjp._backward
  monkeypatch.setattr(vjp, "_backward", lambda static, *a: seen.append(static.plan) or original(static, *a))
  config = GpuConfig(**ONE_WARPGROUP)
  jax.make_jaxpr(jax.grad(lambda q: jnp.sum(chunked_attention(q, x, x, g, beta, config=config)[0].astype(
      jnp.float32))))(x)
  assert seen == [call_plan(x, x, x, g, beta, config=config)]
  assert hash(seen[0]) == hash(dataclasses.replace(seen[0]))
  assert re.match(r"Plan\(cell='channel_delta'", repr(seen[0]))


def test_default_config_reaches_the_persistent_pair_gradients(monkeypatch):
  # Given the ops' call (no config) of Gated DeltaNet at V = 128 inside default_config(grads_programs=7)
  from linear_attention_jax import ops
  from linear_attention_jax.pallas_kernels.gpu import default_config, delta_grads_pair, interpret_kernels
  seen = []
  original = delta_grads_pair.chunk_grads_pair
  monkeypatch.setattr(delta_grads, "chunk_grads_pair",
                      lambda *a, **k: seen.append(k.get("programs")) or original(*a, **k))
  q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  v = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
  g, beta = jnp.zeros((1, 64, 1)), jnp.full((1, 64, 1), 0.5)
  loss = lambda q: jnp.sum(ops.gated_delta_rule(q, q, v, g, beta, impl="pallas")[0].astype(jnp.float32))
  # When its gradient is traced (no kernel runs), and again outside the context
  with interpret_kernels():
    with default_config(GpuConfig(grads_programs=7)):
      assert call_plan(q, q, v, g, beta).grads_programs == 7
      jax.make_jaxpr(jax.grad(loss))(q)
    jax.make_jaxpr(jax.grad(lambda q: loss(q) * 2.0))(q)
  # Then the pair gradients got the programs inside it and the grid outside it
  assert seen == [7, None]
  with pytest.raises(ValueError, match="config must be"):
    with default_config({"grads_programs": 7}):
      pass


def test_the_entry_takes_at_most_ten_keywords():
  # the tuning values live in GpuConfig, not in the entry's signature (as the TPU entry's BlockSizes)
  import inspect
  from linear_attention_jax.pallas_kernels import tpu
  for entry in (chunked_attention, tpu.chunked_attention):
    keywords = [p for p in inspect.signature(entry).parameters.values() if p.kind == p.KEYWORD_ONLY]
    assert len(keywords) <= 10, (entry.__module__, [p.name for p in keywords])
