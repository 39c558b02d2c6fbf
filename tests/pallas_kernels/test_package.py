"""The kernels' package has one name, `linear_attention_jax.pallas_kernels`: the repository's
`pallas_kernels/` folder, linked into the library in a checkout and mapped there by setup.py in a wheel.
No file imports it by a top-level name (a second copy of the modules would carry its own
`interpret_kernels()` switches), and the top-level name refuses to import."""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sources():
  """(name, Python source) of every Python file and notebook code cell of the repository."""
  for top, dirs, files in os.walk(ROOT):  # symlinked folders (the checkout's link) are not followed
    dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")) and d not in ("build", "runs"))
    for file in sorted(files):
      path = pathlib.Path(top) / file
      name = str(path.relative_to(ROOT))
      if path.suffix == ".py":
        yield name, path.read_text()
      elif path.suffix == ".ipynb":
        cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        yield name, "\n".join(line for c in cells for line in c.splitlines()
                               if not line.lstrip().startswith(("!", "%")))


def _top_level_imports(source: str) -> list[str]:
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found += [a.name for a in node.names if a.name.split(".")[0] == "pallas_kernels"]
    elif (isinstance(node, ast.ImportFrom) and not node.level
          and (node.module or "").split(".")[0] == "pallas_kernels"):
      found.append(node.module)
  return found


def test_no_file_imports_the_kernels_by_a_top_level_name():
  bad = {name: imports for name, source in _sources() if (imports := _top_level_imports(source))}
  assert not bad, bad


def test_the_checkout_links_the_folder_into_the_library():
  link = ROOT / "linear_attention_jax" / "pallas_kernels"
  assert link.resolve() == (ROOT / "pallas_kernels").resolve()


def test_the_top_level_name_refuses_and_the_library_name_is_the_only_copy():
  import linear_attention_jax.pallas_kernels.gpu  # noqa: F401
  import linear_attention_jax.pallas_kernels.tpu  # noqa: F401
  assert not [m for m in sys.modules if m.split(".")[0] == "pallas_kernels"]
  sys.path.insert(0, str(ROOT))
  try:
    with pytest.raises(ImportError, match="import linear_attention_jax.pallas_kernels, not pallas_kernels"):
      importlib.import_module("pallas_kernels")
  finally:
    sys.path.remove(str(ROOT))
    sys.modules.pop("pallas_kernels", None)
