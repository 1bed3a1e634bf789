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

.PHONY: test lint bench serve clean lock wheel image-env sbom base-digest docs

# Hashed lock files (`make lock`) for the image's platform, Linux x86_64 and Python 3.11:
# runtime.txt, one per extra of pyproject.toml (a new extra gets its own), the image's
# EXTRAS (Dockerfile), build.txt (pip and the build backend) and sbom.txt (the SBOM tool).
# Every venv below installs from them with --require-hashes, then bagserve with --no-deps.
LOCKS := requirements
comma := ,
EXTRAS = $(shell $(PYTHON) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"])')
IMAGE_EXTRAS = $(shell sed -n 's/^ARG EXTRAS=//p' Dockerfile)
IMAGE_LOCK = $(LOCKS)/$(or $(subst $(comma),-,$(IMAGE_EXTRAS)),runtime).txt
# The existing pins are kept unless a requirement moved; `make lock UPGRADE=1` takes the
# newest versions. Every lock but dev.txt is constrained by dev.txt, so the image runs
# the versions the tests ran.
# Python 3.11.7, the oldest 3.11 the project runs on (the machines'; the image has
# 3.11.15): plain 3.11 means 3.11.0 and would drop releases that need 3.11.5.
UV_COMPILE = $(BIN)/uv pip compile --quiet --generate-hashes --python-version 3.11.7 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" \
	$(if $(UPGRADE),--upgrade)

$(BIN)/.installed: pyproject.toml $(LOCKS)/build.txt $(LOCKS)/runtime.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes -r $(LOCKS)/build.txt
	$(BIN)/python -m pip install --quiet --require-hashes -r $(LOCKS)/runtime.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# Serve on 127.0.0.1:8000; the demo models are trained first if $(MODELS) is empty.
serve: $(BIN)/.installed
	@if [ -z "$$(ls -A $(MODELS) 2>/dev/null)" ]; then $(BIN)/bagserve demo --models $(MODELS); fi
	$(BIN)/bagserve serve --host 127.0.0.1 --port 8000 --models $(MODELS)

$(BIN)/.dev-installed: pyproject.toml $(LOCKS)/build.txt $(LOCKS)/dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes -r $(LOCKS)/build.txt
	$(BIN)/python -m pip install --quiet --require-hashes -r $(LOCKS)/dev.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@ $(BIN)/.installed

lock: $(BIN)/.dev-installed
	$(UV_COMPILE) pyproject.toml --extra dev -o $(LOCKS)/dev.txt
	$(UV_COMPILE) -c $(LOCKS)/dev.txt pyproject.toml -o $(LOCKS)/runtime.txt
	set -e; for extra in $(filter-out dev,$(EXTRAS)); do \
	    $(UV_COMPILE) -c $(LOCKS)/dev.txt pyproject.toml --extra $$extra -o $(LOCKS)/$$extra.txt; \
	done
	$(UV_COMPILE) -c $(LOCKS)/dev.txt pyproject.toml \
	    $(addprefix --extra ,$(subst $(comma), ,$(IMAGE_EXTRAS))) -o $(IMAGE_LOCK)
	$(PYTHON) -c 'import tomllib; print("pip", *tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' \
	    | $(UV_COMPILE) -c $(LOCKS)/dev.txt - -o $(LOCKS)/build.txt
	$(UV_COMPILE) --group sbom -o $(LOCKS)/sbom.txt

# The image's environment without a Docker engine: the wheel built by the locked backend
# from what the Dockerfile copies (a clean copy: no stale build/ of the work tree), then a
# fresh venv installed as the image installs (its lock with --require-hashes, the wheel
# with --no-deps). CI runs the tests of the installed package against it.
IMAGE_ENV := build/image-env
wheel:
	rm -rf build/wheel-src build/build-env dist
	mkdir -p build/wheel-src dist
	tar -c --exclude=__pycache__ pyproject.toml README.md LICENSE core service bagserve \
	    | tar -x -C build/wheel-src
	$(PYTHON) -m venv build/build-env
	build/build-env/bin/python -m pip install --quiet --require-hashes -r $(LOCKS)/build.txt
	build/build-env/bin/python -m pip wheel --quiet --no-deps --no-build-isolation \
	    --wheel-dir dist build/wheel-src

image-env: wheel
	rm -rf $(IMAGE_ENV)
	$(PYTHON) -m venv $(IMAGE_ENV)
	$(IMAGE_ENV)/bin/python -m pip install --quiet --require-hashes -r $(IMAGE_LOCK)
	$(IMAGE_ENV)/bin/python -m pip install --quiet --no-deps dist/bagserve-*.whl
	$(IMAGE_ENV)/bin/python -m pip check
	$(IMAGE_ENV)/bin/bagserve --version

# The CycloneDX SBOM (JSON) of the image's environment, by cyclonedx-py from its own venv;
# bagserve is one of its components (--pyproject would make it the root, without version).
SBOM := dist/bagserve-image.cdx.json
sbom: image-env
	rm -rf build/sbom-env
	$(PYTHON) -m venv build/sbom-env
	build/sbom-env/bin/python -m pip install --quiet --require-hashes -r $(LOCKS)/sbom.txt
	build/sbom-env/bin/cyclonedx-py environment --output-reproducible -o $(SBOM) $(IMAGE_ENV)
	@$(PYTHON) -c 'import json, sys; print(sys.argv[1] + ":", len(json.load(open(sys.argv[1]))["components"]), "components")' $(SBOM)

# The current digest of the Dockerfile's base image tag (its multi-platform index), to
# paste into both FROM lines with the date in the comment above them, then `make lock
# sbom`. Needs a registry: docker buildx, else skopeo.
BASE_IMAGE = $(shell sed -n 's/^FROM \([^@ ]*\)@.*/\1/p' Dockerfile | head -n 1)
base-digest:
	@if docker buildx version >/dev/null 2>&1; then \
	    docker buildx imagetools inspect --format '{{.Manifest.Digest}}' $(BASE_IMAGE); \
	else \
	    echo "sha256:$$(skopeo inspect --raw docker://docker.io/library/$(BASE_IMAGE) | sha256sum | cut -d' ' -f1)"; \
	fi

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
	$(BIN)/python bench/bench_cli_start.py
	$(BIN)/python bench/bench_gram.py
	$(BIN)/python bench/bench_service.py
	$(BIN)/python bench/bench_mlserver.py
	$(BIN)/python bench/bench_start.py
	$(BIN)/python bench/bench_model_memory.py
	$(BIN)/python bench/bench_jobs.py
	$(BIN)/python bench/bench_event_loop.py
	$(BENCH_ENV) $(BIN)/python bench/bench_density.py
	$(BENCH_ENV) $(BIN)/python bench/bench_dg.py
	$(BENCH_ENV) $(BIN)/python bench/bench_dg_baselines.py
	$(BIN)/python bench/bench_training.py
	$(BENCH_ENV) $(BIN)/python bench/bench_reference_sample.py
	$(BENCH_ENV) $(BIN)/python bench/bench_new_batch.py
	$(BIN)/python bench/bench_control_calibration.py
	$(BENCH_ENV) $(BIN)/python bench/bench_real_batches.py
	$(BENCH_ENV) $(BIN)/python bench/bench_dg_regression.py
	$(BENCH_ENV) $(BIN)/python bench/bench_scale.py
	$(BENCH_ENV) $(BIN)/python bench/bench_conformal.py
	$(BENCH_ENV) $(BIN)/python bench/bench_intervals.py
	$(BENCH_ENV) $(BIN)/python bench/bench_explain.py
	$(BENCH_ENV) $(BIN)/python bench/reproduce_density.py
	$(BENCH_ENV) $(BIN)/python bench/reproduce_dg.py
	$(BENCH_ENV) $(BIN)/python bench/reproduce_cme.py
	$(BENCH_ENV) $(BIN)/python bench/reproduce_sw_gmm.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build dist
