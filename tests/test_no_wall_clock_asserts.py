"""No test asserts on wall-clock time: a busy CI machine is slower, not wrong. Times are printed; a
hang is caught by a generous timeout (the notebooks' per-cell timeout)."""

from __future__ import annotations

import ast
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
CLOCKS = {"perf_counter", "time", "monotonic", "perf_counter_ns", "monotonic_ns"}


def _is_clock_call(node) -> bool:
  return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in CLOCKS and isinstance(node.func.value, ast.Name)
          and node.func.value.id == "time")


def timed_asserts(source: str) -> list[int]:
  """Lines of asserts whose test reads a name computed from a clock reading."""
  tree = ast.parse(source)
  timed = set()
  for _ in range(2):  # names from clocks, then names from those (seconds = end - start)
    for node in ast.walk(tree):
      if isinstance(node, ast.Assign) and any(
          _is_clock_call(n) or (isinstance(n, ast.Name) and n.id in timed) for n in ast.walk(node.value)):
        timed |= {t.id for t in node.targets if isinstance(t, ast.Name)}
  return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)
          and any(isinstance(n, ast.Name) and n.id in timed for n in ast.walk(node.test))]


def test_the_checker_sees_a_timed_assert():
  assert timed_asserts("import time\nt = time.perf_counter()\ns = time.perf_counter() - t\n"
                       "assert s < 180\n") == [4]


def test_no_test_asserts_on_wall_clock_time():
  found = {}
  for root, _, names in os.walk(TESTS):
    for name in names:
      if name.endswith(".py"):
        path = os.path.join(root, name)
        with open(path, encoding="utf-8") as f:
          lines = timed_asserts(f.read())
        if lines:
          found[os.path.relpath(path, TESTS)] = lines
  assert not found, f"asserts on wall-clock time (print the time instead): {found}"
