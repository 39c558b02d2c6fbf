"""Pallas kernels (Mosaic GPU and Mosaic TPU) for the chunked forms; depends only on jax."""
