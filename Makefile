# The two commands a newcomer needs (see README.md):
#   make run    set up everything (venv, dependencies, weights, model repository) and run the service
#   make test   set up everything and run the test suite (what CI runs, through .ci/run)
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# PyTorch is only needed to export PyTorch checkpoints (and their tests). This pin is the CPU wheel that
# lies on the project's machines; elsewhere pick one from https://pytorch.org (any 2.4 <= v < 2.15).
TORCH ?= torch==2.13.0
# CompreFace's Python SDK for the compatibility tests, without its requests-toolbelt==0.9.1 pin (that version
# cannot import beside urllib3 2, which tritonclient requires); the dev extra brings requests-toolbelt 1.x.
COMPREFACE_SDK ?= compreface-sdk==0.6.0
PORT ?= 8080
TRITON_PORTS ?= 8000 8001 8002

# Python 3.12 is supported too: `make test-py312` runs the real-server tests that cover the stack end to end
# (Triton with the 3.12 backend stub, the gateway, the compatible APIs) in a 3.12 venv of its own.
PYTHON312 ?= python3.12
VENV312 ?= .venv312
PY312_TESTS ?= tests/model_repository/test_triton_pipeline.py tests/service/test_api_flow.py \
	tests/service/test_deepstack.py tests/service/test_api_readable_errors.py \
	tests/export/test_precision.py

.PHONY: run test test-py312 setup models photos lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.runtime: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[server,cpu]'
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.runtime
	$(PY) -m pip install --quiet '$(TORCH)' -e '.[server,cpu,dev,export,bench,milvus]'
	$(PY) -m pip install --quiet --no-deps '$(COMPREFACE_SDK)'
	touch $@

setup: $(VENV)/.runtime

models: setup
	$(PY) -m export defaults

photos: setup
	$(PY) -m export photos

run: models
	$(PY) -m service --port $(PORT) --triton-ports $(TRITON_PORTS)

test: lint models photos
	$(PY) -m pytest

$(VENV312)/.test: pyproject.toml
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install --quiet --upgrade pip
	$(VENV312)/bin/python -m pip install --quiet -e '.[server,cpu,dev]'
	touch $@

test-py312: $(VENV312)/.test models photos
	$(VENV312)/bin/python -m pytest -p no:cacheprovider $(PY312_TESTS)

# Lint and types (part of `make test`): ruff over the tree, mypy --strict over the code; each model.py
# alone (they share the module name `model`), typed against
# tests/model_repository/fakes/triton_python_backend_utils.py (pyproject's mypy_path).
lint: $(VENV)/.test
	$(PY) -m ruff check .
	$(PY) -m mypy facecore export service gallery recognition bench
	for model in model_repository/*/model.py; do $(PY) -m mypy "$$model" || exit 1; done

clean:
	rm -rf $(VENV) $(VENV312) artifacts model_repository/cpu model_repository/gpu model_repository/ngc-cpu
