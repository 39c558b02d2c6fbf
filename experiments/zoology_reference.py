"""Zoology's published MQAR results, to set beside ours (experiments/mqar.py, config mqar_zoology).

Source: the "Recall-Memory Tradeoff" figure of the zoology repository's README,
`zoology/analysis/paper/zoology_paper/zoology_results.png` (HazyResearch/zoology, commit d88d6f5), made
by `zoology/analysis/mqar_plotting_example.py` from the sweep
`zoology/experiments/mqar_example_configs/original_mqar_configs.py`: two-layer models (a BaseConv layer,
then the mixer), vocabulary 8192, each model at the best of four learning rates, y = `valid/accuracy`
(the mean over the seven test sets), x = state bytes (`zoology/model.py::_compute_state_size`: the
mixers' `state_size` at the longest test length, 1024, summed over both layers, times 4).

The figure gives no numbers: the accuracies below are read off the plot (about +-0.02), each point
identified by its x, which the mixers' `state_size` (zoology/mixers/*.py) gives exactly for each width:

- DeltaNet (`delta_net.py`, 2 heads, K = V = d/2): 4 (d^2/2 + 3d)
- Gated DeltaNet (`gated_delta_net.py`, 2 heads, expand_v = 2: V = 2K = d): 4 (d^2 + 3d)
- GLA (`gla.py`, 2 heads, expand_k = 0.5, expand_v = 1; `state_size` = key_dim * head_v_dim =
  d/2 * d/2): 4 (d^2/4 + 3d)
- attention (`attention.py`: 2 d T at T = 1024): 4 (2048 d + 3d)

where 3d is the BaseConv layer's short convolution (`convolution.py::ShortConvolution`, kernel 3).
The paper (Arora et al. 2023, arXiv 2312.04927) reports only attention and gated convolutions among
our mixers; linear attention, RetNet and KDA have no published point here.
"""

from __future__ import annotations

SOURCE = ("zoology README figure zoology/analysis/paper/zoology_paper/zoology_results.png "
          "(HazyResearch/zoology d88d6f5), read off the plot, +-0.02")

# our model name -> zoology's mixer name
MIXERS = {"attention": "Attention", "deltanet": "DeltaNet", "gated_deltanet": "Gated DeltaNet",
          "gla": "GLA"}

# (our model name, width) -> (zoology's accuracy, zoology's state bytes)
PUBLISHED = {
    ("deltanet", 64): (0.79, 4 * (64 * 64 // 2 + 3 * 64)),
    ("deltanet", 128): (0.96, 4 * (128 * 128 // 2 + 3 * 128)),
    ("deltanet", 256): (0.99, 4 * (256 * 256 // 2 + 3 * 256)),
    ("gated_deltanet", 64): (0.89, 4 * (64 * 64 + 3 * 64)),
    ("gated_deltanet", 128): (0.99, 4 * (128 * 128 + 3 * 128)),
    ("gated_deltanet", 256): (0.99, 4 * (256 * 256 + 3 * 256)),
    ("gla", 64): (0.53, 4 * (32 * 32 + 3 * 64)),
    ("gla", 128): (0.77, 4 * (64 * 64 + 3 * 128)),
    ("gla", 256): (0.95, 4 * (128 * 128 + 3 * 256)),
    ("attention", 64): (1.00, 4 * (2048 * 64 + 3 * 64)),
    ("attention", 128): (1.00, 4 * (2048 * 128 + 3 * 128)),
}

# zoology's vocabulary and test sets (original_mqar_configs.py): a comparison needs both
VOCAB = 8192
TEST_SETTINGS = ((64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256))

FLAG_ABOVE = 0.03  # |ours - zoology's| above this is flagged in the table


def lookup(model: str, width: int, vocab_size: int, test_settings) -> tuple[float, int] | None:
  """Zoology's `(accuracy, state bytes)` for our model name at this width, or None (also when the
  vocabulary or the test sets are not zoology's: the numbers would not measure the same thing)."""
  if vocab_size != VOCAB or tuple(map(tuple, test_settings)) != TEST_SETTINGS:
    return None
  return PUBLISHED.get((model, width))
