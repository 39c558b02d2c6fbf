"""MQAR in zoology's setting (Arora et al. 2023; HazyResearch/zoology, commit d88d6f5): GPU scale.

Where each setting comes from (paths in the zoology repository):
- vocabulary 8192; the training mix (64, 4), (128, 8), (256, 16), (256, 32), (256, 64) of
  (sequence length, kv pairs), drawn 100k : 20k : 20k : 20k : 20k; the seven test sets (64, 4),
  (64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256), 1,000 examples each; batch 256:
  `zoology/experiments/mqar_example_configs/original_mqar_configs.py` (the same lists in
  `zoology/experiments/paper_configs/arxiv24_based_figure2/configs.py`).
- the generator (keys from the lower half, values from the upper half, power-law query gaps with
  a = 0.01, random filler): `zoology/data/multiquery_ar.py` (ours: experiments/mqar_data.py).
- two layers, widths 64, 128, 256, two heads for attention, DeltaNet, Gated DeltaNet and GLA, short
  convolutions of 4 in DeltaNet and Gated DeltaNet: `zoology/experiments/models_repo.py`.
- four learning rates `np.logspace(-3, -1.5, 4)`, each model reported at its best; AdamW, weight decay
  0.1, cosine decay to 0, no warmup: the configs above, `zoology/config.py`, `zoology/train.py`.
- state: both layers' `state_size` at the longest test length (1024), times 4 bytes:
  `zoology/model.py::_compute_state_size`, `zoology/logger.py`.

Where ours differs (said again in experiments/RECALL.md):
- first layer: zoology's model is `Hybrid([BaseConv, mixer])` (`zoology/mixers/hybrid.py` picks
  `configs[layer_idx % 2]`): layer 1 a gated short convolution (kernel 3, `y = conv(u) * W u + u`,
  `zoology/mixers/base_conv.py`), layer 2 the mixer, and no MLP (`state_mixer` is
  `torch.nn.Identity`), LayerNorm, attention dropout 0.1. Ours: both layers are the mixer, each with
  short convolutions (4 taps) on q, k, v ("short conv + mixer", conv_letters), RMSNorm, a SwiGLU MLP
  (ratio 2) after each mixer, no dropout; the hybrid is Gated DeltaNet then attention ("GA"). So our
  state counts two mixer states where zoology's counts one mixer and one short convolution.
- head sizes: ours K = V = d / 2 for every mixer; zoology's Gated DeltaNet has V = 2K
  (`expand_v=2`) and its GLA K = d / 4 per head (`expand_k=0.5`).
- training length: zoology trains 32 epochs (about 22,500 steps at batch 256) with early stopping
  at 0.99; ours `steps` below (a fixed number, sized for the GPU time we have), 1,024 test examples
  per setting (4 batches of 256) instead of 1,000.
"""

SCRIPT = "mqar"

VOCAB = 8192  # zoology's VOCAB_SIZE


def get_config():
  return dict(
      models=[  # (name, layer pattern), two layers each; the importance order of the GPU sweep
          ["attention", "AA"],  # softmax attention (rotary positions)
          ["linear_attention", "LL"],  # Katharopoulos et al., elu + 1 feature map, normalised
          ["retention", "RR"],  # RetNet: fixed decay per head
          ["gla", "FF"],  # gated linear attention: per-channel data-dependent decay
          ["deltanet", "DD"],  # delta rule
          ["gated_deltanet", "GG"],  # delta rule with a scalar decay
          ["kda", "KK"],  # delta rule with a per-channel decay
          ["hybrid", "GA"],  # Gated DeltaNet, then softmax attention
      ],
      learning_rates=[1e-3, 3.1623e-3, 1e-2, 3.1623e-2],  # zoology's np.logspace(-3, -1.5, 4)
      widths=[64, 128, 256],  # zoology's d_model grid (models_repo.py)
      workers=1,  # runs trained at once in separate processes (the GPU sweep sets more)
      train=dict(  # everything else of each run (pattern, width and rate replaced)
          seed=0,  # parameter initialisation
          steps=2000,  # optimizer steps per run (zoology: 32 epochs, about 22,500, early stop at 0.99)
          model=dict(  # LMConfig fields; pattern, depth, width come from the sweep
              pattern="GA",  # replaced per model
              width=64,  # replaced per width
              depth=2,  # replaced by the pattern's length
              num_heads=2,  # zoology's num_heads=2 (models_repo.py)
              use_short_conv=True,  # short convolutions on q, k, v of the mixers in conv_letters
              conv_letters="LRFDGKA",  # every mixer, attention too ("short conv + mixer")
              conv_size=4,  # zoology's conv_size=4 in DeltaNet and Gated DeltaNet
              mlp_ratio=2.0,  # SwiGLU hidden width / d (zoology has no MLP)
              impl="auto",  # the fastest implementation for the device
              chunk_size=64,  # chunk length of the chunked form
              dtype="float32",  # activations: float32 | bfloat16 (recurrent states stay float32)
              param_dtype="float32",  # parameters: float32 | bfloat16
          ),
          data=dict(  # where the batches come from (experiments/data.py)
              source="mqar",  # the sweep needs mqar
              batch_size=256,  # zoology's batch_size (train); evaluation batches too
              seed=0,  # training batches; the test sets use seed + 1 (fixed across runs)
              mqar=dict(  # the recall task (experiments/mqar_data.py)
                  vocab_size=VOCAB,  # keys from [1, 4096), values from [4096, 8192)
                  train_settings=[  # zoology's train mix (it draws 100k of the first, 20k of each
                      [64, 4], [128, 8], [256, 16], [256, 32], [256, 64]],  # other; ours: equal shares)
                  test_settings=[  # zoology's seven test sets, up to 4x the training length
                      [64, 4], [64, 8], [64, 16], [128, 32], [256, 64], [512, 128], [1024, 256]],
                  power_a=0.01,  # zoology's power_a
                  random_non_queries=True,  # zoology's random_non_queries
              ),
          ),
          optimizer=dict(  # AdamW, cosine decay (zoology/train.py)
              learning_rate=1e-3,  # replaced by each rate of the grid
              warmup_steps=0,  # zoology has no warmup
              min_lr_ratio=0.0,  # zoology's CosineAnnealingLR(eta_min=0)
              weight_decay=0.1,  # zoology's weight_decay
              b1=0.9,  # torch AdamW default
              b2=0.999,  # torch AdamW default
              eps=1e-8,  # torch AdamW default
              clip_norm=0.0,  # zoology does not clip
          ),
          log_every=100,  # steps between train-metric records
          eval_every=0,  # evaluate only at the end
          eval_batches=4,  # batches of 256 per test setting (1,024 examples; zoology: 1,000)
          checkpoint_every=500,  # a run cut off by the time budget resumes from here
          keep_checkpoints=1,  # newest checkpoints kept
      ),
  )
