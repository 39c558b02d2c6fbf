"""What every linear mixer shares: head sizes, the q/k/v projections and short convolutions, the choice
between the full-sequence op and the one-token step, the cache and `state_size`.

A mixer subclass computes its gates and output path and calls `self._recur(op, step, ...)`, which runs

  cache None        the full-sequence op, `impl=self.impl` (training)
  cache, T > 1      the full-sequence op from `initial_state=cache.state` with `output_final_state=True`
                    (prefill, also of a sequence already under way)
  cache, T == 1     the op's one-token step function (decoding)

Layout of a mixer's tensors: x `[B, T, width]`; q, k `[B, T, H, K]`; v `[B, T, H_v, V]` with
`H_v % H == 0`; gates and beta follow v's heads; the state `[B, H_v, K, V]` is float32 whatever the
layer dtype.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention_jax import ops
from linear_attention_jax.layers.cache import LinearCache
from linear_attention_jax.layers.conv import ShortConvolution, joined_kernel_call
from linear_attention_jax.sharding import for_current_rules
from linear_attention_jax.sharding.rules import axes as logical_axes


def a_log_init(key, shape, dtype=jnp.float32, low: float = 1.0, high: float = 16.0):
  """`log A` with A ~ U(low, high): the per-head decay rate of Mamba-2, Gated DeltaNet and KDA."""
  return jnp.log(jax.random.uniform(key, shape, jnp.float32, low, high)).astype(dtype)


def dt_bias_init(key, shape, dtype=jnp.float32, dt_min: float = 1e-3, dt_max: float = 0.1,
                 dt_floor: float = 1e-4):
  """Inverse softplus of dt ~ logU(dt_min, dt_max) floored at dt_floor, so softplus(dt_bias) = dt."""
  u = jax.random.uniform(key, shape, jnp.float32)
  dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), dt_floor)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def linear(width_in, width_out, *, use_bias=False, axes=None, dtype, param_dtype, rngs):
  """A dense projection `[..., width_in] -> [..., width_out]` in the layer dtype.

  `axes`: the logical axes (`sharding.LOGICAL_AXES`) of the kernel `[width_in, width_out]`; the bias
  takes the second.
  """
  meta = {} if axes is None else dict(kernel_metadata=logical_axes(*axes),
                                      bias_metadata=logical_axes(axes[1]))
  return nnx.Linear(width_in, width_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                    rngs=rngs, **meta)


def dense_columns(layer: nnx.Linear, x, columns):
  """`layer(x)[..., columns]`, computed as the projection onto those columns of its kernel (and bias):
  the same products, in the layer's dtypes and precision, with gradients to the whole kernel."""
  return dense_joined((layer,), x, (columns,))


def dense_joined(layers: tuple[nnx.Linear, ...], x, columns=None):
  """`concatenate([layer(x)[..., cols] for layer, cols in zip(layers, columns)], -1)` as one product
  onto the layers' kernels side by side (columns: None for all of each, or per layer None or `[n]`
  int32), in the first layer's dtypes, precision and dot_general (the layers must agree in them);
  gradients reach every kernel (and bias)."""
  first = layers[0]
  columns = (None,) * len(layers) if columns is None else columns
  take = lambda p, c: p if c is None else jnp.take(p, c, axis=-1)
  kernels = [take(layer.kernel[...], c) for layer, c in zip(layers, columns)]
  biases = [None if layer.bias is None else take(layer.bias[...], c) for layer, c in zip(layers, columns)]
  if any(b is not None for b in biases):   # a layer without one adds zeros for its columns
    biases = [jnp.zeros((k.shape[1],), k.dtype) if b is None else b for k, b in zip(kernels, biases)]
  x, *params = first.promote_dtype((x, *kernels, *biases), dtype=first.dtype)
  kernels, biases = params[:len(layers)], params[len(layers):]
  kernel = kernels[0] if len(kernels) == 1 else jnp.concatenate(kernels, axis=1)
  bias = None if biases[0] is None else (biases[0] if len(biases) == 1 else jnp.concatenate(biases))
  kw = ({} if first.preferred_element_type is None
        else dict(preferred_element_type=first.preferred_element_type))
  y = first.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=first.precision, **kw)
  return y if bias is None else y + bias


