"""The notebooks: committed without outputs, installing only in Colab, and run top to bottom on a CPU
(the test suite's backend), failing on any cell's error. The time each takes is printed, not asserted
(a busy CI machine is slower, not wrong); a generous timeout per cell catches a hang."""

from __future__ import annotations

import json
import os
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
NAMES = ("01_quickstart.ipynb", "02_tradeoff.ipynb", "03_kernels_and_speed.ipynb")
HANG_S = 900  # per cell: a cell still running after this is taken for a hang
KERNEL = "linear-attention-jax-tests"


def read(name):
  return nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)


def test_the_folder_holds_these_notebooks():
  assert sorted(f for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")) == list(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_without_outputs_and_installs_only_in_colab(name):
  nb = read(name)
  nbformat.validate(nb)
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  # Then no cell carries outputs or an execution count
  assert all(cell.outputs == [] and cell.execution_count is None for cell in code)
  # And the first code cell installs from the repository only inside Colab
  first = code[0].source
  assert 'REPO_URL = "' in first and 'if "google.colab" in sys.modules:' in first
  # And the README links the notebook from Colab
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    assert f"/blob/main/notebooks/{name})" in f.read()


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
  """A kernel spec that starts this interpreter's ipykernel, and a kernel environment kept in tmp_path:
  CPU backend, the repository importable as in the tests, temporary files under tmp_path."""
  spec = tmp_path / "jupyter" / "kernels" / KERNEL
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "linear_attention_jax tests", "language": "python"}))
  (tmp_path / "tmp").mkdir()
  pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
  for key, value in dict(JUPYTER_PATH=tmp_path / "jupyter", JUPYTER_RUNTIME_DIR=tmp_path / "runtime",
                         IPYTHONDIR=tmp_path / "ipython", TMPDIR=tmp_path / "tmp", JAX_PLATFORMS="cpu",
                         PYTHONPATH=pythonpath).items():
    monkeypatch.setenv(key, str(value))


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_top_to_bottom_on_cpu(name, kernel_env):
  # Given the committed notebook, in a kernel started in notebooks/ as Jupyter would
  nb = read(name)
  client = NotebookClient(nb, kernel_name=KERNEL, timeout=HANG_S,
                          resources={"metadata": {"path": NOTEBOOKS}})
  # When every cell runs in order (an error in any cell raises CellExecutionError)
  start = time.perf_counter()
  client.execute()
  seconds = time.perf_counter() - start
  print(f"{name}: {seconds:.1f} s")  # reported, not asserted
  # Then it ran with the CPU sizes
  text = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                 for out in cell.outputs)
  assert "CPU runtime" in text


@pytest.mark.parametrize("name", NAMES)
def test_install_cell_takes_repo_url_and_says_why_it_cannot_install(name, monkeypatch, tmp_path):
  # Given the notebook's install cell, run as in Colab, with pip and git replaced by a recorder
  import subprocess
  import types
  first = [cell for cell in read(name).cells if cell.cell_type == "code"][0].source
  assert "# @param" in first.splitlines()[1]
  monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
  monkeypatch.setattr(sys, "path", list(sys.path))
  calls = []

  def fake_run(returncode):
    def run(args, **kwargs):
      calls.append(args)
      return subprocess.CompletedProcess(args, returncode, stdout="", stderr="ERROR: no such repository")
    return run

  # When REPO_URL names a local checkout and pip succeeds
  monkeypatch.setattr(subprocess, "run", fake_run(0))
  local = first.replace('REPO_URL = "https://', f'REPO_URL = {ROOT!r}  # "https://', 1)
  exec(compile(local, name, "exec"), {"__name__": "cell"})
  # Then pip installs that checkout, and nothing is cloned
  assert calls[-1][:4] == [sys.executable, "-m", "pip", "install"] and calls[-1][5].startswith(ROOT)
  assert not any(call[0] == "git" for call in calls)
  # When the default URL cannot be fetched
  monkeypatch.setattr(subprocess, "run", fake_run(1))
  monkeypatch.chdir(tmp_path)
  with pytest.raises(RuntimeError, match=r"REPO_URL='https://github.com/.*'.*\n.*no such repository"):
    exec(compile(first, name, "exec"), {"__name__": "cell"})
