"""Which Mosaic GPU kernels run for a call: `GpuConfig` (the tuning values, validated once) and `select`, the
one function that reads them and names the forward path and every backward stage of a call.

What runs where. One row per cell (family x decay kind) and configuration; packing (`segment_ids`)
changes no row, since every kernel takes packed rows (`cu_seqlens` is not taken: pass segment_ids).
"keeps" is what a differentiated call's forward keeps for its backward ("inputs": nothing more, the
backward recomputes). Per-channel cells decide on the data, once per call, whether every chunk's decay
fits the one-reference bound (`prep.ref_bound`: 60 nats for bfloat16 operands, 8 for float16; 76
for l2-normalised q, k, `GpuConfig.unit_ref_bound`, `Plan.forward_ref_bound`; one `lax.cond` each
way, which `GpuConfig.call_test=False` leaves out where the beyond stage is "chunk"): the two
"beyond" columns name what runs beyond it ("-": no bound; "groups": the same kernels with the
8-token groups' products, `groups.py`, exact at any gate above `prep.LOG_DECAY_FLOOR` with bfloat16
operands, on every chunk; "chunk": the same kernels choosing per chunk the first form that fits it:
one reference, the halves' products, the groups'). Float16
operands beyond the groups' bound (2.2 nats a token) take XLA's merge form one (batch row, value head)
at a time (`Plan.per_head_beyond`). "l2" is where
`qk_l2norm=True` normalises q and k: in the kernels on load, or in XLA before them (`Plan.l2` is "none"
for a call without it; kda's kernels normalise on load and XLA takes the norm's backward from their
dq, dk). The gates are floored at `prep.LOG_DECAY_FLOOR` before the stages, except where the
per-channel kernels run both ways (`Plan.gate_floor` "stages": their cumsum floors g and their
backward zeroes dg below the floor, so the op keeps the caller's g).

    | variants                                | forward  | backward | plan.forward | keeps                            | plan.backward       | beyond: forward    | beyond: backward | l2      |
    | --------------------------------------- | -------- | -------- | ------------ | -------------------------------- | ------------------- | ------------------ | ---------------- | ------- |
    | linear_attention, retention, simple_gla | kernel   | kernel   | fused        | states                           | fused               | -                  | -                | xla     |
    | linear_attention, retention, simple_gla | kernel   | xla_vjp  | fused        | inputs                           | xla_vjp             | -                  | -                | xla     |
    | linear_attention, retention, simple_gla | xla_prep | kernel   | xla_prep     | inputs                           | fused               | -                  | -                | xla     |
    | linear_attention, retention, simple_gla | xla_prep | xla_vjp  | xla_prep     | inputs                           | xla_vjp             | -                  | -                | xla     |
    | gla                                     | kernel   | kernel   | channel_prep | states, qg, decay, cumsum        | channel_grads       | chunk              | groups           | xla     |
    | gla                                     | kernel   | xla_vjp  | channel_prep | inputs                           | xla_vjp             | chunk              | xla_vjp          | xla     |
    | gla                                     | xla_prep | kernel   | xla_prep     | states, qg, decay, cumsum        | channel_grads       | xla_prep           | groups           | xla     |
    | gla                                     | xla_prep | xla_vjp  | xla_prep     | inputs                           | xla_vjp             | xla_prep           | xla_vjp          | xla     |
    | delta_rule, gated_delta_rule            | kernel   | kernel   | delta_prep   | tensors, inverse, states         | delta_grads         | -                  | -                | on_load |
    | delta_rule, gated_delta_rule            | kernel   | xla_vjp  | delta_prep   | inputs                           | xla_vjp             | -                  | -                | xla     |
    | delta_rule, gated_delta_rule            | xla_prep | kernel   | xla_prep     | inputs                           | delta_grads         | -                  | -                | xla     |
    | delta_rule, gated_delta_rule            | xla_prep | xla_vjp  | xla_prep     | inputs                           | xla_vjp             | -                  | -                | xla     |
    | kda                                     | kernel   | kernel   | channel_prep | tensors, inverse, states, cumsum | channel_delta_grads | chunk              | chunk            | on_load |
    | kda                                     | kernel   | xla_vjp  | channel_prep | inputs                           | xla_vjp             | chunk              | xla_vjp          | xla     |
    | kda                                     | xla_prep | xla_vjp  | xla_prep     | inputs                           | xla_vjp             | xla_prep           | xla_vjp          | xla     |

The stages, by the files that hold them (`pallas_kernels/gpu/`, XLA's in `pallas_kernels/prepared.py`):
- fused: `fused.forward` forms the chunk tensors of the additive family (no or scalar decay) in shared
  memory from the raw tiles and walks the chunks; its backward, `fused.backward`: the states walk (skipped
  where the forward kept them), the reverse walk, then every chunk's gradients in parallel.
- delta_prep / channel_prep: one kernel writes every chunk's tensors (`delta_prep.prepare`: the delta
  family, no or scalar decay; `channel_prep.prepare`: per-channel decay, either family, the grams about
  one reference per channel), then `walk.forward` walks them.
- xla_prep: XLA's preparation (`prep.prepare`, per-channel grams by `GpuConfig.gram_method`), then
  `walk.forward`. xla_merge_per_head (float16 beyond the groups' bound): the same with the merge form, one
  (batch row, value head) at a time.
- delta_grads, channel_grads, channel_delta_grads: the reverse walk (`walk.backward_states`), then
  kernels that form every chunk's gradients in parallel (no XLA vjp of the preparation).
- xla_vjp: the backend's walks around XLA's vjp of the preparation (`prepared.backward`);
  xla_vjp_per_head (float16 beyond the groups' bound): the same with the merge form, one (batch row,
  value head) at a time (XLA allocates both branches' scratch of a `lax.cond`; one head at a time needs
  1 / (B H_v) of it).
kda's gradient kernels read the inverse `(I + L)^-1` that its preparation kernel writes, so kda with
`forward="xla_prep"` takes `backward="xla_vjp"` (asking for its kernels raises).

NOTES.md records what each stage costs on the H200 and the versions that led here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import prep
from . import delta_grads, groups
from .interpret import interpreting
from .tiles import BLOCK_V, SMEM_BYTES

DTYPES = (jnp.bfloat16, jnp.float16)
KERNEL_DIMS = (64, 128)   # the head dims one kernel program walks
HEAD_DIMS = (64, 128, 256)  # a call's; 256 runs as blocks of 128 where `head_blocks` says so
CHUNK_SIZES = (64,)
FORWARDS = ("kernel", "xla_prep")
BACKWARDS = ("kernel", "xla_vjp")
DG_CUMSUMS = ("xla", "kernel")
CUMSUMS = ("kernel", "xla")
CHANNEL_ORDERS = ("none", "op", "layer", "ordered")
L2_GRADS = ("key_side", "kernel", "xla")
VARIANTS = {   # variant -> (delta family, decay kind)
    "linear_attention": (False, "none"), "retention": (False, "scalar"), "simple_gla": (False, "scalar"),
    "gla": (False, "channel"), "delta_rule": (True, "none"), "gated_delta_rule": (True, "scalar"),
    "kda": (True, "channel")}


@dataclasses.dataclass(frozen=True)
class GpuConfig:
  """The GPU kernels' tuning values (hashable; validated when built). The defaults are what the library
  runs; the others exist to measure a stage against its XLA form or another program layout.

  forward: "kernel" (each cell's forward kernels, the module table) or "xla_prep" (XLA's preparation,
    then the walk kernel).
  backward: "kernel" (each cell's gradient kernels) or "xla_vjp" (the walks around XLA's vjp of the
    preparation).
  sequence_pieces: split each sequence's walks into this many pieces that run in parallel, joined by
    their end states (None: as many as keep one wave of programs on the GPU, `pipeline.pieces`; a number pads
    T to whole pieces of chunks).
  forward_warpgroups: the fused forward's programs, 3 (one fetches, one carries the state, one forms o;
    NOTES.md v28-v29) or 1.
  delta_warpgroups: delta_grads with V = 2 x 64 value blocks and 16-bit operands, 2 (both blocks in one
    program sharing q, k and X; NOTES.md v27) or 1.
  grads_programs: those two-warpgroup gradients in one program a chunk (None: the grid) or in this many
    persistent programs, each taking chunks in turn (`delta_grads_pair.chunk_grads_pair(programs=...)`).
    Not the default: on the H200, 132 programs made GatedDeltaNet's layer 1.21x slower (NOTES.md v51);
    it is the scaffold for issuing a chunk's copies during the previous chunk's products.
  unit_ref_bound: the per-channel forward's one-reference bound where q and k are l2-normalised
    (`qk_l2norm`) and the operands bfloat16: `prep.UNIT_REF_BOUND` (76 nats: a chunk may decay by
    152 on every channel and still take one product) if True, else `prep.REF_BOUND` (60) as
    everywhere; kda's key-side gradients then take one reference per chunk up to a bound from that
    chunk's cotangents (`channel.cotangent_bound`: 76 unless they are large), where False keeps 60
    (and cotangents beyond ~2e10 can overflow it). The default: on the H200 the KDA layer fwd+bwd
    ran 0.37 ms faster with it (NOTES.md v54; at the layer's initialisation 88% of (row, chunk,
    head) fit one product against 66%).
  call_test: the per-channel stages whose kernels choose each chunk's form ("chunk" in the module
    table's beyond columns) first test the whole call in one `lax.cond`, taking the one-reference
    kernels where every chunk fits, if True; with False they call the per-chunk kernels directly,
    which give the one-reference kernels' outputs on every chunk that fits. The test costs a
    reduction over the gates and a conditional (inside XLA's command buffer a conditional node,
    ~10 us of the device's time on the H200, NOTES.md v55; without command buffers a copy of the
    predicate to the host, which waits for the device), and both branches' kernels are compiled: a
    KDA layer's fwd+bwd holds two tests and 9 Mosaic GPU kernels, 5 without them. Float16 operands
    keep the test (beyond the groups' bound they take the merge form per head), as does gla's
    backward (its gradient kernel has no per-chunk form).
  order_channels: kda (the per-channel delta family, whose key-side gradients take the key channels
    in halves of 64, each half its own form: `channel.chunk_forms(..., width=HALF)`) takes the key
    channels strongest first, so that a trained chunk's strong channels share one half and the other
    half takes one reference (every trained chunk of the CPU census, NOTES.md v57, v59); its per-chunk
    preparation kernel then also gives each half its own form (`channel_prep.prepare(...,
    half_forms=True)`). The call's values are the same up to the order of the float32 sums over
    channels. Values: "layer" (the default: the KimiDeltaAttention layers, where they take no cache
    and the GPU's kernels may run, order their projections' columns by one order a key head for the
    whole batch, `layers.kda`, so that q, k and g come out ordered and no activation is gathered, and
    call their op with "ordered"; a direct call of the op is as "none": on the H100 the trained KDA
    LM's step took 49.4 ms against 52.7, NOTES.md v60), "none" (the whole chunk's form for both
    halves, the layers' columns as they are), "op" (the op orders each batch row's and key head's
    channels by how much they decay over the row, `channel.channel_order`, gathering q, k, g and the
    initial state, and restores the order of dq, dk, dg and the final state after its kernels: on the
    H200 its kernels took 4.6 ms less a trained KDA LM step and its gathers 2.9 ms more, NOTES.md v59)
    or "ordered" (the caller's channels come strongest first: each half its own form, no gathers;
    right for channels in any order, a saving only where the strong ones share a half).
  dg_cumsum: where the per-channel gradient kernels' dG becomes dg (its reverse cumsum within each
    chunk): "xla" (one batched float32 product with the triangle of ones after the kernels) or
    "kernel" (at the end of each gradient program, dG split into three bfloat16 tiles on the tensor
    cores: `tiles.reverse_cumsum_rows`; bfloat16 operands, and C = 64 for gla). "xla" by default: in
    the trained KDA LM on the H200 the key-side kernel took 1.35 ms a step longer with it, where XLA's
    product costs 0.48 (NOTES.md v59).
  cumsums: the per-channel stages' chunk-local cumulative sums of g (the forward's G and its reference
    rows, `channel.chunk_cumsum`) and of dG (dg, where `dg_cumsum` leaves it to XLA): "kernel" (the
    default: `cumsum.py`'s token walks, one pass over the input each, where H_v K is a multiple of 128
    and C of 8; XLA's product elsewhere) or "xla" (one batched float32 product with the triangle of
    ones, and the references from G in a second pass).
  gate: where a kda call given its gate's pre-activation (`ops.kda(..., A_log=, dt_bias=)`, as the
    KimiDeltaAttention layer calls it) computes the gate: "kernel" (the default: the cumsum walks
    compute g on load and its cotangents in their reverse walk, `cumsum.gated_forward` / `gated_reverse`,
    where `cumsums` is "kernel" and they serve the shape) or "xla" (XLA computes g first, and its
    backward after the kernels: NOTES.md v65).
  prep_warpgroups: kda's preparation kernel at K = 128 on 1 warpgroup or 2 (the grams' products dealt
    out between them, qg / kd by halves of the columns, the inverse and w on one while the other
    forms u: `channel_prep_split`; K = 64 and gla run one). None (default): 2 at K = 128 with
    bfloat16 operands and C = 64, else 1.
  key_warpgroups: kda's key-side gradients at K = 128 on 1 warpgroup (both halves of the key channels
    in turn, `channel_delta_grads.key_side`) or 2 (a half each, side by side, the value side forming
    their products without a decayed gram: `channel_delta_keys`; needs `dg_cumsum="xla"`; K = 64 runs
    one). None (default): 2 at K = 128 with bfloat16 operands, C = 64 and dG's cumsum in XLA, else 1.
    With both at 2 the trained K LM steps ~10% faster on an H100 and trains as with one warpgroup
    (NOTES.md v62-v63).
  l2_grads: where kda's backward takes the l2 norms' gradients of q and k when its kernels normalise
    them on load: "key_side" (the default: the two-warpgroup key side's epilogue, NOTES.md v67; after
    the one-warpgroup key side, XLA's vjp), "kernel" (`l2_grads.py`: one pass over q, k, dq, dk after
    the key side, either key side; 16-bit q, k, else XLA's vjp) or "xla" (XLA's vjp after either key
    side). On an H100 the trained KDA LM stepped in 39.8 ms with the epilogue and 39.9 with XLA's vjp
    (NOTES.md v68): the epilogue cost the key side what it saved XLA.
  gram_method: XLA's per-channel decayed grams (`prep.GRAM_METHODS`) where XLA prepares: "auto" (one
    product about a per-channel reference within the bound, else the merge form) or "merge" (NOTES.md
    v25: a third form, whole-tile levels, was slower on the H200 and is gone).
  XLA's preparation computes `(I + L)^-1` with float32 operands (exact, and on the H200 not slower than
  bfloat16: NOTES.md). The walks over prepared tensors run one warpgroup a program (NOTES.md v30: three
  specialised ones were not faster on the H200, and the option is gone).
  In the Mosaic GPU interpreter each warpgroup of a program runs as a computation of its own on XLA's
  CPU pool: 3 warpgroups need `NPROC >= 4`, 2 need 3 (`interpret.interpreter_threads`).
  """

  forward: str = "kernel"
  backward: str = "kernel"
  sequence_pieces: int | None = None
  forward_warpgroups: int = 3
  delta_warpgroups: int = 2
  gram_method: str = "auto"
  grads_programs: int | None = None
  unit_ref_bound: bool = True
  call_test: bool = True
  order_channels: str = "layer"
  dg_cumsum: str = "xla"
  cumsums: str = "kernel"
  gate: str = "kernel"
  key_warpgroups: int | None = None
  prep_warpgroups: int | None = None
  l2_grads: str = "key_side"

  def __post_init__(self):
    for name, allowed in (("forward", FORWARDS), ("backward", BACKWARDS), ("forward_warpgroups", (1, 3)),
                          ("delta_warpgroups", (1, 2)), ("key_warpgroups", (None, 1, 2)),
                          ("prep_warpgroups", (None, 1, 2)), ("gram_method", prep.GRAM_METHODS),
                          ("dg_cumsum", DG_CUMSUMS), ("cumsums", CUMSUMS), ("gate", CUMSUMS),
                          ("order_channels", CHANNEL_ORDERS), ("l2_grads", L2_GRADS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"GpuConfig.{name} must be one of {allowed}; got {getattr(self, name)!r}")
    for name in ("unit_ref_bound", "call_test"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"GpuConfig.{name} must be a bool; got {getattr(self, name)!r}")
    for name in ("sequence_pieces", "grads_programs"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"GpuConfig.{name} must be None or a positive int; got {value!r}")
    if self.key_warpgroups == 2 and self.dg_cumsum != "xla":
      raise ValueError("GpuConfig.key_warpgroups=2 takes dG's reverse cumsum in XLA: dg_cumsum must be "
                       f"'xla'; got {self.dg_cumsum!r}")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What runs for one call (the module table's row): the stage names of the forward and the backward,
  what the forward keeps when differentiated, the stages beyond the per-channel bound (None: the cell
  has no bound), where q, k are l2-normalised, and the tuning values the stages read (the stages read
  no `GpuConfig`: `select` is its only reader)."""

  cell: str                    # "fused" | "channel" | "delta" | "channel_delta"
  forward: str                 # "fused" | "delta_prep" | "channel_prep" | "xla_prep"
  keeps: str                   # the table's "keeps"
  backward: str                # "fused" | "delta_grads" | "channel_grads" | "channel_delta_grads" | "xla_vjp"
  forward_beyond: str | None   # "chunk" | "xla_prep" | None
  backward_beyond: str | None  # "chunk" | "groups" | "xla_vjp" | None
  l2: str                      # "on_load" | "xla" | "none"
  forward_warpgroups: int      # of the fused forward's programs (1 elsewhere)
  grads_warpgroups: int        # of delta_grads' programs (1 elsewhere)
  grads_programs: int | None = None    # GpuConfig.grads_programs, where grads_warpgroups is 2
  sequence_pieces: int | None = None   # GpuConfig.sequence_pieces
  gram_method: str = "auto"            # GpuConfig.gram_method, where XLA prepares
  per_head_beyond: bool = False        # float16 beyond the groups' bound: XLA's merge form per head
  forward_ref_bound: float = prep.REF_BOUND   # the per-channel forward's one-reference bound
  unit_bound: bool = False     # GpuConfig.unit_ref_bound where it holds (q, k l2-normalised, bfloat16)
  call_test: bool = True       # GpuConfig.call_test: a call-wide lax.cond before per-chunk kernels
  order_channels: bool = False  # GpuConfig.order_channels "op" where kda's key-side kernel runs
  half_forms: bool = False     # its preparation's halves their own forms ("op" or "ordered" there)
  gate_floor: str = "xla"      # "xla": g floored before the stages | "stages": by the per-channel ones
  dg_cumsum: str = "xla"       # GpuConfig.dg_cumsum where a per-channel gradient kernel can take it
  cumsums: str = "xla"         # GpuConfig.cumsums for the per-channel stages' cumsums of g and dG
  gate: str = "xla"            # GpuConfig.gate for kda's per-channel stages
  key_warpgroups: int = 1      # of kda's key-side programs (GpuConfig.key_warpgroups where K = 128)
  prep_warpgroups: int = 1     # of kda's preparation programs (GpuConfig.prep_warpgroups where K = 128)
  l2_grads: str = "none"       # kda's norms' gradients: "key_side" | "kernel" | "xla" where l2 is on_load

  def row(self) -> tuple[str, ...]:
    """The module table's columns from plan.forward on."""
    return (self.forward, self.keeps, self.backward, self.forward_beyond or "-",
            self.backward_beyond or "-", self.l2)

  def interpreter_threads(self) -> dict[str, int]:
    """Option -> threads the interpreter needs, for each multi-warpgroup program this plan runs."""
    need = {}
    if self.forward_warpgroups == 3:
      need["forward_warpgroups=3"] = 4
    if self.grads_warpgroups == 2:
      need["delta_warpgroups=2"] = 3
    if self.key_warpgroups == 2:
      need["key_warpgroups=2"] = 3
    if self.prep_warpgroups == 2:
      need["prep_warpgroups=2"] = 3
    return need


