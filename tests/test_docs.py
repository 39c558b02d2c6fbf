"""The API reference: every public name of the four public packages has a docstring, and every public
function and class that takes or returns arrays says their shapes (`[B, T, ...]`, the alphabet of
shared/STYLE.md)."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

PACKAGES = ("ops", "layers", "models", "sharding")
SHAPE = re.compile(r"`[^`]*\[[^\]`]*\][^`]*`")  # a back-quoted shape, e.g. `q: [B, T, H, K]`, `[B, H_v]`
# Public names that hold no arrays (configs, names, registries): a docstring, no shapes.
NO_ARRAYS = {
    "ops": {"IMPLS", "VARIANTS", "FEATURE_MAPS", "select_impl"},
    "layers": {"nbytes"},
    "models": {"MIXER_LETTERS", "LMConfig", "HybridConfig", "count_params", "param_count_table",
               "param_counts_markdown", "preset_125m"},
    "sharding": {"LOGICAL_AXES", "MESH_AXES", "RULE_SETS", "MeshConfig", "check_model_config",
                 "config_from_flags", "define_flags", "flags_given", "initialize_distributed",
                 "make_mesh", "current_rules", "rule_set", "use_rules", "axes", "to_spec",
                 "for_current_rules", "make_sharded_train_step", "make_sharded_eval_step",
                 "shard_train_state", "state_shardings", "named_sharding"},
}


def public(package):
  module = importlib.import_module(f"linear_attention_jax.{package}")
  return [(name, getattr(module, name)) for name in module.__all__]


def doc_of(obj):
  doc = inspect.getdoc(obj) or ""
  if inspect.isclass(obj):  # a class's shapes may sit on its call
    doc += "\n" + (inspect.getdoc(getattr(obj, "__call__", None)) or "")
  return doc


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_callable_has_a_docstring(package):
  missing = [name for name, obj in public(package) if callable(obj) and not inspect.getdoc(obj)]
  assert not missing, f"linear_attention_jax.{package}: no docstring on {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_array_function_says_its_shapes(package):
  missing = [name for name, obj in public(package)
             if callable(obj) and name not in NO_ARRAYS[package] and not SHAPE.search(doc_of(obj))]
  assert not missing, f"linear_attention_jax.{package}: no back-quoted shape in the docstring of {missing}"
