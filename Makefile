# Two commands: `make run` (the main job) and `make test`; `make equivalence` prints the scan-vs-chunk table;
# `make docs` builds the API reference (pdoc, warnings as errors) into build/docs. Each builds .venv with Python 3.12 first.
# PYTHON picks the interpreter (default: the first Python 3.12 that runs of python3.12 on the PATH,
# python3, and pyenv's 3.12.1).
PYTHON ?= $(shell for p in python3.12 python3 "$$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3"; do \
  "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/mqar_hybrid

# The public modules the API reference covers; its index must list each (a package's __all__ decides
# what its page shows).
DOC_MODULES := linear_attention_jax.ops linear_attention_jax.layers linear_attention_jax.models \
  linear_attention_jax.models.hf linear_attention_jax.sharding linear_attention_jax.sharding.checkpoint

NEWEST_VENV := .venv-newest-jax
# The quick subset run on the newest jax the registry serves: the ops (the TPU kernels through them in
# their interpreter), the layers, the kernels' imports and preparation, and both backends' lowering
# (jax.export for TPU and Hopper), the short convolution's GPU kernels (interpreter and export), the race
# detector's runs and kda's two-warpgroup kernels (interpreter).
# 509 tests, ~6-8 min with -n 2 (jax 0.12.1).
NEWEST_TESTS ?= tests/ops/test_checks.py tests/ops/test_edges_and_traced.py tests/ops/test_forward_mode.py \
  tests/ops/test_variants.py tests/ops/test_pallas_dispatch.py tests/layers \
  tests/pallas_kernels/test_imports.py tests/pallas_kernels/test_prep.py \
  tests/pallas_kernels/tpu/test_lowering.py tests/pallas_kernels/gpu/test_lowering.py \
  tests/pallas_kernels/gpu/test_conv.py tests/pallas_kernels/gpu/test_cumsum.py \
  tests/pallas_kernels/gpu/test_gate.py tests/pallas_kernels/gpu/test_l2_grads.py \
  tests/pallas_kernels/gpu/test_once.py \
  tests/pallas_kernels/gpu/test_shared_compiles.py tests/pallas_kernels/gpu/test_races.py \
  tests/pallas_kernels/gpu/test_channel_delta_keys.py tests/pallas_kernels/gpu/test_channel_prep_split.py \
  tests/pallas_kernels/gpu/test_smem_count.py

.PHONY: venv run equivalence test docs test-newest-jax clean

$(VENV)/.installed: setup.py requirements-ci.txt
	@test -n "$(PYTHON)" || { echo "no Python 3.12 found: run with PYTHON=/path/to/python3.12"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements-ci.txt
	$(PY) -m pip install -e '.[test,experiments,docs]'
	touch $@

venv: $(VENV)/.installed

run: venv
	$(PY) experiments/train.py --config=mqar_hybrid --workdir=$(WORKDIR)

equivalence: venv
	$(PY) experiments/equivalence.py --workdir=runs/equivalence

# A test worker once died of a segmentation fault inside XLA's CPU compile of a kernel interpreter
# program (large ones), on a loaded machine; the cause is not known, and in case it is the depth of the
# compiler's recursion the tests run with a 64 MB stack where the default is 8 MB.
STACK := ulimit -s 65536 2>/dev/null || true;

# Two workers, each taking whole files (--dist loadfile): a file's cases share their compiled programs
# (same function, shapes and static arguments), which the default per-test distribution compiles once
# per worker (tests/ops/test_nonfinite.py: 340 -> 188 worker-seconds).
PYTEST_WORKERS := -n 2 --dist loadfile

test: venv
	$(STACK) $(PY) -m pytest $(PYTEST_WORKERS) -q --durations=30 tests

docs: venv
	rm -rf build/docs
	JAX_PLATFORMS=cpu $(PY) -W error -m pdoc --docformat markdown -o build/docs $(DOC_MODULES)
	@for m in $(DOC_MODULES); do grep -q "href=\"$$(echo $$m | tr . /).html\"" build/docs/index.html \
	  || { echo "build/docs/index.html does not list $$m"; exit 1; }; done
	@echo "API reference: build/docs/index.html"

# The newest jax on the registry (setup.py allows it), without the CI pin; a quick subset only.
test-newest-jax:
	@test -n "$(PYTHON)" || { echo "no Python 3.12 found: run with PYTHON=/path/to/python3.12"; exit 1; }
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install --upgrade pip
	$(NEWEST_VENV)/bin/python -m pip install --upgrade -e '.[test]' jax jaxlib
	$(NEWEST_VENV)/bin/python -c 'import jax; print("jax", jax.__version__)'
	$(STACK) $(NEWEST_VENV)/bin/python -m pytest $(PYTEST_WORKERS) -q $(NEWEST_TESTS)

clean:
	rm -rf $(VENV) $(NEWEST_VENV) runs build/docs