def cell(delta: bool, decay: str) -> str:
  """The kernels' cell of a family (`delta`) and decay kind ("none", "scalar" or "channel")."""
  if decay not in ("none", "scalar", "channel"):
    raise ValueError(f"decay must be 'none', 'scalar' or 'channel'; got {decay!r}")
  return {(False, False): "fused", (False, True): "channel", (True, False): "delta",
          (True, True): "channel_delta"}[bool(delta), decay == "channel"]


_FORWARD = {"fused": "fused", "channel": "channel_prep", "delta": "delta_prep", "channel_delta": "channel_prep"}
_BACKWARD = {"fused": "fused", "channel": "channel_grads", "delta": "delta_grads",
             "channel_delta": "channel_delta_grads"}
_KEEPS = {("fused", "fused"): "states", ("channel_prep", "channel_grads"): "states, qg, decay, cumsum",
          ("xla_prep", "channel_grads"): "states, qg, decay, cumsum",
          ("delta_prep", "delta_grads"): "tensors, inverse, states",
          ("channel_prep", "channel_delta_grads"): "tensors, inverse, states, cumsum"}


def select(*, delta: bool, decay: str, config: GpuConfig, packing: str = "none", qk_l2norm: bool = True,
         V: int = 64, chunk_size: int = 64, v_dtype=jnp.bfloat16, dtype=jnp.bfloat16, K: int = 64) -> Plan:
  """The plan of a call: family (`delta`: beta given), decay kind ("none", "scalar", "channel"),
  `packing` ("none" or "segments"), whether q, k are l2-normalised, V, C, v's and the operands' dtypes, K,
  and the configuration. The same
  plan serves the call differentiated or not (`keeps` is what the forward of a differentiated call keeps).
  Raises ValueError for a configuration no kernel pair serves (kda's gradient kernels after XLA's
  preparation) and for `cu_seqlens`."""
  if packing not in ("none", "segments"):
    raise ValueError(f"the GPU kernels take packing 'none' or 'segments' (segment_ids); got {packing!r}")
  c = cell(delta, decay)
  forward = _FORWARD[c] if config.forward == "kernel" else "xla_prep"
  backward = _BACKWARD[c] if config.backward == "kernel" else "xla_vjp"
  if c == "channel_delta" and (forward, backward) == ("xla_prep", "channel_delta_grads"):
    raise ValueError("kda's gradient kernels read the inverse that its preparation kernel writes: "
                     "GpuConfig(forward='xla_prep') needs backward='xla_vjp'")
  per_channel = decay == "channel"
  unit = config.unit_ref_bound and qk_l2norm and per_channel
  forward_beyond = None if not per_channel else ("xla_prep" if forward == "xla_prep" else "chunk")
  backward_beyond = None if not per_channel else {"xla_vjp": "xla_vjp", "channel_grads": "groups"}.get(
      backward, "chunk")
  pair = (backward == "delta_grads" and config.delta_warpgroups == 2
          and delta_grads.pair_serves(V, chunk_size, v_dtype, dtype))
  per_head = bool({"chunk", "groups"} & {forward_beyond, backward_beyond}) and not groups.always_fits(dtype)
  # the per-channel kernels both ways, with no XLA branch beside them (float16's per-head merge form)
  channel_kernels = (forward == "channel_prep" and backward in ("channel_grads", "channel_delta_grads")
                     and not per_head)
  on_load = (forward, backward) == ("delta_prep", "delta_grads") or (
      channel_kernels and backward == "channel_delta_grads")
  dg_cumsum = config.dg_cumsum if jnp.dtype(dtype) == jnp.bfloat16 and (
      backward == "channel_delta_grads" or (backward == "channel_grads" and chunk_size == 64)) else "xla"
  # kda's two-warpgroup kernels where their option is left to the plan (GpuConfig's docstring)
  two = jnp.dtype(dtype) == jnp.bfloat16 and chunk_size == 64
  key_warpgroups = (config.key_warpgroups or (2 if two and dg_cumsum == "xla" else 1)
                    if backward == "channel_delta_grads" and K == 128 else 1)
  return Plan(cell=c, forward=forward, keeps=_KEEPS.get((forward, backward), "inputs"), backward=backward,
              forward_beyond=forward_beyond, backward_beyond=backward_beyond,
              l2="none" if not qk_l2norm else "on_load" if on_load else "xla",
              forward_warpgroups=config.forward_warpgroups if forward == "fused" else 1,
              grads_warpgroups=2 if pair else 1, sequence_pieces=config.sequence_pieces,
              grads_programs=config.grads_programs if pair else None,
              gram_method=config.gram_method,
              per_head_beyond=per_head,
              forward_ref_bound=prep.ref_bound(dtype, unit=unit and forward == "channel_prep"),
              unit_bound=unit and jnp.dtype(dtype) != jnp.float16,
              call_test=config.call_test or not groups.always_fits(dtype),
              order_channels=config.order_channels == "op" and backward == "channel_delta_grads",
              half_forms=(config.order_channels in ("op", "ordered") and forward == "channel_prep"
                          and backward == "channel_delta_grads"),
              gate_floor="stages" if channel_kernels else "xla",
              dg_cumsum=dg_cumsum,
              cumsums=config.cumsums if per_channel else "xla",
              gate=config.gate if per_channel and delta else "xla",
              key_warpgroups=key_warpgroups,
              prep_warpgroups=(config.prep_warpgroups or (2 if two else 1)
                               if forward == "channel_prep" and delta and K == 128 else 1),
              l2_grads=_l2_grads(config, qk_l2norm and on_load and backward == "channel_delta_grads",
                                 key_warpgroups))


