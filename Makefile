# Two commands: `make run` (the main job) and `make test`; `make equivalence` prints the scan-vs-chunk table. Each builds .venv with Python 3.12 first.
# PYTHON picks the interpreter (default: the first Python 3.12 that runs of python3.12 on the PATH,
# python3, and pyenv's 3.12.1).
PYTHON ?= $(shell for p in python3.12 python3 "$$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3"; do \
  "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/mqar_hybrid

.PHONY: venv run equivalence test clean

$(VENV)/.installed: setup.py requirements-ci.txt
	@test -n "$(PYTHON)" || { echo "no Python 3.12 found: run with PYTHON=/path/to/python3.12"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements-ci.txt
	$(PY) -m pip install -e '.[test,experiments]'
	touch $@

venv: $(VENV)/.installed

run: venv
	$(PY) experiments/train.py --config=mqar_hybrid --workdir=$(WORKDIR)

equivalence: venv
	$(PY) experiments/equivalence.py --workdir=runs/equivalence

test: venv
	$(PY) -m pytest -n 2 -q tests

clean:
	rm -rf $(VENV) runs
