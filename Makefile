# Two entry points for people: `make demo` and `make test`; both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Touched after a complete install, so an interrupted one is redone and a finished one is not.
STAMP := $(VENV)/.flashhopper-installed
# A usable NVIDIA GPU means the machine already has a CUDA torch: reuse it instead of a CPU wheel.
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)

.PHONY: venv test test-full demo gpu-test gpu-test-full

venv: $(STAMP)

$(STAMP): pyproject.toml
ifeq ($(HAVE_GPU),yes)
	test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV)
else
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
endif
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# pytest workers: they share the kernel cache on disk, so each kernel compiles once per run
TEST_JOBS ?= 2

test: venv
	$(BIN)/ruff check flashhopper tests scripts
	$(BIN)/python -m pytest -q -n $(TEST_JOBS)

# every dispatched kernel compiled and checked (tests/test_dispatched.py), not only CI's covering subset:
# run before a kernel change lands
test-full: venv
	$(BIN)/ruff check flashhopper tests scripts
	FH_TEST_FULL=1 $(BIN)/python -m pytest -q -n $(TEST_JOBS)

demo: venv
	$(BIN)/python -m flashhopper.cli demo

# The whole GPU suite on an H100/H200 (after `source .device/setup.sh` there): the dispatched kernels
# compiled first by parallel workers, then the tests in GPU_JOBS processes sharing one GPU and the
# kernel cache, with compiling forbidden (a kernel precompile did not build fails its test); a GPU
# test that skips fails.
GPU_JOBS ?= 8
gpu-test:
	python3 -m flashhopper.cli precompile --bwd --paged --decode --jobs $$(nproc)
	FLASHHOPPER_JIT=0 FH_REQUIRE_GPU=1 python3 -m pytest -q -m gpu -n $(GPU_JOBS) tests

# also the GPU tests of kernel variants no user is dispatched (tests marked `variant`), compiled as
# they come: run before a kernel change lands
gpu-test-full:
	python3 -m flashhopper.cli precompile --bwd --paged --decode --jobs $$(nproc)
	FH_TEST_FULL=1 FH_REQUIRE_GPU=1 python3 -m pytest -q -m gpu -n $(GPU_JOBS) tests
