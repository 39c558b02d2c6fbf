"""Pallas kernels for the chunked forms of linear attention; depends only on jax.

Imported as `linear_attention_jax.pallas_kernels` (the repository's `pallas_kernels/`, linked there in a
checkout and installed there by setup.py); the package takes no top-level name of its own.

- `prep`: the per-chunk tensors of both families (XLA), shared by every backend.
- `vjp`: the custom_vjp that joins the preparation and a backend's chunk walk into one op.
- `tpu`: Mosaic TPU kernels for the walk (`linear_attention_jax.pallas_kernels.tpu.chunked_attention`).
- `gpu`: Mosaic GPU (Hopper) kernels for the walk (`linear_attention_jax.pallas_kernels.gpu.chunked_attention`).
"""

if __name__ != "linear_attention_jax.pallas_kernels":  # one module, one interpreter switch
  raise ImportError(f"import linear_attention_jax.pallas_kernels, not {__name__}: a second copy of the "
                    "kernels would carry its own interpret_kernels() switches")

