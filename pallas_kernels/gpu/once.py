"""Each kernel traced and lowered once per process for each distinct call: `@lowered_once(...)` on the
functions that call `plgpu.kernel`.

A model of depth L calls the same kernels at the same shapes in each of its L layers, and without this
every layer traced each kernel's body and lowered it to Mosaic GPU again: for a KDA layer at
x `[8, 4096, 1024]` that is ~37 s a layer of a 2-core CPU's export (NOTES.md v60), on top of what the
device compiles. The decorated function runs inside a `jax.jit` whose static arguments are its
keyword-only parameters (less the named array ones): within one trace, the second layer's call of a
kernel with the same operand types and options finds the first one's jaxpr in jit's cache, and the
lowering of the enclosing program lowers it once and calls it from every layer (XLA inlines those calls
when it compiles; the Mosaic GPU custom call then compiles the one module once, as `shared_compiles`
does for modules lowered apart). The short convolutions' kernels (`conv.py`) were the first to be
jitted so (NOTES.md v47) and take this decorator too.

A jit cache does not see context: what a kernel reads at trace time must be among its arguments. The
kernel modules read one switch of their own, `tiles.phase_trace`'s records, which the wrapper passes as
a static argument; the interpreter's parameters (`interpret=`) and every option reach the kernels as
arguments already.
"""

from __future__ import annotations

import functools
import inspect

import jax

from . import tiles


def lowered_once(*, arrays: tuple[str, ...] = ()):
  """Decorator (module docstring): the decorated function's keyword-only parameters are static, except
  those named in `arrays` (arrays or None, e.g. `masks`), which are operands as the positional ones."""

  def decorate(fn):
    parameters = inspect.signature(fn).parameters
    unknown = set(arrays) - set(parameters)
    if unknown:
      raise ValueError(f"arrays names no parameter of {fn.__name__}: {sorted(unknown)}")
    static = tuple(name for name, p in parameters.items()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in arrays)

    def traced(*args, phases, **kwargs):
      del phases   # the key of `tiles.compiler_params`' records, read there at trace time
      return fn(*args, **kwargs)

    jitted = jax.jit(traced, static_argnames=static + ("phases",))

    @functools.wraps(fn)
    def call(*args, **kwargs):
      return jitted(*args, phases=tiles.phases_key(), **kwargs)

    return call

  return decorate
