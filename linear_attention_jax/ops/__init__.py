"""Linear-attention ops: seven variants over two families, each as a recurrence and a chunked form.

Layout (fixed): `q, k: [B, T, H, K]`, `v: [B, T, H_v, V]`, scalar gates and beta `[B, T, H_v]`,
per-channel gates `[B, T, H_v, K]`, state `[B, H_v, K, V]` float32. Every op returns `(o, final_state)`.
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
