"""Packaging for linear_attention_jax."""

from setuptools import find_packages, setup

setup(
    name="linear_attention_jax",
    version="0.1.0",
    description="Linear attention in JAX/Flax: every variant as a recurrence, a chunked form and kernels.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The kernels live in the repository's pallas_kernels/ and install as linear_attention_jax.pallas_kernels
    # (no top-level name of their own); in a checkout the symlink linear_attention_jax/pallas_kernels
    # points there, so the one name serves both.
    packages=[*find_packages(include=["linear_attention_jax", "linear_attention_jax.*"],
                             exclude=["linear_attention_jax.pallas_kernels*"]),
              *(f"linear_attention_jax.{p}" for p in find_packages(include=["pallas_kernels*"]))],
    package_dir={"linear_attention_jax.pallas_kernels": "pallas_kernels"},
    python_requires=">=3.12",
    install_requires=[
        "jax>=0.11.2,<0.13",  # tested: 0.11.2 (the whole suite, CI); 0.12.0.1 (make test-newest-jax, CI)
        "flax",
        "optax",
        "orbax-checkpoint",
        "chex",
        "absl-py",
        "numpy",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "pytest-rerunfailures", "hypothesis", "nbclient", "nbformat",
                 "ipykernel"],  # the last three run notebooks/
        "experiments": ["matplotlib", "tqdm", "tensorboardX"],
        "docs": ["pdoc==16.0.0"],  # `make docs`: the API reference from the docstrings
    },
)