def _dense_like(layer: nnx.Linear):
  """What projections must share to run as one product: dtype, precision, dot_general, output type."""
  return layer.dtype, layer.precision, layer.dot_general, layer.preferred_element_type


def dense_shared_input(layers: tuple[nnx.Linear, ...], x) -> tuple[jax.Array, ...]:
  """`tuple(layer(x) for layer in layers)`, each its own product in the forward, with x's cotangent
  taken as one product of the outputs' cotangents side by side onto the kernels side by side: one
  `[..., width]` array written, where each layer's own would write one and a sum would read them all
  again. The kernels' gradients come from one product as well. The same sums, in the layers' dtypes
  and precision; layers unlike in those (or with their own `dot_general`) run one by one."""
  first = layers[0]
  if (len(layers) == 1 or any(_dense_like(p) != _dense_like(first) for p in layers)
      or first.dot_general is not jax.lax.dot_general):
    return tuple(layer(x) for layer in layers)
  kernels = [layer.kernel[...] for layer in layers]
  biases = [layer.bias[...] if layer.bias is not None else None for layer in layers]
  x, *kernels = first.promote_dtype((x, *kernels), dtype=first.dtype)
  ys = _shared_input_products((first.precision, first.preferred_element_type), x, tuple(kernels))
  return tuple(y if b is None else y + b.astype(y.dtype) for y, b in zip(ys, biases))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _shared_input_products(options, x, kernels):
  precision, preferred = options
  kw = {} if preferred is None else dict(preferred_element_type=preferred)
  contract = (((x.ndim - 1,), (0,)), ((), ()))
  return tuple(jax.lax.dot_general(x, w, contract, precision=precision, **kw) for w in kernels)


def _shared_input_fwd(options, x, kernels):
  return _shared_input_products(options, x, kernels), (x, kernels)


def _shared_input_bwd(options, residuals, dys):
  precision, _ = options
  x, kernels = residuals
  dy = jnp.concatenate([d.astype(x.dtype) for d in dys], axis=-1)
  kernel = jnp.concatenate(kernels, axis=1)
  dx = jax.lax.dot_general(dy, kernel, (((dy.ndim - 1,), (1,)), ((), ())), precision=precision)
  rows = tuple(range(x.ndim - 1))
  # the kernels' gradient from x behind a barrier: XLA merges products that share an operand, and would
  # take this one into a wide projection's (q, k, v's), copying that projection's [rows, n] cotangent
  # into one with these columns appended (a KDA step with f_down and g_down joined: 0.59 ms, NOTES.md v76)
  dkernel = jax.lax.dot_general(jax.lax.optimization_barrier(x), dy, ((rows, rows), ((), ())),
                                precision=precision)
  ends = list(itertools.accumulate(w.shape[1] for w in kernels))
  dkernels = tuple(part.astype(w.dtype) for part, w in zip(jnp.split(dkernel, ends[:-1], axis=1), kernels))
  return dx, dkernels


_shared_input_products.defvjp(_shared_input_fwd, _shared_input_bwd)


_NO_CONV_ACTIVATIONS = {"identity": lambda x: x, "silu": jax.nn.silu}


