"""Pallas kernels for the chunked forms of linear attention; depends only on jax.

- `prep`: the per-chunk tensors of both families (XLA), shared by every backend.
- `vjp`: the custom_vjp that joins the preparation and a backend's chunk walk into one op.
- `sharding`: a backend's op under `jax.shard_map`.
- `tpu`: Mosaic TPU kernels for the walk (`pallas_kernels.tpu.chunked_attention`).
- `gpu`: Mosaic GPU (Hopper) kernels for the walk (`pallas_kernels.gpu.chunked_attention`).
"""