def _l2_grads(config: GpuConfig, on_load: bool, key_warpgroups: int) -> str:
  """Plan.l2_grads: "none" unless kda's kernels normalise q, k on load; the epilogue only on two
  warpgroups (GpuConfig.l2_grads)."""
  if not on_load:
    return "none"
  if config.l2_grads == "key_side":
    return "key_side" if key_warpgroups == 2 else "xla"
  return config.l2_grads


def hopper_reason(backend: str | None = None) -> str | None:
  """None if this process runs on a Hopper GPU (or inside `interpret_kernels`), else why not.
  `backend="hopper"` asserts a Hopper target (exporting for one from any machine)."""
  if backend == "hopper" or (backend is None and interpreting() is not None):
    return None
  backend = jax.default_backend() if backend is None else backend
  if backend != "gpu":
    return (f"the Mosaic GPU kernels need a Hopper GPU and the backend is {backend!r} (tests run them "
            f"on a CPU inside linear_attention_jax.pallas_kernels.gpu.interpret_kernels())")
  device = jax.devices()[0]
  cc = getattr(device, "compute_capability", None)
  if cc != "9.0":
    return (f"the Mosaic GPU kernels are written for Hopper (compute capability 9.0, wgmma); "
            f"{device.device_kind} has {cc}")
  return None