class LinearMixer(nnx.Module):
  """Base of the linear mixers; not used on its own.

  Head sizes: every mixer defaults to `K = width / H` and `V = K`, the sizes `LMConfig` gives it, so a
  layer built alone is the layer an LM builds (one default per layer). The papers that widen values
  (RetNet, GLA, Gated DeltaNet: `V = 2K`) or narrow keys (GLA: `K = width / 2H`) get their shapes from
  `head_dim=` and `head_v_dim=`, in the layer and in `LMConfig` alike.

  Class attribute a subclass may set:
    no_conv_activation: applied to q, k, v when the short convolutions are off ("silu" for the delta
      family, whose convolutions end in SiLU).
    join_projections: with short convolutions on the kernels and no cache, q, k and v come from one
      product onto their kernels side by side and one convolution call (`_project_joined`); False
      (on a class or an instance) keeps three of each. The same sums either way.
  """
  no_conv_activation: str = "identity"
  join_projections: bool = True

  def __init__(self, width: int, num_heads: int, *, num_v_heads: int | None, head_dim: int | None,
               head_v_dim: int | None, use_short_conv: bool, conv_size: int, impl: str,
               chunk_size: int, dtype, param_dtype, rngs: nnx.Rngs, state_extra: int = 0):
    if width < 1 or num_heads < 1:
      raise ValueError(f"width and num_heads must be >= 1; got {width=} {num_heads=}")
    H = num_heads
    Hv = H if num_v_heads is None else num_v_heads
    if Hv < 1 or Hv % H:
      raise ValueError(f"num_v_heads={Hv} must be a positive multiple of num_heads={H}")
    if head_dim is None:
      if width % H:
        raise ValueError(f"width={width} must be divisible by num_heads={H}, or pass head_dim")
      head_dim = width // H
    if head_v_dim is None:
      head_v_dim = head_dim
    if head_dim < 1 or head_v_dim < 1:
      raise ValueError(f"head dims must be >= 1; got {head_dim=} {head_v_dim=}")
    if not isinstance(conv_size, int) or conv_size < 1:
      raise ValueError(f"conv_size must be an integer >= 1; got {conv_size!r}")
    if impl not in ops.IMPLS:
      raise ValueError(f"impl must be one of {ops.IMPLS}; got {impl!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1 or chunk_size & (chunk_size - 1):
      raise ValueError(f"chunk_size must be a positive power of two; got {chunk_size!r}")
    self.width, self.num_heads, self.num_v_heads = width, H, Hv
    self.head_dim, self.head_v_dim, self.state_extra = head_dim, head_v_dim, state_extra
    self.impl, self.chunk_size, self.dtype = impl, chunk_size, dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = linear(width, H * head_dim, axes=("embed", "heads"), **kw)
    self.k_proj = linear(width, H * head_dim, axes=("embed", "heads"), **kw)
    self.v_proj = linear(width, Hv * head_v_dim, axes=("embed", "heads"), **kw)
    if use_short_conv:   # the convolutions' kernels where the op's kernels are wanted
      kw["impl"] = "auto" if impl in ("pallas", "auto") else "xla"
      self.q_conv = ShortConvolution(H * head_dim, conv_size, axis="heads", **kw)
      self.k_conv = ShortConvolution(H * head_dim, conv_size, axis="heads", **kw)
      self.v_conv = ShortConvolution(Hv * head_v_dim, conv_size, axis="heads", **kw)
    else:
      self.q_conv = self.k_conv = self.v_conv = None

  @property
  def convs(self) -> tuple[ShortConvolution, ...]:
    return () if self.q_conv is None else (self.q_conv, self.k_conv, self.v_conv)

  def init_cache(self, batch: int, max_len: int | None = None) -> LinearCache:
    """A fresh cache for `batch` sequences; `max_len` is accepted for a uniform API and unused."""
    H_v, K, V = self.num_v_heads, self.head_dim, self.head_v_dim + self.state_extra
    return LinearCache(state=jnp.zeros((batch, H_v, K, V), jnp.float32),
                       conv=tuple(c.init_cache(batch) for c in self.convs),
                       pos=jnp.zeros((), jnp.int32))

  def state_size(self, seq_len: int | None = None) -> int:
    """State elements per sequence, independent of `seq_len`: `H_v K V` plus the conv windows."""
    recurrent = self.num_v_heads * self.head_dim * (self.head_v_dim + self.state_extra)
    return recurrent + sum(c.state_size() for c in self.convs)

  def _check_input(self, x, cache):
    if x.ndim != 3 or x.shape[-1] != self.width:
      raise ValueError(f"x must have shape [B, T, width] with width={self.width}; got {x.shape}")
    if cache is not None and not isinstance(cache, LinearCache):
      raise ValueError(f"cache must be a LinearCache (from init_cache) or None; got {type(cache)}")
    if cache is not None and cache.state.shape[0] != x.shape[0]:
      raise ValueError(f"cache holds B={cache.state.shape[0]} sequences; x has B={x.shape[0]}")
    return x.shape[0], x.shape[1]

  def _project(self, x, cache, key_columns=None):
    """Projections and short convolutions.

    Returns `(q [B, T, H, K], k [B, T, H, K], v [B, T, H_v, V], windows)`, where `windows` is the tuple
    of new conv windows (empty without convs; Nones when `cache` is None). `key_columns`: None, or
    `[H * K]` int32, a permutation of q's and k's columns (their projections' and convolutions'
    channels taken in that order; only without a cache).
    """
    B, T, _ = x.shape
    H, Hv = self.num_heads, self.num_v_heads
    joined = self._project_joined(x, key_columns) if cache is None else None
    if joined is not None:
      q, k, v = joined
      return (q.reshape(B, T, H, self.head_dim), k.reshape(B, T, H, self.head_dim),
              v.reshape(B, T, Hv, self.head_v_dim), (None, None, None))
    if key_columns is None:
      q, k = self.q_proj(x), self.k_proj(x)
    else:
      q, k = dense_columns(self.q_proj, x, key_columns), dense_columns(self.k_proj, x, key_columns)
    v = self.v_proj(x)
    windows = ()
    if self.q_conv is not None:
      old = (None, None, None) if cache is None else cache.conv
      order = (key_columns, key_columns, None)
      (q, wq), (k, wk), (v, wv) = (conv(z, w) if c is None else conv(z, w, channels=c)
                                   for conv, z, w, c in zip(self.convs, (q, k, v), old, order))
      windows = (wq, wk, wv)
    else:
      act = _NO_CONV_ACTIVATIONS[self.no_conv_activation]
      q, k, v = act(q), act(k), act(v)
    return (q.reshape(B, T, H, self.head_dim), k.reshape(B, T, H, self.head_dim),
            v.reshape(B, T, Hv, self.head_v_dim), windows)

  def _project_joined(self, x, key_columns):
    """`(q, k, v)`, each `[B, T, channels]`, from one projection onto q's, k's and v's kernels side by
    side and one call of the convolutions' kernels that writes each apart (`joined_kernel_call`; its
    backward gives the projection's cotangent joined, so x's gradient is one product, not three
    added); None where that call cannot serve (no convolutions, `join_projections` off, or see
    `joined_kernel_call`), and `_project` runs them one by one. Without a cache only: the same sums."""
    projections = (self.q_proj, self.k_proj, self.v_proj)
    if (not self.join_projections or self.q_conv is None
        or any(_dense_like(p) != _dense_like(self.q_proj) for p in projections)):
      return None
    dtype = self.q_proj.dtype
    dtype = jnp.dtype(jnp.result_type(x.dtype, self.q_proj.kernel.dtype) if dtype is None else dtype)
    call = joined_kernel_call(self.convs, (*x.shape[:2], sum(c.features for c in self.convs)), dtype)
    if call is None:
      return None
    columns = (key_columns, key_columns, None)
    return call(dense_joined(projections, x, columns), columns)

  def _recur(self, op, step, q, k, v, gates, cache, **kwargs):
    """Runs the op (training, prefill) or its step (decode; see the module docstring).

    `gates`: the op's positional gate arguments after v (`[B, T, H_v]` or `[B, T, H_v, K]`), in order.
    Returns `(o [B, T, H_v, V] in v's dtype, new state [B, H_v, K, V] float32 or None)`.
    """
    if cache is None:  # under `sharding.use_rules(mesh, rules)` the op runs under shard_map
      o, _ = for_current_rules(op)(q, k, v, *gates, impl=self.impl, chunk_size=self.chunk_size,
                                   **kwargs)
      return o, None
    if q.shape[1] == 1:
      o, state = step(q[:, 0], k[:, 0], v[:, 0], *(g[:, 0] for g in gates), cache.state, **kwargs)
      return o[:, None], state
    return op(q, k, v, *gates, initial_state=cache.state, output_final_state=True, impl=self.impl,
              chunk_size=self.chunk_size, **kwargs)

  @staticmethod
  def _advance(cache, state, windows, num_tokens):
    return None if cache is None else cache.advance(state, windows, num_tokens)

  def _positions(self, cache, T):
    """Absolute positions `[T]` int32 of this call's tokens."""
    start = jnp.zeros((), jnp.int32) if cache is None else cache.pos
    return start + jnp.arange(T, dtype=jnp.int32)
