"""MQAR recall with a two-layer hybrid (Gated DeltaNet, then softmax attention): the main job.

Sequences of 32 tokens holding 2, 4 or 8 key-value pairs; a few minutes on a 2-core CPU:
`python experiments/train.py --config=mqar_hybrid`. The same setting as the MQAR sweep's (mqar_sweep).
"""

SCRIPT = "train"


def get_config():
  return dict(
      seed=0,  # parameter initialisation
      steps=500,  # optimizer steps
      model=dict(  # LMConfig fields (linear_attention_jax.models.LMConfig); vocab_size comes from data
          pattern="GA",  # layer 1 Gated DeltaNet, layer 2 softmax attention
          width=64,  # model width d
          depth=2,  # blocks
          num_heads=2,  # heads of every mixer (head_dim = width / num_heads = 32)
          use_short_conv=True,  # short convolutions on q, k, v of the mixers in conv_letters
          conv_letters="LRFDGKA",  # every mixer, attention too ("short conv + mixer")
          conv_size=4,  # taps of the short convolutions
          mlp_ratio=2.0,  # SwiGLU hidden width / d
          impl="recurrent",  # the token scan: on a CPU at T = 32 as fast as "chunk", compiles faster
          chunk_size=32,  # chunk length of the chunked form (impl chunk or auto)
          dtype="float32",  # activations: float32 | bfloat16 (recurrent states stay float32)
          param_dtype="float32",  # parameters: float32 | bfloat16
      ),
      data=dict(  # where the batches come from (experiments/data.py)
          source="mqar",  # mqar | text
          batch_size=32,  # examples per step and per evaluation batch
          seed=0,  # training batches; evaluation uses seed + 1
          mqar=dict(  # the recall task (experiments/mqar_data.py)
              vocab_size=64,  # keys from [1, 32), values from [32, 64)
              train_settings=[[32, 2], [32, 4], [32, 8]],  # (seq_len, kv pairs), mixed in each batch
              test_settings=[[32, 2], [32, 4], [32, 8]],  # one evaluation split each
              power_a=0.01,  # power-law exponent of the query positions
              random_non_queries=True,  # filler tokens random instead of 0
          ),
          text=dict(  # byte-level text
              path="",  # unused with source=mqar
              seq_len=128,  # unused with source=mqar
              valid_fraction=0.1,  # unused with source=mqar
          ),
      ),
      optimizer=dict(  # AdamW, warmup + cosine decay, clipping
          learning_rate=1e-2,  # peak learning rate (the best of mqar_sweep's grid for this model)
          warmup_steps=30,  # linear warmup
          min_lr_ratio=0.1,  # cosine decay ends at 10% of the peak
          weight_decay=0.1,  # AdamW weight decay on matrices
          b1=0.9,  # Adam beta1
          b2=0.98,  # Adam beta2
          eps=1e-8,  # Adam epsilon
          clip_norm=1.0,  # global-norm gradient clipping
      ),
      log_every=10,  # steps between train-metric records
      eval_every=100,  # steps between evaluations
      eval_batches=8,  # batches of 32 per test setting (256 examples, 512 to 2,048 queries)
      checkpoint_every=100,  # steps between checkpoints
      keep_checkpoints=3,  # newest checkpoints kept
  )
