"""Train: a language model from a config, with exact resume, evaluation, metrics and a loss plot.

    python experiments/train.py --config=mqar_hybrid --workdir=runs/mqar_hybrid
    python experiments/train.py --config=text_small --text_path=notes.txt --workdir=runs/text
    python experiments/train.py --config=mqar_hybrid --set=steps=2000 --set=model.width=128 ...
    python experiments/train.py --config=text_small --mesh_data=-1 --mesh_tensor=2 --sharding_rules=tp
    python experiments/train.py --config=text_small --set=hf_checkpoint=path/to/qwen3_5 --set=steps=5 ...

`--config` is a name in experiments/configs/ or a path to a config file; `--set=KEY=VALUE` (repeatable,
dotted keys for nested fields) overrides one field; an unknown key is an error. `--text_path` is short
for `--set=data.source=text --set=data.text.path=PATH`.

Sharding (linear_attention_jax.sharding): the mesh flags `--mesh_data`, `--mesh_fsdp`, `--mesh_seq`,
`--mesh_tensor` (one may be -1: the devices the others leave) and `--sharding_rules` (dp, fsdp, tp,
state_v, cp, '+'-joined) select a mesh over all devices and the rule set that lays the parameters, the
optimizer moments and the batch out on it; the step runs under `jax.jit` with those in/out shardings
(every mixer's recurrence under `shard_map`). Without any of these flags a run uses one device, as it
always did. Multi-host: `--coordinator_address`, `--num_processes`, `--process_id` on every process.
A checkpoint holds the global arrays, so a run saved on one mesh resumes on another (or on one device).

What a run does (`train_and_evaluate`):
- optimizer: AdamW with linear warmup and cosine decay to `min_lr_ratio * learning_rate`, global-norm
  gradient clipping, weight decay on matrices only; moments in float32 whatever the parameter dtype.
- precision: `model.dtype` for activations (float32 or bfloat16), `model.param_dtype` for parameters;
  recurrent states, logits and the loss are float32.
- checkpoints (orbax, experiments/checkpoint.py): every `checkpoint_every` steps and at the end, the
  newest `keep_checkpoints` kept. A run restarted on the same workdir resumes from the latest one:
  parameters, optimizer state and the data iterator's position, so step N + 1 sees the batch it would
  have seen and its loss is the uninterrupted run's, to the bit (on the same devices and mesh; on
  another mesh, up to float rounding: the sharded step sums in another order).
  Each step is verified at restore (checksums, orbax, finite arrays); a corrupt one is moved aside
  and the next older step is used, with a line saying which and why. A config whose shapes do not fit
  the checkpoint stops (CheckpointMismatch) before config.json or any checkpoint is touched; a failed
  save (full disk, permissions) stops with one line naming the path and the cause.
- non-finite loss: such a step leaves the state unchanged; `on_nonfinite` "stop" (default) ends the
  run before the next save, "skip" goes on (experiments/checkpoint.py has the layout).
- evaluation every `eval_every` steps and at the end: loss and accuracy of every evaluation split
  (MQAR: one per (seq_len, kv pairs) test setting, accuracy = recall at the queries).
- metrics: `{workdir}/metrics.jsonl`, TensorBoard events in `{workdir}/tensorboard/`, the curves in
  `{workdir}/loss.png`, the final numbers in `{workdir}/summary.json`; a progress bar shows loss,
  tokens/s and the time left.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a file: put the repository root on the path
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx

from experiments import configs, data
from experiments.checkpoint import CheckpointMismatch, Checkpointer, CheckpointWriteError
from experiments.metrics import MetricsWriter, plot_curves, read_metrics
from linear_attention_jax import sharding
from linear_attention_jax.models import LM, HybridConfig, LMConfig, hf
from linear_attention_jax.sharding import checkpoint as sharded_checkpoint

try:
  from tqdm import tqdm
except ImportError:  # tqdm is optional (setup.py's "experiments" extra)
  tqdm = None

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = 1e-3  # peak learning rate, reached after the warmup
  warmup_steps: int = 10  # linear warmup from 0
  min_lr_ratio: float = 0.1  # the cosine decay ends at learning_rate * min_lr_ratio at the last step
  weight_decay: float = 0.1  # AdamW's decoupled weight decay, on parameters with >= 2 dimensions
  b1: float = 0.9  # Adam's first-moment decay
  b2: float = 0.98  # Adam's second-moment decay
  eps: float = 1e-8  # Adam's epsilon
  clip_norm: float = 1.0  # gradients are scaled down to this global norm (0: no clipping)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  seed: int = 0  # parameter initialisation
  steps: int = 100  # optimizer steps in all (resumed runs count from their checkpoint)
  model: dict = dataclasses.field(default_factory=lambda: dict(
      pattern="GA", width=32, depth=2, num_heads=2))  # LMConfig fields but vocab_size (from the data)
  data: data.DataConfig = data.DataConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  log_every: int = 10  # steps between train-metric records (means over the steps since the last)
  eval_every: int = 50  # steps between evaluations (0: only at the end)
  eval_batches: int = 2  # batches per evaluation split
  checkpoint_every: int = 50  # steps between checkpoints (0: only at the end)
  keep_checkpoints: int = 2  # newest checkpoints kept
  # A step whose loss or gradient norm is not finite leaves the state as it was; then "stop" ends the
  # run (NonFiniteLoss, before any later save) and "skip" goes on with the next batch.
  on_nonfinite: str = "stop"
  # A local Hugging Face checkpoint directory (Qwen3.5, Qwen3-Next, Kimi Linear; models.hf) to
  # fine-tune instead of a fresh LM: its config and weights replace the model section, of which only
  # impl, chunk_size, dtype and param_dtype apply. Token ids must fit its vocabulary.
  hf_checkpoint: str = ""

  def __post_init__(self):
    check_model_section(self.model)
    if self.steps < 1 or self.log_every < 1 or self.eval_batches < 1:
      raise ValueError(f"need steps, log_every, eval_batches >= 1; got steps={self.steps} "
                       f"log_every={self.log_every} eval_batches={self.eval_batches}")
    if self.optimizer.warmup_steps >= self.steps:
      raise ValueError(f"optimizer.warmup_steps={self.optimizer.warmup_steps} must be < steps={self.steps}")
    if self.on_nonfinite not in ("stop", "skip"):
      raise ValueError(f"on_nonfinite must be 'stop' or 'skip'; got {self.on_nonfinite!r}")

  def lm_config(self, vocab_size: int) -> LMConfig | HybridConfig:
    if not self.hf_checkpoint:
      return lm_config(self.model, vocab_size)
    with open(os.path.join(self.hf_checkpoint, "config.json"), encoding="utf-8") as f:
      model_config = hf.config_from_hf(json.load(f), **self.hf_overrides())
    if vocab_size > model_config.vocab_size:
      raise ValueError(f"the data's vocab_size={vocab_size} exceeds the checkpoint's "
                       f"{model_config.vocab_size}")
    return model_config

  def hf_overrides(self) -> dict:
    """The model section's fields that apply to a converted checkpoint."""
    keep = {k: v for k, v in self.model.items() if k in ("impl", "chunk_size", "dtype", "param_dtype")}
    return {k: DTYPES[v] if k in ("dtype", "param_dtype") else v for k, v in keep.items()}


