# kvoffload developer entry points. Every install step lives here so that a fresh
# machine (and CI) needs nothing but python3.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvoffload-installed
PYTEST_ARGS ?=

.PHONY: setup run test test-gpu test-vllm bench bench-report soak lint clean

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU build, so the unpinned "torch" extra below
# is already satisfied and never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[torch,dev,redis]'
	touch $(STAMP)

# Start the daemon in the foreground with embedded defaults (1 GiB region).
run: $(STAMP)
	$(BIN)/kvoffloadd $(ARGS)

test: $(STAMP)
	@tools/ensure-redis-server
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu $(PYTEST_ARGS)

# The vLLM plug-in against the real vLLM 0.33 classes, in a separate virtualenv:
# vllm with --no-deps (its kv_offload modules import nothing beyond torch and numpy),
# so `make test` stays free of vLLM and its tests skip there.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvoffload-installed
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[torch,dev,redis]'
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps vllm==0.33.0
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm $(PYTEST_ARGS)

bench: $(STAMP)
	@tools/ensure-redis-server
	$(BIN)/python -m kvoffloadctl.bench $(ARGS)

# Every benchmark, written to docs/benchmarks.md with plots (matplotlib: the bench extra).
BENCH_STAMP := $(VENV)/.kvoffload-bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[torch,dev,redis,bench]'
	touch $(BENCH_STAMP)

bench-report: $(BENCH_STAMP)
	@tools/ensure-redis-server
	$(BIN)/python -m kvoffloadctl.bench_report $(ARGS)

# Long random load from several engines with every loaded byte verified (not in test).
soak: $(STAMP)
	$(BIN)/python -m kvoffloadctl.soak $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check daemon libclient tools tests
	$(BIN)/ruff format --check daemon libclient tools tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
