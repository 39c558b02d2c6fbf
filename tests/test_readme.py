"""The README's fenced Python blocks run as written, each on its own, from the repository root."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(path: str) -> list[str]:
  """The bodies of the ```python fences of a Markdown file, in order."""
  with open(path, encoding="utf-8") as f:
    return re.findall(r"^```python\n(.*?)^```$", f.read(), flags=re.MULTILINE | re.DOTALL)


BLOCKS = python_blocks(os.path.join(ROOT, "README.md"))


def test_the_readme_has_python_examples():
  assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_as_written(index, monkeypatch, capsys):
  # Given one fenced block of the README, in a fresh namespace, from the repository root
  monkeypatch.chdir(ROOT)
  # When it runs
  exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {"__name__": "readme"})
  # Then it raises nothing (its prints go to the captured output)
  capsys.readouterr()