def check_model_section(model: dict, section: str = "model"):
  """A config's model section takes LMConfig's fields but vocab_size (the data sets it), with dtypes
  named ("float32", "bfloat16"); anything else raises a `ValueError` naming it."""
  known = {f.name for f in dataclasses.fields(LMConfig)} - {"vocab_size"}
  unknown = sorted(set(model) - known)
  if unknown:
    raise ValueError(f"unknown config keys {[f'{section}.{k}' for k in unknown]} ({section} takes "
                     f"the LMConfig fields but vocab_size: {sorted(known)})")
  for name in ("dtype", "param_dtype"):
    if name in model and model[name] not in DTYPES:
      raise ValueError(f"{section}.{name} must be one of {sorted(DTYPES)}; got {model[name]!r}")


def lm_config(model: dict, vocab_size: int) -> LMConfig:
  """The LMConfig of a config's model section (checked by `check_model_section`)."""
  check_model_section(model)
  fields = dict(model, vocab_size=vocab_size)
  for name in ("dtype", "param_dtype"):
    if name in fields:
      fields[name] = DTYPES[fields[name]]
  return LMConfig(**fields)


def load_config(name_or_path: str, overrides=()) -> TrainConfig:
  """The `TrainConfig` of a config file (experiments/configs/), with `KEY=VALUE` overrides."""
  return configs.build(TrainConfig, configs.load(name_or_path, "train", overrides))


