"""One compile per distinct kernel: the same Mosaic GPU kernel at the same shapes in several layers of a
model, compiled once per process instead of once per layer.

The Mosaic GPU custom call caches compiled kernels by the SHA-256 of the serialized kernel module
(`kernel_hash`). Pallas stamps every kernel module it lowers with a `mosaic_gpu.dump_basename`
attribute that counts the kernels lowered so far (it names the files of `MOSAIC_GPU_DUMP`), so two
layers' identical kernels differ in that attribute alone, hash differently, and compile twice: an LM of
depth L spends L times one layer's kernel compile (an H200 measurement: a 4-layer KDA LM 331 s against
72-88 s for one layer; NOTES.md v43).

Since `once.lowered_once` a process traces and lowers each kernel once while jit's caches hold its
trace (every layer of a model, and later programs too), so identical calls carry one module already;
this still serves kernels lowered again after `jax.clear_caches()`.

`enable()` drops that attribute from each module before it is serialized and hashed, so identical
kernels hash (and compile) once; the dump's file names are then set where the custom call compiles.
It wraps one private function of jax (`jax.experimental.mosaic.gpu.core._mosaic_gpu_lowering_rule`)
for the whole process, which is why it is opt-in: call `enable()`, or set the environment variable
`LINEAR_ATTENTION_JAX_SHARE_KERNEL_COMPILES=1` before importing the library. `disable()` undoes it.
A jax without that function (or whose modules carry no such attribute) is left as it is.
"""

from __future__ import annotations

import functools
import os

ATTRIBUTE = "mosaic_gpu.dump_basename"
ENV = "LINEAR_ATTENTION_JAX_SHARE_KERNEL_COMPILES"
_original = None


def _core():
  try:
    from jax.experimental.mosaic.gpu import core
  except ImportError:   # a jax without Mosaic GPU: nothing to share
    return None
  return core if callable(getattr(core, "_mosaic_gpu_lowering_rule", None)) else None


def enabled() -> bool:
  return _original is not None


def enable() -> bool:
  """Installs the wrapper (module docstring); True when it is installed (now or before)."""
  global _original
  core = _core()
  if core is None:
    return False
  if _original is not None:
    return True
  original = core._mosaic_gpu_lowering_rule

  @functools.wraps(original)
  def lowering_rule(ctx, *args, module, **kwargs):
    attributes = module.operation.attributes
    if ATTRIBUTE in attributes:
      del attributes[ATTRIBUTE]
    return original(ctx, *args, module=module, **kwargs)

  core._mosaic_gpu_lowering_rule = lowering_rule
  _original = original
  return True


def disable():
  """Restores jax's own lowering rule."""
  global _original
  core = _core()
  if core is not None and _original is not None:
    core._mosaic_gpu_lowering_rule = _original
  _original = None


if os.environ.get(ENV, "") not in ("", "0"):
  enable()
