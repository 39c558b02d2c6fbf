"""ShortConvolution: a causal depthwise convolution over time with a small window (default 4).

The linear mixers of the delta family (DeltaNet, Gated DeltaNet, KDA) put one in front of the recurrence on
each of q, k and v: it mixes each channel with its own last few inputs, which gives the layer cheap local
context (token shifts, n-grams) that the compressed state is bad at. For a window of W taps

    y_t = act( sum_{w < W} kernel[w] * x_{t - W + 1 + w} + bias )

with x_s = 0 before the sequence start, or the cached inputs when decoding continues a sequence. The
cache is the last `W - 1` inputs, so a decode step is exact, not an approximation.

`impl`: "xla" (the shifted sum, autodiff'd by XLA), "pallas" (two Mosaic GPU kernels on Hopper,
`linear_attention_jax.pallas_kernels.gpu.conv`: each pass reads its inputs once; raises where they do
not serve the call, saying why) or "auto" (the kernels where they serve the call, else the shifted sum).
The mixers pass "auto" when their own impl is "pallas" or "auto", else "xla". Under
`sharding.use_rules` the kernels run per device (`jax.shard_map` over batch rows and channels); a
sequence split takes the shifted sum, which XLA partitions.

`joined_kernel_call`: a mixer's q, k and v convolutions as one kernel call over their inputs laid side
by side (one joined projection), each output its own array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax.pallas_kernels.gpu import conv as conv_kernels
from linear_attention_jax.sharding.rules import axes, axis_size, current_rules, to_spec

ACTIVATIONS = {"silu": jax.nn.silu, "swish": jax.nn.silu, "identity": lambda x: x}
IMPLS = ("xla", "pallas", "auto")


class ShortConvolution(nnx.Module):
  """Causal depthwise conv over T with `kernel_size` taps and an activation (SiLU by default).

  Attributes:
    kernel: `[W, D]` param, tap w multiplies the input `W - 1 - w` steps back.
    bias: `[D]` param or None.

  `axis`: the logical axis of D ("heads" for a mixer's q/k/v channels), for the sharding rules.
  """

  def __init__(self, features: int, kernel_size: int = 4, *, use_bias: bool = False,
               activation: str = "silu", axis: str | None = None, impl: str = "auto",
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not isinstance(kernel_size, int) or kernel_size < 1:
      raise ValueError(f"kernel_size (the conv width) must be an integer >= 1; got {kernel_size!r}")
    if features < 1:
      raise ValueError(f"features must be >= 1; got {features=}")
    if activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}; got {activation!r}")
    if impl not in IMPLS:
      raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    self.features, self.kernel_size, self.activation = features, kernel_size, activation
    self.impl, self.axis = impl, axis
    self.dtype = dtype
    # PyTorch's Conv1d default for a depthwise conv: U(-1/sqrt(W), 1/sqrt(W)), fan-in W.
    bound = kernel_size ** -0.5
    self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, features), param_dtype,
                                               -bound, bound), **axes(None, axis))
    self.bias = nnx.Param(jnp.zeros((features,), param_dtype), **axes(axis)) if use_bias else None

  def init_cache(self, batch: int) -> jax.Array:
    """Zero window `[B, W - 1, D]` float32: the sequence starts here."""
    return jnp.zeros((batch, self.kernel_size - 1, self.features), jnp.float32)

  def state_size(self) -> int:
    """Elements of the window per sequence: `(W - 1) * D`."""
    return (self.kernel_size - 1) * self.features

  def __call__(self, x: jax.Array, cache: jax.Array | None = None, *, channels: jax.Array | None = None):
    """Convolves `x` along T.

    Args:
      x: `[B, T, D]`.
      cache: `[B, W - 1, D]` (the inputs before x, float32) or None (zeros before x).
      channels: None, or `[D]` int32, a permutation: x's channel i is the module's channel
        `channels[i]` (its kernel and bias taken in that order; a caller that ordered its projection's
        columns so). Only without a cache (the windows would be in the module's order).

    Returns:
      `(y, new_cache)`: `y: [B, T, D]` in the layer dtype; `new_cache: [B, W - 1, D]` float32 holding
      the last `W - 1` inputs (cache included), or None when `cache` is None.
    """
    if x.ndim != 3 or x.shape[-1] != self.features:
      raise ValueError(f"x must have shape [B, T, D] with D={self.features}; got {x.shape}")
    B, T, D = x.shape
    W = self.kernel_size
    if cache is not None and cache.shape != (B, W - 1, D):
      raise ValueError(f"cache must have shape [B, W - 1, D] = {(B, W - 1, D)}; got {cache.shape}")
    if channels is not None and (cache is not None or jnp.shape(channels) != (D,)):
      raise ValueError(f"channels must be None or a permutation of shape [D] = [{D}], and only without a "
                       f"cache; got shape {jnp.shape(channels)} with cache={cache is not None}")
    history = jnp.zeros((B, W - 1, D), jnp.float32) if cache is None else cache.astype(jnp.float32)
    kernel, bias = self.taps(channels)
    kernel_call = self._kernel_call(x)
    if kernel_call is not None:
      y = kernel_call(x, kernel, jnp.zeros((D,), jnp.float32) if bias is None else bias, history)
      if cache is None:
        return y, None
      return y, jnp.concatenate([history, x.astype(jnp.float32)], axis=1)[:, T:]
    x32 = x.astype(jnp.float32)
    padded = jnp.concatenate([history, x32], axis=1)  # [B, W - 1 + T, D]
    y = sum(padded[:, w:w + T] * kernel[w] for w in range(W))
    if bias is not None:
      y = y + bias
    y = ACTIVATIONS[self.activation](y).astype(self.dtype)
    return y, (None if cache is None else padded[:, T:])

  def taps(self, channels: jax.Array | None = None):
    """`(kernel [W, D], bias [D] or None)` in float32, the channels in `channels`' order (None: as
    they are; see `__call__`)."""
    take = (lambda p: p) if channels is None else (lambda p: jnp.take(p, channels, axis=-1))
    return take(self.kernel[...].astype(jnp.float32)), (None if self.bias is None
                                                        else take(self.bias[...].astype(jnp.float32)))

  def kernel_reason(self, x_shape, dtype) -> str | None:
    """None if the Mosaic GPU kernels serve a call on `x: [B, T, D]` of `dtype` (on this backend, per
    device under sharding rules), else why not."""
    shape = tuple(x_shape)
    split = self._split()
    if split is not None and len(shape) == 3:
      mesh, b, s, d = split
      if axis_size(mesh, s) > 1:
        return "the sequence is split over devices: the kernels keep no windows across shards"
      shape = (shape[0] // axis_size(mesh, b), shape[1], shape[2] // axis_size(mesh, d))
    return conv_kernels.reason(shape, self.kernel_size, self._kernel_activation, dtype)

  @property
  def _kernel_activation(self) -> str:
    return "silu" if self.activation == "swish" else self.activation

  def _split(self):
    """Under `sharding.use_rules`: `(mesh, batch, seq, channel)` mesh axes of x; else None."""
    rules = current_rules()
    if rules is None:
      return None
    mesh, table = rules
    return (mesh, *to_spec(("batch", "seq", self.axis), table, mesh))

  def _kernel_call(self, x):
    """The kernels' function `(x, kernel, bias, history) -> y` for this call, or None for the shifted
    sum (impl "xla", or "auto" where the kernels do not serve it)."""
    if self.impl == "xla":
      return None
    why = self.kernel_reason(x.shape, x.dtype)
    if why is not None:
      if self.impl == "pallas":
        raise ValueError(f"ShortConvolution(impl='pallas') cannot serve x of shape {x.shape}: {why}")
      return None
    call = lambda x, k, b, h: conv_kernels.short_conv(x, k, b, h, activation=self._kernel_activation,
                                                      out_dtype=self.dtype)
    split = self._split()
    if split is None:
      return call
    mesh, b, _, d = split
    rows = jax.sharding.PartitionSpec(b, None, d)
    return jax.shard_map(call, mesh=mesh, out_specs=rows,
                         in_specs=(rows, jax.sharding.PartitionSpec(None, d),
                                   jax.sharding.PartitionSpec(d), rows))


def joined_kernel_call(convs: tuple[ShortConvolution, ...], x_shape, dtype):
  """One kernel call for the convolutions `convs` (a mixer's q, k, v) on their inputs laid side by side,
  x `[B, T, sum of features]` of `dtype`: `(x, channels) -> (y_i [B, T, features_i] in the convs'
  dtype, ...)`, `channels` one permutation or None a conv (as `ShortConvolution.__call__` takes it),
  from zeros before the sequence, each conv with its own taps; its backward gives x's gradient joined.
  None where it cannot serve the call: any conv's impl "xla", convs unlike in taps, activation, dtype
  or sharding axis, no kernel for the shape (`conv_kernels.reason` with the splits), or the channels
  or the sequence split over devices; the convolutions then run one by one, as the same sums."""
  first = convs[0]
  like = lambda c: (c.kernel_size, c.activation, jnp.dtype(c.dtype), c.axis)
  if any(c.impl == "xla" or like(c) != like(first) for c in convs):
    return None
  splits = tuple(c.features for c in convs)
  shape = tuple(x_shape)
  if len(shape) != 3 or shape[2] != sum(splits):
    return None
  split = first._split()
  if split is not None:
    mesh, b, s, d = split
    if axis_size(mesh, s) > 1 or axis_size(mesh, d) > 1:
      return None
    shape = (shape[0] // axis_size(mesh, b), shape[1], shape[2])
  W = first.kernel_size
  if conv_kernels.reason(shape, W, first._kernel_activation, dtype, splits=splits) is not None:
    return None

  def kernels(x, kernel, bias):
    head = jnp.zeros((x.shape[0], W - 1, x.shape[2]), jnp.float32)
    return conv_kernels.short_conv(x, kernel, bias, head, activation=first._kernel_activation,
                                   out_dtype=first.dtype, splits=splits)

  if split is not None:
    P = jax.sharding.PartitionSpec
    rows = P(split[1], None, None)
    kernels = jax.shard_map(kernels, mesh=split[0], out_specs=(rows,) * len(convs),
                            in_specs=(rows, P(None, None), P(None)))

  def call(x, channels):
    taps = [c.taps(ch) for c, ch in zip(convs, channels)]
    bias = [jnp.zeros((c.features,), jnp.float32) if b is None else b for c, (_, b) in zip(convs, taps)]
    return kernels(x, jnp.concatenate([k for k, _ in taps], axis=1), jnp.concatenate(bias))

  return call