def make_optimizer(config: OptimizerConfig, steps: int) -> optax.GradientTransformation:
  schedule = learning_rate_schedule(config, steps)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay, mask=decay_mask)
  clip = optax.clip_by_global_norm(config.clip_norm) if config.clip_norm else optax.identity()
  return optax.chain(clip, adamw)


def learning_rate_schedule(config: OptimizerConfig, steps: int):
  return optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, config.warmup_steps, decay_steps=steps,
      end_value=config.learning_rate * config.min_lr_ratio)


def masked_sums(logits, targets):
  """Summed cross-entropy, correct argmax predictions and scored positions (targets >= 0)."""
  mask = targets >= 0
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, targets, 0))
  correct = (jnp.argmax(logits, axis=-1) == targets) & mask
  return jnp.sum(ce * mask), jnp.sum(correct), jnp.sum(mask)


def _loss(graphdef, params, batch):
  logits, _ = nnx.merge(graphdef, params)(batch["tokens"])
  loss_sum, correct, count = masked_sums(logits, batch["targets"])
  count = jnp.maximum(count, 1)
  return loss_sum / count, correct / count


def _float32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


# The step functions are jitted once per (model graph, optimizer config, steps): runs of one config in
# one process (a resumed run, the learning rates of a sweep with the same rate) share the compilation.
@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "steps"), donate_argnums=0)
def train_step(state, batch, *, graphdef, optimizer: OptimizerConfig, steps: int):
  """One AdamW step on `batch`; returns the new state and `{"loss", "accuracy", "grad_norm",
  "finite"}`. A step whose loss or gradient norm is not finite returns the state unchanged but its
  step count (`finite` False): a bad batch never reaches the parameters or the moments."""
  tx = make_optimizer(optimizer, steps)
  grad_fn = jax.value_and_grad(functools.partial(_loss, graphdef), has_aux=True)
  (loss, accuracy), grads = grad_fn(state["params"], batch)
  # The optimizer works in float32 (its moments too); bf16 parameters take the rounded update.
  updates, opt_state = tx.update(_float32(grads), state["opt_state"], _float32(state["params"]))
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  new = {"step": state["step"] + 1,
         "params": keep(optax.apply_updates(state["params"], updates), state["params"]),
         "opt_state": keep(opt_state, state["opt_state"])}
  return new, {"loss": loss, "accuracy": accuracy, "grad_norm": grad_norm, "finite": finite}


EVAL_TOKENS = 1 << 15  # tokens per forward in a one-device evaluation: logits of 2**15 x vocab


