# Two entry points on a fresh clone: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedfleet-installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

# torch first and pinned: an unpinned torch with none installed pulls several GB of CUDA wheels.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[coordinator,dev]'
	touch $@

demo: setup
	$(VENV)/bin/coordinator models --arch resnet18 --num-classes 10 --ratios 1,1/2,1/4,1/8
	$(VENV)/bin/coordinator models --arch resnet34 --num-classes 100 --ratios 1,1/2,1/4,1/8
	$(PY) examples/fedhm_round.py

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q; status=$$?; if [ $$status -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$status

bench: setup
	$(PY) -m benchmarks.refactorize --json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
