# Two entry points on a fresh clone: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedfleet-installed

.PHONY: setup demo test test-fast test-stress lint docs docs-reference bench device-e2e clean

setup: $(STAMP)

# torch first and pinned: an unpinned torch with none installed pulls several GB of CUDA wheels.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[coordinator,dev]'
	touch $@

# The main demo: a coordinator, a managed broker and nine emulated device agents (FedHM on digits).
# DEMO_ARGS passes more flags to `coordinator emulate` (e.g. DEMO_ARGS="--rounds 2 --no-live").
demo: setup
	$(VENV)/bin/coordinator plan --fleet examples/demo.yaml
	$(VENV)/bin/coordinator emulate --fleet examples/demo.yaml $(DEMO_ARGS)

# Style, formatting, the layering contracts of docs/architecture.md (import-linter) and the docs site:
# --strict makes a broken link or a missing page fail.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The docs site in site/ (mkdocs serve for a live preview).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# docs/fleet-yaml.md's reference table, regenerated from the fleet.yaml models' field descriptions.
docs-reference: setup
	$(PY) -m coordinator.config.reference

# The full suite (what CI runs), with the 25 slowest tests listed at the end.
test: lint
	$(PY) -m pytest -q --durations=25; status=$$?; if [ $$status -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$status

# The inner loop: everything but the process-spawning tests (tests/e2e) and those marked slow.
test-fast: setup
	$(PY) -m pytest -q -x --ignore=tests/e2e -m "not slow" --durations=10; status=$$?; if [ $$status -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$status

# The full suite with every core kept busy by a busy loop at the same priority (one per core): the waits
# that only hold on an idle machine fail here. STRESS_ARGS narrows it (e.g. STRESS_ARGS=tests/e2e).
test-stress: setup
	@hogs=""; for i in $$(seq $$(nproc)); do sh -c 'while :; do :; done' & hogs="$$hogs $$!"; done; \
	trap 'kill $$hogs' EXIT; start=$$(date +%s); \
	$(PY) -m pytest -q -p no:cacheprovider $(STRESS_ARGS); status=$$?; \
	echo "test-stress: exit $$status after $$(( $$(date +%s) - start )) s with $$(nproc) busy loops"; \
	if [ $$status -eq 5 ]; then exit 0; fi; exit $$status

# Every benchmark (the list is benchmarks/suite.py's SUITE) -> benchmarks/results.json and the README's table.
bench: setup
	$(PY) -m benchmarks.suite

# As root: a provisioned kit installs (its own install.sh, offline) and trains 2 rounds on Debian bookworm
# arm64 under qemu-user, in a network namespace of its own; the rootfs and aarch64 wheels are cached in
# ~/.cache/fedfleet. Many minutes. DEVICE_E2E_ARGS passes more flags (e.g. "--json --rounds 3").
device-e2e: setup
	$(PY) -m benchmarks.device_e2e $(DEVICE_E2E_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info site
