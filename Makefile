# The two commands of the README: `make test` and (from the service on) `make serve`.
# Everything is installed into ./.venv; nothing depends on the caller's shell state.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# One BLAS thread per test worker: pytest-xdist already uses both cores.
TEST_ENV := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
PYTEST_WORKERS ?= 2
# The marginal-transfer solvers run many small BLAS calls: one thread avoids spinning.
BENCH_ENV := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

MODELS ?= models

.PHONY: test lint bench serve clean docs

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

# Serve on 127.0.0.1:8000; the demo models are trained first if $(MODELS) is empty.
serve: $(BIN)/.installed
	@if [ -z "$$(ls -A $(MODELS) 2>/dev/null)" ]; then $(BIN)/bagserve demo --models $(MODELS); fi
	$(BIN)/bagserve serve --host 127.0.0.1 --port 8000 --models $(MODELS)

$(BIN)/.dev-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(BIN)/.installed

# The user guide and the API reference (mkdocs.yml) into site/, offline; --strict fails on
# a broken link or anchor, an unknown Python name or a page missing from the navigation.
docs: $(BIN)/.dev-installed
	$(BIN)/mkdocs build --strict

lint: $(BIN)/.dev-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(TEST_ENV) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) tests

# Timings first (they want a quiet machine), then the long paper reproductions.
bench: $(BIN)/.dev-installed
	$(BIN)/python bench/bench_gram.py
	$(BIN)/python bench/bench_service.py
	$(BIN)/python bench/bench_jobs.py
	$(BIN)/python bench/bench_event_loop.py
	$(BENCH_ENV) $(BIN)/python bench/bench_density.py
	$(BENCH_ENV) $(BIN)/python bench/bench_dg.py
	$(BENCH_ENV) $(BIN)/python bench/bench_dg_baselines.py
	$(BENCH_ENV) $(BIN)/python bench/bench_reference_sample.py
	$(BENCH_ENV) $(BIN)/python bench/bench_dg_regression.py
	$(BENCH_ENV) $(BIN)/python bench/bench_scale.py
	$(BENCH_ENV) $(BIN)/python bench/bench_conformal.py
	$(BENCH_ENV) $(BIN)/python bench/bench_intervals.py
	$(BENCH_ENV) $(BIN)/python bench/reproduce_density.py
	$(BENCH_ENV) $(BIN)/python bench/reproduce_dg.py
	$(BENCH_ENV) $(BIN)/python bench/reproduce_cme.py
	$(BENCH_ENV) $(BIN)/python bench/reproduce_sw_gmm.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