def smem_bytes(*, C: int, K: int, V: int, itemsize: int, delta: bool, out_itemsize: int,
               backward: bool) -> int:
  """Shared memory of one walk program (double-buffered inputs, staging tiles, state)."""
  bv = min(BLOCK_V, V)
  if not backward:
    ins = C * K * (2 + delta) + C * bv + C * C  # kd, qg, [w], u, p
    return (2 * ins * itemsize + 2 * K * 4 + 2 * C * bv * out_itemsize + 2 * bv * K * itemsize
            + bv * K * 4 + delta * bv * C * itemsize)
  ins = C * K * (1 + 2 * delta) + C * bv + delta * C * C  # qg, [kd, w], do, [p]
  return 2 * ins * itemsize + 2 * K * 4 + 2 * bv * K * itemsize + bv * K * 4 + delta * bv * C * itemsize


def walked_columns(V: int, appended: int) -> int:
  """How many leading value columns of a call with `appended` columns of ones (the linear-attention
  normaliser) the kernels walk: all but the appended ones, which the caller walks in XLA (the walk is
  independent per value column, and V + 1 is no kernel's head dim)."""
  return V - appended


def head_blocks(K: int, V: int, *, delta: bool = False, decay: str = "none") -> tuple[int, int]:
  """The (key, value) block of a call's state that one kernel call walks: the head dim itself where a
  program walks it (`KERNEL_DIMS`, and V = 256 in the delta family without per-channel decay, whose
  preparation forms u in blocks of 128 columns and whose gradient programs take pairs of 64-column
  blocks: the key side once per chunk, not once per value block), else 128. Every value column walks
  independently in both families, so elsewhere V = 256 runs as two value heads of 128 columns in one
  call (each repeats the key side's work); in the additive family the state and the read-out are sums
  over key channels, so K = 256 is two calls whose outputs add. The delta family's update
  `(I - beta k k^T)` mixes every key channel: its K does not split."""
  native_v = KERNEL_DIMS + ((256,) if delta and decay != "channel" else ())
  return (K if K in KERNEL_DIMS else KERNEL_DIMS[-1]), (V if V in native_v else KERNEL_DIMS[-1])


