"""The experiment configs: every file loads into its script's schema, every field has a comment, and
unknown keys anywhere raise a ValueError that names them."""

from __future__ import annotations

import inspect
import re

import pytest

from experiments import configs, decode, mqar, recall, train

SCHEMAS = {"train": train.TrainConfig, "mqar": mqar.SweepConfig, "decode": decode.DecodeConfig,
           "recall": recall.RecallSweepConfig}


@pytest.mark.parametrize("name", configs.names())
def test_every_config_file_builds_its_scripts_config(name):
  # Given a config file
  module = configs.load_module(name)
  # When its dict is built into the schema of the script it names
  config = configs.build(SCHEMAS[module.SCRIPT], module.get_config())
  # Then every field of the file is one the schema knows, and the models it describes build
  if isinstance(config, train.TrainConfig):
    vocab = 256 if config.data.source == "text" else config.data.mqar.vocab_size
    assert config.lm_config(vocab).depth == config.model["depth"]
  assert configs.to_dict(config)  # JSON-ready


@pytest.mark.parametrize("name", configs.names())
def test_every_field_of_every_config_has_a_comment(name):
  source = inspect.getsource(configs.load_module(name).get_config)
  fields = [line for line in source.splitlines() if re.match(r"\s+\w+=", line)]
  assert fields, name
  missing = [line.strip() for line in fields if "#" not in line]
  assert not missing, f"{name}: fields without a comment: {missing}"


def test_there_is_a_config_for_each_script():
  scripts = {configs.load_module(n).SCRIPT for n in configs.names()}
  assert scripts == set(configs.SCRIPTS)
  assert {"mqar_hybrid", "text_small", "mqar_sweep", "decode_latency"} <= set(configs.names())


@pytest.mark.parametrize("key, shown", [
    ("stepz", "stepz"),
    ("optimizer.lr", "optimizer.lr"),
    ("data.mqar.num_pairs", "data.mqar.num_pairs"),
    ("model.widht", "model.widht"),
    ("model.vocab_size", "model.vocab_size"),
])
def test_unknown_keys_are_rejected_by_name(key, shown):
  with pytest.raises(ValueError, match=re.escape(shown)):
    train.load_config("mqar_hybrid", [f"{key}=1"])


def test_unknown_keys_in_the_file_itself_are_rejected():
  raw = configs.load("mqar_sweep", "mqar")
  raw["train"]["data"]["mqar"]["vocab"] = 10
  raw["lr"] = 1
  with pytest.raises(ValueError, match=r"unknown config keys \['lr'\]"):
    configs.build(mqar.SweepConfig, raw)
  del raw["lr"]
  with pytest.raises(ValueError, match=re.escape("train.data.mqar.vocab")):
    configs.build(mqar.SweepConfig, raw)


def test_overrides_parse_python_literals_and_keep_other_text_as_strings():
  assert configs.parse_override("steps=20") == ("steps", 20)
  assert configs.parse_override("optimizer.learning_rate=3e-3") == ("optimizer.learning_rate", 3e-3)
  assert configs.parse_override("model.pattern=GA") == ("model.pattern", "GA")
  assert configs.parse_override("x=[[64, 4], [128, 8]]") == ("x", [[64, 4], [128, 8]])
  config = train.load_config("mqar_hybrid", ["model.width=32", "data.mqar.test_settings=[[16,2]]"])
  assert config.model["width"] == 32 and config.data.mqar.test_settings == ((16, 2),)
  with pytest.raises(ValueError, match="KEY=VALUE"):
    configs.parse_override("steps")
  with pytest.raises(ValueError, match="is a value, not a section"):
    train.load_config("mqar_hybrid", ["steps.x=1"])


def test_bad_values_and_wrong_scripts_are_rejected():
  with pytest.raises(ValueError, match="is for mqar.py, not train.py"):
    train.load_config("mqar_sweep")
  with pytest.raises(ValueError, match="no config 'nope'"):
    configs.load("nope", "train")
  with pytest.raises(ValueError, match="data.source"):
    train.load_config("mqar_hybrid", ["data.source=web"])
  with pytest.raises(ValueError, match="model.dtype"):
    train.load_config("mqar_hybrid", ["model.dtype=float16"])
  with pytest.raises(ValueError, match="train_settings"):
    train.load_config("mqar_hybrid", ["data.mqar.train_settings=[[16,8]]"])
  with pytest.raises(ValueError, match="pattern"):
    mqar.load_config("mqar_sweep", ['models=[["bad","GX"]]'])
  with pytest.raises(ValueError, match="contexts"):
    decode.load_config("decode_latency", ["contexts=[4]"])
