"""Decode latency and cache bytes from 1K to 64K tokens: a linear model, an attention model, a hybrid.

About a minute or two on a 2-core CPU. `python experiments/decode.py --config=decode_latency`.
"""

SCRIPT = "decode"


def get_config():
  return dict(
      models=[  # (name, layer pattern); the pattern repeats over model.depth
          ["linear", "G"],  # Gated DeltaNet in every layer
          ["attention", "A"],  # softmax attention in every layer
          ["hybrid", "GGGA"],  # three Gated DeltaNet layers, then attention
      ],
      contexts=[1024, 2048, 4096, 8192, 16384, 32768, 65536],  # context lengths L
      model=dict(  # LMConfig fields shared by the models (but pattern and vocab_size)
          width=256,  # model width d
          depth=4,  # blocks
          num_heads=4,  # heads (head_dim = 64); attention keeps K and V of 4 heads per layer
          use_short_conv=True,  # short convolutions on q, k, v of the mixers in conv_letters
          conv_letters="DGK",  # the delta-rule mixers, as in their papers
          dtype="float32",  # activations and the KV cache: float32 | bfloat16 (states stay float32)
          param_dtype="float32",  # parameters
      ),
      vocab_size=256,  # vocabulary (bytes)
      batch=1,  # sequences decoded together
      warmup=2,  # untimed steps after compilation
      iters=20,  # timed steps; the median and the fastest are reported
      seed=0,  # parameters and the first token
  )
