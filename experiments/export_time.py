"""How long a stack of mixer layers takes to trace and lower for a Hopper GPU, from any machine.

`jax.export` of the fwd+bwd of `--layers` copies of one mixer layer (`layer_benchmark.py`'s letters and
suffixes, impl "pallas", bfloat16 over float32 parameters) on x `[B, T, width]`, for CUDA under an
abstract H200: the trace and the Pallas -> Mosaic GPU lowering of every kernel, which a GPU process
pays before XLA's compile and ptxas (the part of a model's compile that grows with its depth unless
each kernel is lowered once: `pallas_kernels/gpu/once.py`). Prints, and writes to
`{workdir}/export_time.json`, the seconds and the count of Mosaic GPU custom calls in the module:

    python experiments/export_time.py --mixer=K --layers=1,2

Each count of layers runs after `jax.clear_caches()`. The kernels are not run (no GPU is needed).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
import jax
import jax.numpy as jnp
from flax import nnx

from experiments import layer_benchmark

flags.DEFINE_string("mixer", "K", f"Mixer layer: {layer_benchmark.MIXERS} (with layer_benchmark's suffixes).")
flags.DEFINE_list("layers", ["1", "2"], "Counts of layers to export, each in its turn.")
flags.DEFINE_integer("B", 8, "Batch.")
flags.DEFINE_integer("T", 4096, "Sequence length.")
flags.DEFINE_integer("width", 1024, "Model width.")
flags.DEFINE_integer("heads", 8, "Heads (K = width / heads).")
flags.DEFINE_string("workdir", "runs/export_time", "Where export_time.json goes.")
FLAGS = flags.FLAGS


@contextlib.contextmanager
def hopper_target():
  """Inside: the library plans and lowers its GPU kernels as on a Hopper GPU (whatever runs here), for
  an export to CUDA; its switches are restored after."""
  from jax.sharding import AbstractDevice, AbstractMesh

  from linear_attention_jax.ops import dispatch
  from linear_attention_jax.pallas_kernels.gpu import conv, plan
  saved = (dispatch.kernel_backend, plan.hopper_reason, conv.hopper_reason)
  hopper = plan.hopper_reason
  dispatch.kernel_backend = lambda: "gpu"
  plan.hopper_reason = lambda backend=None: hopper("hopper")
  conv.hopper_reason = lambda backend=None: None
  mesh = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu",
                                                             num_cores=132))
  try:
    with jax.sharding.use_abstract_mesh(mesh):
      yield
  finally:
    dispatch.kernel_backend, plan.hopper_reason, conv.hopper_reason = saved


def export_layers(mixer: str, count: int, *, B: int, T: int, width: int, heads: int) -> dict:
  """Exports the fwd+bwd of `count` residual layers of `mixer` for CUDA (module docstring)."""
  jax.clear_caches()
  options = layer_benchmark.kernel_options(mixer)
  if options is None:
    raise ValueError(f"mixer: unknown suffix in {mixer!r}")
  from linear_attention_jax.pallas_kernels import gpu
  config = gpu.default_config(gpu.GpuConfig(**options)) if options else contextlib.nullcontext()
  with hopper_target(), config:
    stack = nnx.List([layer_benchmark.build(mixer, width=width, heads=heads, impl="pallas",
                                            dtype=jnp.bfloat16) for _ in range(count)])
    graphdef, params = nnx.split(stack)

    def loss(params, x):
      for layer in nnx.merge(graphdef, params):
        x = x + layer(x)[0]
      return jnp.sum(x.astype(jnp.float32) ** 2)

    start = time.perf_counter()
    exported = jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"])(
        params, jax.ShapeDtypeStruct((B, T, width), jnp.bfloat16))
    text = exported.mlir_module()
    seconds = time.perf_counter() - start
  return dict(mixer=mixer, layers=count, B=B, T=T, width=width, heads=heads, export_s=seconds,
              mosaic_gpu_calls=text.count("custom_call @mosaic_gpu"), module_mb=len(text) / 1e6)


def main(argv):
  del argv
  os.makedirs(FLAGS.workdir, exist_ok=True)
  rows = []
  for count in (int(n) for n in FLAGS.layers):
    rows.append(export_layers(FLAGS.mixer, count, B=FLAGS.B, T=FLAGS.T, width=FLAGS.width,
                              heads=FLAGS.heads))
    print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(FLAGS.workdir, "export_time.json"), "w") as f:
      json.dump(dict(jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main)
