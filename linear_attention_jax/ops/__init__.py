"""Linear-attention ops: seven variants over two families, each as a recurrence and a chunked form.

Layout (fixed): `q, k: [B, T, H, K]`, `v: [B, T, H_v, V]`, scalar gates and beta `[B, T, H_v]`,
per-channel gates `[B, T, H_v, K]`, state `[B, H_v, K, V]` float32. Every op returns `(o, final_state)`.

Non-finite inputs (README, "Non-finite inputs"):

- `g = -inf` forgets everything in every impl: the recurrent scan takes g as given, every other form
  floors it at `pallas_kernels.prep.LOG_DECAY_FLOOR` (-20, gradient 0 below; `dispatch.gate_for`), which
  keeps the chunk-local cumulative decay finite and small. Results match the scan to float32 rounding,
  for -inf and for huge finite gates (-1e4, -1e5) alike.
- A NaN in v at token t reaches, in its row: recurrent, tokens >= t of its own sequence; chunk, the
  chunk holding t from the chunk's start and every later token, except that with `cu_seqlens` only t's
  own sequence is reached and with `segment_ids` a document that starts in a later chunk than every
  reached token is not; pallas, the chunk holding t from its start and every later token of the row
  (with or without `segment_ids`). A NaN in g reaches no more than that; a NaN in q only `o_t`.
"""

from linear_attention_jax.ops.checks import IMPLS
from linear_attention_jax.ops.feature_maps import FEATURE_MAPS, l2_normalize
from linear_attention_jax.ops.step import (delta_rule_step, gated_delta_rule_step, gla_step, kda_step,
                                           linear_attention_step, retention_step, simple_gla_step)
from linear_attention_jax.ops.variants import (delta_rule, gated_delta_rule, gla, kda, linear_attention,
                                               retention, select_impl, simple_gla)

VARIANTS = ("linear_attention", "retention", "simple_gla", "gla", "delta_rule", "gated_delta_rule",
            "kda")

__all__ = [
    "FEATURE_MAPS", "IMPLS", "VARIANTS", "delta_rule", "delta_rule_step", "gated_delta_rule",
    "gated_delta_rule_step", "gla", "gla_step", "kda", "kda_step", "l2_normalize", "linear_attention",
    "linear_attention_step", "retention", "retention_step", "select_impl", "simple_gla",
    "simple_gla_step",
]