def eval_rows(batch_size: int, length: int, tokens: int = EVAL_TOKENS) -> int:
  """Rows per forward so that one holds at most `tokens` tokens (at least one row); divides
  `batch_size`, so the batch splits into equal pieces."""
  rows = max(1, min(batch_size, tokens // max(length, 1)))
  while batch_size % rows:
    rows -= 1
  return rows


@functools.partial(jax.jit, static_argnames=("graphdef", "rows"))
def eval_step(params, batch, *, graphdef, rows: int | None = None):
  """Summed loss, correct predictions and scored positions of one batch.

  `rows` (one device only): run the batch `rows` rows at a time (`jax.lax.map`), so the logits
  in memory are `rows x T x vocab`, not the whole batch's (a batch of 256 at T = 1024 and a
  vocabulary of 8192 holds 8 GiB of float32 logits at once). None: the whole batch in one forward.
  """
  tokens, targets = batch["tokens"], batch["targets"]
  batch_size = tokens.shape[0]
  if rows is None or rows >= batch_size or batch_size % rows:
    logits, _ = nnx.merge(graphdef, params)(tokens)
    return masked_sums(logits, targets)

  def piece(xs):
    logits, _ = nnx.merge(graphdef, params)(xs[0])
    return masked_sums(logits, xs[1])

  split = lambda x: x.reshape(batch_size // rows, rows, *x.shape[1:])
  sums = jax.lax.map(piece, (split(tokens), split(targets)))
  return tuple(jnp.sum(s, axis=0) for s in sums)


def evaluate(setup: TrainSetup, params, source, seed: int, num_batches: int) -> dict[str, float]:
  """`eval/<split>/loss` and `eval/<split>/accuracy` per split, and their means over the splits."""
  out = {}
  for split in source.eval_splits:
    totals = np.zeros(3)
    for index in range(num_batches):
      sums = setup.eval_step(params, setup.place(source.batch(split, seed, index)))
      totals += np.array([float(x) for x in sums])
    count = max(totals[2], 1.0)
    out[f"eval/{split}/loss"], out[f"eval/{split}/accuracy"] = totals[0] / count, totals[1] / count
  for metric in ("loss", "accuracy"):
    out[f"eval/{metric}"] = float(np.mean([out[f"eval/{s}/{metric}"] for s in source.eval_splits]))
  return out


def init_state(config: TrainConfig, model_config: LMConfig, tx):
  """`(graphdef, state)`: the model's graph and `{"step", "params", "opt_state"}`."""
  if config.hf_checkpoint:
    model = hf.load_checkpoint(config.hf_checkpoint, **config.hf_overrides())
  else:
    model = LM(model_config, rngs=nnx.Rngs(config.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, {"step": jnp.zeros((), jnp.int32), "params": params,
                    "opt_state": tx.init(_float32(params))}


@dataclasses.dataclass
class TrainSetup:
  """A run's model graph and initial state, and the functions that move them: on one device
  (`mesh` None: plain `jax.jit`, host batches passed as they are) or laid out on `mesh` by `rules`
  (parameters, optimizer moments and batches; the steps jitted with those in/out shardings).
  Built by `setup_training`; train.py and sharded_throughput.py both run through it.

  Attributes:
    graphdef: the LM's graph (`nnx.split`).
    state: `{"step", "params", "opt_state"}`, placed (the train step donates it).
    train_step: `(state, batch) -> (state, {"loss", "accuracy", "grad_norm"})`.
    eval_step: `(params, batch) -> (summed loss, correct predictions, scored positions)`.
    place: a host batch (`{"tokens", "targets"}` NumPy arrays) -> the batch the steps take.
    mesh, rules: the mesh and rule set, or None.
  """
  graphdef: object
  state: dict
  train_step: object
  eval_step: object
  place: object
  mesh: jax.sharding.Mesh | None = None
  rules: str | None = None

  def abstract_state(self):
    """The state's shapes, dtypes and shardings: what a checkpoint restores into. Orbax reads each
    device's block of the global arrays, so the checkpoint may come from any mesh."""
    like = jax.eval_shape(lambda: self.state)
    if self.mesh is not None:
      return sharded_checkpoint.abstract_state(like, self.mesh, self.rules)
    # One device: where the fresh state lives (a checkpoint's own sharding may name devices that
    # this machine lacks).
    return jax.tree.map(lambda a, x: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=x.sharding),
                        like, self.state)

  def lower(self, state, batch):
    """The train step lowered for `state` and a placed `batch` (`.compile().memory_analysis()`)."""
    if self.mesh is None:
      return train_step.lower(state, batch, **self.train_step.keywords)
    return self.train_step.jitted.lower(state, batch)

  def describe(self) -> str:
    if self.mesh is None:
      return f"1 device ({jax.devices()[0].platform})"
    sizes = ", ".join(f"{a}={n}" for a, n in self.mesh.shape.items() if n > 1) or "1 device"
    return f"{self.rules} ({sizes})"


def setup_training(config: TrainConfig, model_config: LMConfig, *, mesh=None,
                   rules: str = "dp") -> TrainSetup:
  """The initial state and the jitted steps of `config`, on one device (`mesh` None) or on `mesh`.

  On a mesh, the model is checked against it first (`sharding.check_model_config`: a size the mesh
  axes do not divide raises `ValueError` naming the field), the state is initialised exactly as on
  one device and then laid out by `rules`, and batches are placed with the batch sharding.
  """
  tx = make_optimizer(config.optimizer, config.steps)
  graphdef, state = init_state(config, model_config, tx)
  step = functools.partial(train_step, graphdef=graphdef, optimizer=config.optimizer, steps=config.steps)
  evaluate_step = functools.partial(eval_step, graphdef=graphdef)
  if mesh is None:
    def bounded_eval(params, batch):  # the logits of at most EVAL_TOKENS tokens at once
      return evaluate_step(params, batch, rows=eval_rows(*batch["tokens"].shape))
    return TrainSetup(graphdef, state, step, bounded_eval, place=lambda batch: batch)
  sharding.rule_set(rules)  # an unknown rule set raises here, naming it
  sharding.check_model_config(model_config, mesh, rules)
  state = sharding.shard_train_state(state, mesh, rules)
  return TrainSetup(
      graphdef, state, sharding.make_sharded_train_step(step, mesh, rules, state),
      sharding.make_sharded_eval_step(evaluate_step, mesh, rules, state["params"]),
      place=lambda batch: sharding.shard_batch(batch, mesh, rules), mesh=mesh, rules=rules)


def train_and_evaluate(config: TrainConfig, workdir: str, *, progress: bool = True,
                       interrupt_after: int | None = None, mesh=None,
                       rules: str = "dp") -> dict | None:
  """Trains (resuming from `workdir` when it holds a checkpoint), evaluates, writes everything there.

  Args:
    config: the run.
    workdir: its directory: config.json, checkpoints/, metrics.jsonl, tensorboard/, loss.png,
      summary.json.
    progress: show a progress bar (when tqdm is installed and the output is a terminal).
    interrupt_after: stop right after this step as a killed run would: no final checkpoint, no
      evaluation, no plot (for testing resume). Returns None then.
    mesh, rules: train sharded on this `jax.sharding.Mesh` by these rules (`setup_training`);
      None: one device. A checkpoint written on any mesh restores onto this one.

  Returns:
    The summary: final step, train loss, evaluation metrics, and the paths written.
  """
  os.makedirs(workdir, exist_ok=True)
  primary = is_primary()
  source = data.make_source(config.data)
  model_config = config.lm_config(source.vocab_size)
  setup = setup_training(config, model_config, mesh=mesh, rules=rules)
  state = setup.state
  if mesh is not None:
    print(f"sharded: {setup.describe()} over {mesh.devices.size} {mesh.devices.flat[0].platform} "
          f"devices")
  schedule = learning_rate_schedule(config.optimizer, config.steps)
  checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"), every=config.checkpoint_every,
                             keep=config.keep_checkpoints)
  # Restore (verified, falling back to older steps) before anything in workdir is written: a config
  # whose shapes do not fit the checkpoint raises CheckpointMismatch with config.json untouched.
  try:
    start, restored, data_state = checkpoints.restore_latest(setup.abstract_state())
  except BaseException:
    checkpoints.close()
    raise
  train_batches = data.batches(source, "train", config.data.seed)
  if start is not None:
    state = restored
    train_batches = data.Batches.from_state(source, data_state["train"])
    print(f"resumed from step {start} ({checkpoints.directory}); next batch: "
          f"{train_batches.position}")
  if primary:
    _write_config(config, workdir)
  writer = MetricsWriter(workdir, resume_step=start, enabled=primary)
  eval_seed = config.data.seed + 1
  first = 0 if start is None else start
  bar = _progress_bar(progress and primary, config.steps, first)
  window, unchecked, last_eval, tokens_per_step = [], [], {}, None
  tick = time.perf_counter()
  try:
    for step in range(first + 1, config.steps + 1):
      batch = next(train_batches)
      tokens_per_step = batch["tokens"].size
      state, metrics = setup.train_step(state, setup.place(batch))
      window.append(metrics)
      unchecked.append((step, metrics["finite"]))
      logged = step % config.log_every == 0 or step == config.steps
      if logged or checkpoints.due(step) or step == interrupt_after:  # before anything is saved
        _check_finite(unchecked, config.on_nonfinite, checkpoints, bar)
        unchecked = []
      if logged:
        window = [m for m in window if bool(m["finite"])]  # skipped steps: not in the means
      if logged and window:
        means = {k: float(np.mean([float(m[k]) for m in window])) for k in window[0] if k != "finite"}
        elapsed = time.perf_counter() - tick
        record = {f"train/{k}": v for k, v in means.items()}
        record["train/learning_rate"] = float(schedule(step - 1))
        record["train/tokens_per_s"] = len(window) * tokens_per_step / elapsed
        writer.write(step, record)
        if bar is not None:
          bar.set_postfix(loss=f"{means['loss']:.4f}", acc=f"{means['accuracy']:.3f}",
                          tok_s=f"{record['train/tokens_per_s']:,.0f}", refresh=False)
        window, tick = [], time.perf_counter()
      if bar is not None:
        bar.update(1)
      if config.eval_every and step % config.eval_every == 0 and step != config.steps:
        last_eval = evaluate(setup, state["params"], source, eval_seed, config.eval_batches)
        writer.write(step, last_eval)
        _say(bar, f"step {step}: eval loss {last_eval['eval/loss']:.4f} "
                  f"accuracy {last_eval['eval/accuracy']:.4f}")
        tick = time.perf_counter()
      checkpoints.save(step, state, {"train": train_batches.state()})
      if step == interrupt_after:
        return None
    final_step = int(state["step"])
    last_eval = evaluate(setup, state["params"], source, eval_seed, config.eval_batches)
    if final_step > first:  # a finished run started again only reports; its records are there
      writer.write(final_step, last_eval)
    checkpoints.save(final_step, state, {"train": train_batches.state()}, force=True)
  finally:
    if bar is not None:
      bar.close()
    writer.close()
    checkpoints.close()
  return _finish(config, workdir, model_config, final_step, last_eval, checkpoints, writer)


class NonFiniteLoss(FloatingPointError):
  """A train step's loss or gradient norm was not finite and the config says `on_nonfinite="stop"`."""


def _check_finite(steps, policy: str, checkpoints, bar):
  """Raises `NonFiniteLoss` for the first step in `steps` (`(step, finite)` pairs) whose update was
  refused, or (policy "skip") says which steps were skipped."""
  bad = [step for step, finite in steps if not bool(finite)]
  if not bad:
    return
  if policy == "stop":
    raise NonFiniteLoss(
        f"step {bad[0]}: non-finite loss or gradient norm; stopped (on_nonfinite='stop') with that "
        f"update left out; newest checkpoint: step {checkpoints.latest_step()} in "
        f"{checkpoints.directory} (on_nonfinite='skip' goes on past such steps)")
  _say(bar, f"skipped steps {bad}: non-finite loss or gradient norm (their updates left out)")


def is_primary() -> bool:
  """Process 0 of a (multi-host) job: the one that writes metrics, plots, config and summary. Every
  process trains and takes part in the (collective) checkpoint saves."""
  return jax.process_index() == 0


def _finish(config, workdir, model_config, final_step, last_eval, checkpoints, writer) -> dict:
  if not writer.enabled:
    return {"step": final_step, **last_eval, "checkpoints": checkpoints.directory,
            "checkpoint_steps": checkpoints.all_steps()}
  records = read_metrics(writer.path)
  train_losses = [r["train/loss"] for r in records if "train/loss" in r]
  title = (f"{config.data.source}, pattern {model_config.pattern}, width {model_config.width}, "
           f"depth {model_config.depth}")
  plot = plot_curves(records, os.path.join(workdir, "loss.png"), title=title)
  summary = {"step": final_step, "train/loss": train_losses[-1] if train_losses else None,
             **last_eval, "checkpoints": checkpoints.directory,
             "checkpoint_steps": checkpoints.all_steps(), "metrics": writer.path,
             "tensorboard": writer.tensorboard_dir if writer.has_tensorboard else None,
             "plot": plot}
  with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  splits = ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in last_eval.items()
                     if k.endswith("/accuracy") and k.count("/") == 2)
  print(f"final eval accuracy {last_eval['eval/accuracy']:.4f} ({splits}), "
        f"eval loss {last_eval['eval/loss']:.4f} at step {final_step}")
  print(f"checkpoint: {checkpoints.directory}/{final_step}")
  print(f"metrics:    {writer.path}" + (f" (TensorBoard: {writer.tensorboard_dir})"
                                        if writer.has_tensorboard else ""))
  print(f"plot:       {plot}")
  return summary


def _progress_bar(enabled: bool, total: int, initial: int):
  if not enabled or tqdm is None:
    return None
  return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, disable=None)


def _say(bar, text: str):
  if bar is not None and not bar.disable:
    bar.write(text)
  else:
    print(text)


def _write_config(config: TrainConfig, workdir: str):
  """Writes `{workdir}/config.json`; warns when it replaces a different one (a resumed run whose
  config changed is no longer the same run)."""
  path = os.path.join(workdir, "config.json")
  new = configs.to_dict(config)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      old = json.load(f)
    if old != new:
      print(f"warning: {path} differs from this run's config; the run continues with the new one")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(new, f, indent=1)


def quiet_logs():
  """absl's INFO lines (orbax logs every save) drown the progress bar: WARNING unless --verbosity."""
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


def _define_flags():
  flags.DEFINE_string("config", "mqar_hybrid", "Config name in experiments/configs/ or a path to one.")
  flags.DEFINE_multi_string("set", [], "Override KEY=VALUE (dotted keys for nested fields); repeatable.")
  flags.DEFINE_string("text_path", None, "Train on the bytes of this file (sets data.source=text).")
  flags.DEFINE_string("workdir", None, "Run directory (default runs/<config name>); resumes when it "
                      "holds a checkpoint.")
  flags.DEFINE_bool("progress", True, "Show a progress bar.")
  sharding.define_flags()


def mesh_from_flags(flag_values=None):
  """`(mesh, rules)` the sharding flags select (starting the multi-host runtime when they name a
  coordinator), or `(None, "dp")` when none is given: one device."""
  fv = flags.FLAGS if flag_values is None else flag_values
  if not sharding.flags_given(fv):
    return None, "dp"
  mesh_config = sharding.config_from_flags(fv)
  sharding.initialize_distributed(mesh_config)
  return sharding.make_mesh(mesh_config), fv.sharding_rules


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  f = flags.FLAGS
  quiet_logs()
  mesh, rules = mesh_from_flags(f)  # first: a multi-host job starts before any device is touched
  raw = configs.load(f.config, "train", f.set)
  if f.text_path:
    raw = configs.apply_overrides(raw, {"data.source": "text", "data.text.path": f.text_path})
  config = configs.build(TrainConfig, raw)
  workdir = f.workdir or os.path.join("runs", os.path.basename(f.config).removesuffix(".py"))
  try:
    train_and_evaluate(config, workdir, progress=f.progress, mesh=mesh, rules=rules)
  except (CheckpointWriteError, CheckpointMismatch, NonFiniteLoss) as e:
    sys.exit(f"error: {e}")  # one line, exit status 1: the message names the path and the cause


if __name__ == "__main__":
  _define_flags()
  app.run(main)
