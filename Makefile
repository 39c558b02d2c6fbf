# Two commands: `make run` (the main job) and `make test`. Each builds .venv with Python 3.12 first.
# PYTHON picks the interpreter (default: python3.12 on PATH, else pyenv's 3.12.1).
PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo $$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3)
VENV := .venv
PY := $(VENV)/bin/python
WORKDIR ?= runs/equivalence

.PHONY: venv run test bench clean

$(VENV)/.installed: setup.py requirements-ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements-ci.txt
	$(PY) -m pip install -e '.[test,experiments]'
	touch $@

venv: $(VENV)/.installed

run: venv
	$(PY) experiments/equivalence.py --workdir=$(WORKDIR)

test: venv
	$(PY) -m pytest -n 2 -q tests

clean:
	rm -rf $(VENV) runs
