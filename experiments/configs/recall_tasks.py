"""Retrieval against context length (experiments/recall.py): RULER-style needles (passkey, number,
multi-key), exact copying and a two-hop lookup, for every mixer and two hybrids at equal depth (four
layers).

The default is sized for a 2-core CPU (width 64, trained at T = 32, tested at 32 to 128, 400 steps,
one learning rate; 3 to 5 minutes a model measured on a shared 2-core machine, two at a time). The GPU sweep (experiments/recall_sweep.py) scales it.
"""

SCRIPT = "recall"


def get_config():
  return dict(
      models=[  # (name, layer pattern); four layers each
          ["attention", "AAAA"],  # softmax attention (rotary positions)
          ["linear_attention", "LLLL"],  # Katharopoulos et al., elu + 1, normalised
          ["retention", "RRRR"],  # RetNet: fixed decay per head
          ["gla", "FFFF"],  # gated linear attention
          ["deltanet", "DDDD"],  # delta rule
          ["gated_deltanet", "GGGG"],  # delta rule with a scalar decay
          ["kda", "KKKK"],  # delta rule with a per-channel decay
          ["hybrid_gdn", "GGGA"],  # three Gated DeltaNet layers, then attention
          ["hybrid_kda", "KKKA"],  # 3:1 KDA : attention
      ],
      learning_rates=[1e-2],  # the grid; each model is reported at its best rate
      workers=2,  # runs trained at once in separate processes (one per core here)
      train=dict(  # everything else of each run (pattern and rate replaced)
          seed=0,  # parameter initialisation
          steps=400,  # optimizer steps per run
          model=dict(  # LMConfig fields; pattern, depth come from models, vocab_size from data
              pattern="GGGA",  # replaced per model
              width=64,  # model width d
              depth=4,  # replaced by the pattern's length
              num_heads=2,  # heads of every mixer (head_dim = 32)
              use_short_conv=True,  # short convolutions on q, k, v of the mixers in conv_letters
              conv_letters="LRFDGKA",  # every mixer, attention too
              conv_size=4,  # taps of the short convolutions
              mlp_ratio=2.0,  # SwiGLU hidden width / d
              impl="recurrent",  # the token scan (impl=auto on a GPU)
              chunk_size=32,  # chunk length of the chunked form
              dtype="float32",  # activations: float32 | bfloat16 (recurrent states stay float32)
              param_dtype="float32",  # parameters: float32 | bfloat16
          ),
          data=dict(  # where the batches come from (experiments/data.py)
              source="retrieval",  # the sweep needs retrieval
              batch_size=40,  # examples per step (8 of each task) and per evaluation batch
              seed=0,  # training batches; the test sets use seed + 1 (fixed across runs)
              retrieval=dict(  # the tasks (experiments/retrieval_data.py)
                  vocab_size=64,  # 32 reserved ids, then four ranges of 8 words
                  tasks=["passkey", "number_needle", "multikey_needle", "copy", "two_hop"],  # all
                  train_lengths=[32],  # context lengths mixed in training
                  test_lengths=[32, 64, 128],  # up to 4x the training length
                  digits=3,  # digits of a passkey / needle number
                  num_keys=3,  # needles of multikey_needle (one asked, the others distractors)
                  num_pairs=3,  # pairs per hop of two_hop
                  num_queries=3,  # queries of two_hop
              ),
          ),
          optimizer=dict(  # AdamW, warmup + cosine decay, clipping
              learning_rate=1e-2,  # replaced by each rate of the grid
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
          eval_batches=2,  # batches of 40 per (task, length)
          checkpoint_every=0,  # checkpoint only at the end
          keep_checkpoints=1,  # newest checkpoints kept
      ),
  )
