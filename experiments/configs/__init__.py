"""Experiment configs: one Python file per experiment, read by one loader that rejects unknown keys.

A config file defines `SCRIPT` (the script it configures: "train", "mqar", "decode" or "recall") and
`get_config()`, which returns a plain dict whose every field carries a comment. The script turns the
dict into its frozen dataclass with `build(cls, mapping)`; a key the dataclass lacks, at any depth,
raises a `ValueError` naming it.

Command-line overrides (`--set=KEY=VALUE`, repeatable) use dotted keys for nested fields
(`--set=model.width=64`); VALUE is read as a Python literal (`3e-3`, `"GA"`, `[[64, 4], [64, 8]]`,
`True`) and kept as a string when it is not one (`--set=model.pattern=GA`).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import os
import types
import typing
from typing import Any, Iterable

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = ("train", "mqar", "decode", "recall")


def names() -> list[str]:
  """Names of the config files in this folder (without `.py`)."""
  return sorted(f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py") and f != "__init__.py")


def load_module(name_or_path: str) -> types.ModuleType:
  """The config module for a name in this folder (`"mqar_hybrid"`) or a path to a `.py` file."""
  path = name_or_path
  if not path.endswith(".py"):
    path = os.path.join(CONFIG_DIR, f"{name_or_path}.py")
  if not os.path.isfile(path):
    raise ValueError(f"no config {name_or_path!r}: {path} does not exist; known: {names()}")
  spec = importlib.util.spec_from_file_location(f"_config_{os.path.basename(path)[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if getattr(module, "SCRIPT", None) not in SCRIPTS or not callable(getattr(module, "get_config", None)):
    raise ValueError(f"config file {path} must define SCRIPT (one of {SCRIPTS}) and get_config()")
  return module


def load(name_or_path: str, script: str, overrides: Iterable[str] | dict = ()) -> dict:
  """`get_config()` of the named config, checked to be for `script`, with overrides applied."""
  module = load_module(name_or_path)
  if module.SCRIPT != script:
    raise ValueError(f"config {name_or_path!r} is for {module.SCRIPT}.py, not {script}.py")
  return apply_overrides(module.get_config(), overrides)


def parse_override(text: str) -> tuple[str, Any]:
  """`"model.width=64"` -> `("model.width", 64)`; a value that is no Python literal stays a string."""
  key, sep, value = text.partition("=")
  if not sep or not key.strip():
    raise ValueError(f"an override must read KEY=VALUE; got {text!r}")
  try:
    parsed = ast.literal_eval(value)
  except (ValueError, SyntaxError):
    parsed = value
  return key.strip(), parsed


def apply_overrides(config: dict, overrides: Iterable[str] | dict) -> dict:
  """A copy of `config` with dotted keys set (missing sections are created: the schema that `build`
  applies next rejects keys it does not know)."""
  config = copy.deepcopy(config)
  items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides)
  for key, value in items:
    *parents, leaf = key.split(".")
    node = config
    for i, part in enumerate(parents):
      child = node.setdefault(part, {})
      if not isinstance(child, dict):
        raise ValueError(f"config key {key!r}: {'.'.join(parents[:i + 1])!r} is a value, not a section")
      node = child
    node[leaf] = value
  return config


def build(cls, mapping: dict, *, prefix: str = ""):
  """The frozen dataclass `cls` from `mapping`; nested dataclass fields from nested dicts.

  Missing keys take the dataclass defaults; unknown keys raise a `ValueError` naming all of them
  (with their dotted path). Lists become tuples (so configs stay hashable and comparable).
  """
  if not isinstance(mapping, dict):
    raise ValueError(f"config section {prefix.rstrip('.') or '(top)'} must be a dict; got {mapping!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(mapping) - set(fields))
  if unknown:
    raise ValueError(f"unknown config keys {[prefix + k for k in unknown]} for {cls.__name__}; "
                     f"known: {sorted(fields)}")
  hints = typing.get_type_hints(cls)
  values = {}
  for name, value in mapping.items():
    hint = hints[name]
    if dataclasses.is_dataclass(hint):
      values[name] = build(hint, value, prefix=f"{prefix}{name}.")
    else:
      values[name] = _freeze(value)
  return cls(**values)


def to_dict(config) -> dict:
  """A dataclass config as a JSON-ready dict (tuples become lists)."""
  return _thaw(dataclasses.asdict(config))


def _freeze(value):
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  if isinstance(value, dict):
    return {k: _freeze(v) for k, v in value.items()}
  return value


def _thaw(value):
  if isinstance(value, (list, tuple)):
    return [_thaw(v) for v in value]
  if isinstance(value, dict):
    return {k: _thaw(v) for k, v in value.items()}
  return value
