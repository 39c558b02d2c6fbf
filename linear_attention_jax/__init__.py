"""linear_attention_jax: linear attention in JAX, every variant as a recurrence and a chunked form."""

from linear_attention_jax import ops
from linear_attention_jax.debug import debug_checks

__version__ = "0.1.0"
__all__ = ["debug_checks", "ops"]
