"""Byte-level language modelling with a small hybrid (three Gated DeltaNet layers, one attention).

Offline by default: without `data.text.path` (or `--text_path`) it reads the embedded corpus, source
files of Python's standard library. `python experiments/train.py --config=text_small`.
"""

SCRIPT = "train"


def get_config():
  return dict(
      seed=0,  # parameter initialisation
      steps=1000,  # optimizer steps
      model=dict(  # LMConfig fields (linear_attention_jax.models.LMConfig); vocab_size = 256 bytes
          pattern="GGGA",  # three Gated DeltaNet layers, then softmax attention
          width=128,  # model width d
          depth=4,  # blocks: the pattern once
          num_heads=4,  # heads of every mixer (head_dim = 32)
          use_short_conv=True,  # short convolutions on q, k, v of the linear mixers in conv_letters
          conv_letters="DGK",  # the delta-rule mixers, as in their papers
          conv_size=4,  # taps of the short convolutions
          mlp_ratio=8 / 3,  # SwiGLU hidden width / d
          impl="recurrent",  # on a CPU the token scan beats the chunked form at this size; auto on GPU/TPU
          chunk_size=64,  # chunk length of the chunked form
          dtype="float32",  # activations: float32 | bfloat16 (recurrent states stay float32)
          param_dtype="float32",  # parameters: float32 | bfloat16
      ),
      data=dict(  # where the batches come from (experiments/data.py)
          source="text",  # mqar | text
          batch_size=16,  # examples per step and per evaluation batch
          seed=0,  # training windows; evaluation uses seed + 1
          mqar=dict(  # the recall task (experiments/mqar_data.py)
              vocab_size=256,  # unused with source=text
              train_settings=[[64, 4]],  # unused with source=text
              test_settings=[[64, 4]],  # unused with source=text
              power_a=0.01,  # unused with source=text
              random_non_queries=True,  # unused with source=text
          ),
          text=dict(  # byte-level text
              path="",  # a local text file; "" = the embedded corpus
              seq_len=128,  # bytes per example
              valid_fraction=0.1,  # the last 10% of the bytes are the "valid" split
          ),
      ),
      optimizer=dict(  # AdamW, warmup + cosine decay, clipping
          learning_rate=2e-3,  # peak learning rate
          warmup_steps=100,  # linear warmup
          min_lr_ratio=0.1,  # cosine decay ends at 10% of the peak
          weight_decay=0.1,  # AdamW weight decay on matrices
          b1=0.9,  # Adam beta1
          b2=0.98,  # Adam beta2
          eps=1e-8,  # Adam epsilon
          clip_norm=1.0,  # global-norm gradient clipping
      ),
      log_every=20,  # steps between train-metric records
      eval_every=200,  # steps between evaluations
      eval_batches=8,  # batches per evaluation
      checkpoint_every=200,  # steps between checkpoints
      keep_checkpoints=3,  # newest checkpoints kept
  )
