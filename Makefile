# Local install path: a virtual environment with the CPU build of torch pinned (an unpinned torch
# pulls a multi-GB CUDA build). GPU clusters install their own torch and then `pip install -e .`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
# pytest-xdist workers for `make test` (TEST_WORKERS=0: one process). With 4 (the default, as CI runs it) the
# slurm tier runs on one worker per testbed (CI starts two; tests/conftest.py splits the files), one test after
# another on each, and every worker takes unit and slow files when it is free. Scopes go out in collection order
# (slurm, slow, unit: conftest sorts them), not by test count, so that the longest start first. Measured on 2
# cores: 3 workers 15 min 37 s; 4 workers 12 min 47 s to 16 min 22 s over four CI runs (with 3 the box was
# 55-82 % busy for ~5 min while sleep-bound Slurm and hang tests overlapped; with 4 it is 95-100 % busy to the end).
TEST_WORKERS ?= 4

.PHONY: install demo check test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e '.[dev]'
	# Bytecode for the package, as pip writes it for what it installs: an editable install has none, and where
	# PYTHONDONTWRITEBYTECODE is set every process would compile the package again (~0.2 s of CPU each).
	$(BIN)/python -m compileall -q xirang_hpc hydra_plugins
	touch $@

# The main job on the embedded default: 4 ranks (2 virtual nodes x 2) on this machine.
demo: install
	$(BIN)/xirang-train

# ruff, the architecture contract (.importlinter: layers import only downward, no cycles), and the documentation
# site: --strict fails on a broken link, a missing page or an unknown anchor (mkdocs.yml `validation`). Not -q:
# mkdocs 1.6 then drops the warnings that --strict counts, and a broken link passes.
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d $(VENV)/site

# The fast tier for every change: ruff, the layer contract, the unit tests on CHECK_WORKERS pytest-xdist workers
# (1,298 tests: 1 min 50 s - 2 min 30 s on 2 workers here, lint included; CHECK_WORKERS=0 for one process).
CHECK_WORKERS ?= 2
check: install lint
	$(BIN)/python -m pytest -q -m unit $(if $(filter-out 0,$(CHECK_WORKERS)),-n $(CHECK_WORKERS))

# Everything (CI): unit, slow (multi-process training runs) and slurm (the real testbed) tiers; the 40 slowest
# tests are listed at the end (where the suite's time goes, on whatever machine ran it).
test: install lint
	$(BIN)/python -m pytest -q --durations=40 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

clean:
	rm -rf $(VENV) runs data outputs multirun .pytest_cache