def supports(*, K: int, V: int, chunk_size: int, dtype=jnp.bfloat16, packing: str = "none",
             backend: str | None = None, sharded: bool = False, delta: bool = False) -> str | None:
  """None if the Mosaic GPU kernels serve a call of this kind, else the reason they do not.

  Args:
    K, V: head dims of the state (V: the columns the kernels walk, `walked_columns`), each in
      `HEAD_DIMS`; 256 as `head_blocks` splits it, and K = 256 in the additive family only.
      chunk_size: C. dtype: the matmul operand dtype (bfloat16 or float16; the state is float32).
      packing: "none", "segments" or "cu_seqlens". delta: the call is of the delta family.
    backend: None is the running backend (a Hopper GPU, or any inside `interpret_kernels`);
      "hopper" takes a Hopper target as given.
    sharded: the operands are split over non-manual mesh axes (`common.explicitly_sharded`).
  """
  reason = hopper_reason(backend)
  if reason is not None:
    return reason
  if sharded:
    return ("the inputs are sharded over mesh axes and XLA cannot partition a Pallas kernel: run it under "
            "jax.shard_map (linear_attention_jax.sharding.shard_op)")
  if packing == "cu_seqlens":
    return "the GPU kernel does not take cu_seqlens (pass segment_ids instead)"
  if packing not in ("none", "segments"):
    return f"unknown packing {packing!r}"
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return (f"the GPU kernel takes bfloat16 or float16 operands (wgmma would run float32 as tf32), not "
            f"{jnp.dtype(dtype).name}; cast q, k, v or use the chunk form")
  if K not in HEAD_DIMS or V not in HEAD_DIMS:
    return f"the GPU kernel takes K and V in {HEAD_DIMS}; got K={K}, V={V}"
  if delta and K not in KERNEL_DIMS:
    return (f"the delta family's update (I - beta k k^T) mixes all K key channels, so its K does not "
            f"split into kernel blocks: the GPU kernels take its K in {KERNEL_DIMS}; got K={K}")
  K, V = head_blocks(K, V)
  if chunk_size not in CHUNK_SIZES:
    return f"the GPU kernel walks chunks of {CHUNK_SIZES} tokens; got chunk_size={chunk_size}"
  size = jnp.dtype(dtype).itemsize
  for backward in (False, True):
    need = smem_bytes(C=chunk_size, K=K, V=V, itemsize=size, delta=True, out_itemsize=size,
                      backward=backward)
    if need > SMEM_BYTES:
      return f"a program needs {need} bytes of shared memory, more than {SMEM_BYTES}"
  return None
