"""The kernel package's house rules, read from the source with `ast`: no module reaches into another
module's private (`_`-prefixed) names, by `from ... import _name` or by `module._name`, and no file
grows past 520 lines (shared helpers live in their own modules: gpu/tiles.py, gpu/pipeline.py, ...)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pallas_kernels"
FILES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 520


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
  path = ROOT.joinpath(*name.split("."))
  return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _reaches(path: pathlib.Path, source: str | None = None) -> list[str]:
  """Every use in the module at `path` (its text, or `source`) of another pallas_kernels module's
  private name."""
  tree = ast.parse(path.read_text() if source is None else source, str(path))
  here = _module_name(path)
  package = here if path.name == "__init__.py" else here.rpartition(".")[0]
  modules = {}   # local name -> pallas_kernels module it is bound to
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "pallas_kernels":
          if alias.asname:
            modules[alias.asname] = alias.name
    elif isinstance(node, ast.ImportFrom):
      source = node.module or ""
      if node.level:
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        source = ".".join(base + ([source] if source else []))
      if source.split(".")[0] != "pallas_kernels":
        continue
      for alias in node.names:
        if _is_module(f"{source}.{alias.name}"):
          modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif _private(alias.name) and source != here:
          found.append(f"line {node.lineno}: from {source} import {alias.name}")
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
        and _private(node.attr) and modules[node.value.id] != here):
      found.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({modules[node.value.id]})")
    elif isinstance(node, ast.Attribute) and _private(node.attr):
      dotted = ast.unparse(node.value)
      if dotted.startswith("pallas_kernels.") and _is_module(dotted) and dotted != here:
        found.append(f"line {node.lineno}: {dotted}.{node.attr}")
  return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_uses_another_modules_private_names(path):
  assert not _reaches(path), _reaches(path)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_stay_small(path):
  name = str(path.relative_to(ROOT))
  lines = len(path.read_text().splitlines())
  assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES})"


def test_the_check_sees_private_names():
  # Given a kernel module's text that imports a private name and reaches two through modules, when it
  # is read, then all three uses are reported, and its own private names are not.
  source = ("from pallas_kernels.gpu.tiles import _hidden\nfrom pallas_kernels.gpu import walk\n"
            "import pallas_kernels.gpu.tiles as t\nwalk._forward_kernel\nt._x\n"
            "from pallas_kernels.gpu.fused import _own\n")
  found = _reaches(PACKAGE / "gpu" / "fused.py", source)
  assert len(found) == 3, found
