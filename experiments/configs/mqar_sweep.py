"""MQAR sweep: every mixer as a two-layer "short conv + mixer" model, and a hybrid, at two learning
rates; recall accuracy per (seq_len, kv pairs) against the state each keeps.

The default is sized for a 2-core CPU (T = 32, up to 8 pairs, 500 steps; minutes with two workers).
Scale it with flags for a GPU, e.g. `--set=train.steps=5000 --set=train.model.width=128
--set='train.data.mqar.train_settings=[[64,4],[128,8],[256,16],[256,32],[256,64]]'`, the test settings
likewise, `--set=train.model.impl=auto`, `--set=workers=1`.
"""

SCRIPT = "mqar"


def get_config():
  return dict(
      models=[  # (name, layer pattern); the pattern spells every layer (two layers each)
          ["linear_attention", "LL"],  # Katharopoulos et al., elu + 1 feature map, normalised
          ["retention", "RR"],  # RetNet: fixed decay per head
          ["gla", "FF"],  # gated linear attention: per-channel data-dependent decay
          ["deltanet", "DD"],  # delta rule
          ["gated_deltanet", "GG"],  # delta rule with a scalar decay
          ["kda", "KK"],  # delta rule with a per-channel decay
          ["attention", "AA"],  # softmax attention (rotary positions)
          ["hybrid", "GA"],  # Gated DeltaNet, then softmax attention
      ],
      learning_rates=[3e-3, 1e-2],  # the grid; each model is reported at its best rate
      workers=2,  # runs trained at once in separate processes (one per core here)
      train=dict(  # everything else of each run, as in train.py's configs (pattern and rate replaced)
          seed=0,  # parameter initialisation
          steps=500,  # optimizer steps per run
          model=dict(  # LMConfig fields; pattern, depth come from models, vocab_size from data
              pattern="GA",  # replaced per model
              width=64,  # model width d
              depth=2,  # replaced by the pattern's length
              num_heads=2,  # heads of every mixer (head_dim = 32)
              use_short_conv=True,  # short convolutions on q, k, v of the mixers in conv_letters
              conv_letters="LRFDGKA",  # every mixer, attention too ("short conv + mixer")
              conv_size=4,  # taps of the short convolutions
              mlp_ratio=2.0,  # SwiGLU hidden width / d
              impl="recurrent",  # the token scan: on a CPU at T = 32 as fast as "chunk", compiles faster
              chunk_size=32,  # chunk length of the chunked form
              dtype="float32",  # activations: float32 | bfloat16 (recurrent states stay float32)
              param_dtype="float32",  # parameters: float32 | bfloat16
          ),
          data=dict(  # where the batches come from (experiments/data.py)
              source="mqar",  # the sweep needs mqar
              batch_size=32,  # examples per step and per evaluation batch
              seed=0,  # training batches; the test sets use seed + 1 (fixed across runs)
              mqar=dict(  # the recall task (experiments/mqar_data.py)
                  vocab_size=64,  # keys from [1, 32), values from [32, 64)
                  train_settings=[[32, 2], [32, 4], [32, 8]],  # (seq_len, kv pairs), mixed in each batch
                  test_settings=[[32, 2], [32, 4], [32, 8]],  # one column of the table each
                  power_a=0.01,  # power-law exponent of the query positions
                  random_non_queries=True,  # filler tokens random instead of 0
              ),
              text=dict(  # byte-level text
                  path="",  # unused (mqar)
                  seq_len=128,  # unused (mqar)
                  valid_fraction=0.1,  # unused (mqar)
              ),
          ),
          optimizer=dict(  # AdamW, warmup + cosine decay, clipping
              learning_rate=3e-3,  # replaced by each rate of the grid
              warmup_steps=30,  # linear warmup
              min_lr_ratio=0.1,  # cosine decay ends at 10% of the peak
              weight_decay=0.1,  # AdamW weight decay on matrices
              b1=0.9,  # Adam beta1
              b2=0.98,  # Adam beta2
              eps=1e-8,  # Adam epsilon
              clip_norm=1.0,  # global-norm gradient clipping
          ),
          log_every=50,  # steps between train-metric records
          eval_every=0,  # evaluate only at the end
          eval_batches=8,  # batches of 32 per test setting (256 examples, 512 to 2,048 queries)
          checkpoint_every=0,  # checkpoint only at the end
          keep_checkpoints=1,  # newest checkpoints kept
      ),
  )
