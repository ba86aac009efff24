# kvoffload developer entry points. Every install step lives here so that a fresh
# machine (and CI) needs nothing but python3.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvoffload-installed
PYTEST_ARGS ?=

.PHONY: setup venvs run docs test test-one-by-one test-gpu gpu-wheels gpu-check ptx test-vllm test-sglang bench-sglang bench bench-engine bench-submit bench-canonical bench-report soak lint clean bench-region

setup: $(STAMP)

# The three virtualenvs install side by side (make test builds them with -j3); their
# editable installs of this tree take turns, as each rewrites kvoffload.egg-info here.
EDITABLE := flock pyproject.toml

# torch==2.13.0 first: it is the CPU build, so the unpinned "torch" extra below
# is already satisfied and never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml libclient/kvoffload/version.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(EDITABLE) $(BIN)/python -m pip install -q --disable-pip-version-check -e '.[torch,dev,mooncake]'
	touch $(STAMP)

# Start the daemon in the foreground with embedded defaults (1 GiB region).
run: $(STAMP)
	$(BIN)/kvoffloadd $(ARGS)

# The vLLM plug-in against vLLM 0.33's real Scheduler and OffloadingConnector, in a
# separate virtualenv: vllm with --no-deps plus only what its scheduler imports
# (tests/vllm/requirements.txt, --no-deps too: never a CUDA torch, nvidia-* or triton).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvoffload-installed
VLLM_REQUIREMENTS := tests/vllm/requirements.txt
$(VLLM_STAMP): pyproject.toml $(VLLM_REQUIREMENTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(EDITABLE) $(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[torch,dev]'
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps \
		vllm==0.33.0 -r $(VLLM_REQUIREMENTS)
	touch $(VLLM_STAMP)

# The SGLang plug-in against SGLang 0.5.23's real HiCache controller and host pools, in
# a separate virtualenv: sglang with --no-deps plus only what its cache controller
# imports (tests/sglang/requirements.txt, --no-deps too: never a CUDA torch or nvidia-*),
# with SGLang's page-hash C++ extension built into the virtualenv once.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.kvoffload-installed
SGLANG_REQUIREMENTS := tests/sglang/requirements.txt
$(SGLANG_STAMP): pyproject.toml $(SGLANG_REQUIREMENTS)
	@tools/ensure-sglang-build-deps
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(EDITABLE) $(SGLANG_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[torch,dev,mooncake]'
	$(SGLANG_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps \
		sglang==0.5.23 -r $(SGLANG_REQUIREMENTS)
	$(SGLANG_VENV)/bin/python -m kvoffloadbench.sglang_cpu --build
	touch $(SGLANG_STAMP)

# Every virtualenv (below the stamps' definitions: prerequisites expand as read).
venvs: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP)
	@:

# Everything, the vLLM and SGLang suites included (they skip in .venv, which has
# neither engine). The virtualenvs install side by side, and the suites run side by
# side too (tools/test-suites: one lane per core, the longest first): 17-22 min on two
# cores, installs included. Their timed checks measure the daemon, not the machine
# (tests/integration/canary.py), so a loaded machine does not fail them.
test:
	@$(MAKE) --no-print-directory -j3 venvs
	@tools/ensure-redis-servers
	@tools/ensure-mooncake-libs
	@$(BIN)/python tools/test-suites "$(BIN)/python -m pytest -q $(PYTEST_ARGS)" \
		"$(VLLM_VENV)/bin/python -m pytest -q tests/vllm $(PYTEST_ARGS)" \
		"$(SGLANG_VENV)/bin/python -m pytest -q tests/sglang $(PYTEST_ARGS)"

# The same suites one after another (22-35 min on two cores): one output, in order.
test-one-by-one:
	@$(MAKE) --no-print-directory -j3 venvs
	@tools/ensure-redis-servers
	@tools/ensure-mooncake-libs
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm $(PYTEST_ARGS)
	$(SGLANG_VENV)/bin/python -m pytest -q tests/sglang $(PYTEST_ARGS)

test-sglang: $(SGLANG_STAMP)
	@tools/ensure-mooncake-libs
	$(SGLANG_VENV)/bin/python -m pytest -q tests/sglang $(PYTEST_ARGS)

# Backup and prefetch through SGLang's own controller: kvoffload against SGLang's file
# backend on tmpfs and its Mooncake backend with a local master, and memcpy, same run;
# saved for `make bench-report` in docs/bench-sglang.json.
bench-sglang: $(SGLANG_STAMP)
	@tools/ensure-mooncake-libs
	$(SGLANG_VENV)/bin/python -m kvoffloadbench.bench_sglang --json docs/bench-sglang.json $(ARGS)

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu $(PYTEST_ARGS)

# The GPU check for a short GPU slot (docs/gpu-check.md). `make gpu-wheels` runs where
# pip reaches PyPI and fetches the CPython 3.12 manylinux x86_64 wheels the project needs
# beyond the GPU machine's image, and the Debian packages of Mooncake's libraries, into
# .gpu-wheels/ (carried there); `make gpu-check` builds .venv-gpu offline from the
# image's Python (its CUDA PyTorch) and those wheels, and runs every part: figures in
# $$OUT/gpu-check.json (or ARGS="--json FILE").
GPU_WHEELS := .gpu-wheels
# the Debian libraries Mooncake's client loads, for an image without them (tools/gpu-venv)
MOONCAKE_DEBS := $(shell awk '!/^\#/ && NF { print $$2 }' tools/mooncake-libs.txt)
gpu-wheels:
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
		-d $(GPU_WHEELS) -r tools/gpu-requirements.txt
	rm -rf $(GPU_WHEELS)/debs && mkdir -p $(GPU_WHEELS)/debs
	cd $(GPU_WHEELS)/debs && apt-get download -q $(MOONCAKE_DEBS) >/dev/null 2>&1 \
		|| echo "gpu-wheels: could not fetch $(MOONCAKE_DEBS): gpu-check's Mooncake rows skip"
	@du -sh $(GPU_WHEELS)

gpu-check:
	GPU_WHEELS=$(GPU_WHEELS) tools/gpu-venv
	.venv-gpu/bin/python -m kvoffloadbench.gpu_check $(ARGS)

# The copy kernel's PTX, shipped in the package (needs nvcc; the daemon does not).
ptx:
	tools/build-ptx

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm $(PYTEST_ARGS)

# vLLM's real scheduler step with kvoffload vs vLLM's own CPU offloading, same run, and
# 8 engines on one daemon; saved for `make bench-report` in docs/bench-engine.json.
bench-engine: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m kvoffloadbench.bench_engine --json docs/bench-engine.json $(ARGS)

# Region and copy bytes per block, per-rank pages against vLLM's canonical pages.
bench-canonical: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m kvoffloadbench.bench_canonical $(ARGS)

# The daemon loop's time per submitted block (validation, copy plan, busy marks).
bench-submit: $(STAMP)
	$(BIN)/python -m kvoffloadbench.bench_submit $(ARGS)

# The region coming up at 1, 4 and 16 GiB: listen, first GiB ready, populated (and
# pinned on a GPU machine), populate rate against the machine's raw first touch with the
# same threads (same run), stores during and after population, warm restart; saved in
# docs/bench-region.json (ARGS="--sizes 64GiB" for more, "--daemon-path DIR --label
# before" for another checkout's daemon).
bench-region: $(STAMP)
	$(BIN)/python -m kvoffloadbench.bench_region $(ARGS)

bench: $(STAMP)
	@tools/ensure-redis-servers
	@tools/ensure-mooncake-libs
	$(BIN)/python -m kvoffloadbench.bench $(ARGS)

# Every benchmark, written to docs/benchmarks.md with plots (matplotlib: the bench extra).
BENCH_STAMP := $(VENV)/.kvoffload-bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[torch,dev,bench]'
	touch $(BENCH_STAMP)

bench-report: $(BENCH_STAMP)
	@tools/ensure-redis-servers
	@tools/ensure-mooncake-libs
	$(BIN)/python -m kvoffloadbench.bench_report $(ARGS)

# Long random load from several engines with every loaded byte verified (not in test).
soak: $(STAMP)
	$(BIN)/python -m kvoffloadbench.soak $(ARGS)

# The configuration reference (docs/configuration.md) and the keys of
# systemd/kvoffloadd.toml.example, from the comments above DaemonConfig's fields;
# tests/unit/test_configdoc.py fails when they drift.
docs: $(STAMP)
	$(BIN)/python -m kvoffloadd.configdoc

# mypy --strict over the packages, then over the tests: each test directory on its own,
# as pytest puts a test's directory on sys.path (``from helpers import poll``), so each
# is an import root of its own (and their conftest modules would clash as one). vLLM
# and SGLang are not in .venv: the tests see them untyped, as the packages do.
TEST_DIRS := tests/unit tests/integration tests/vllm tests/sglang tests/gpu

lint: $(STAMP)
	$(BIN)/ruff check daemon libclient tools tests
	$(BIN)/ruff format --check daemon libclient tools tests
	$(BIN)/mypy
	$(BIN)/mypy tests/conftest.py
	@rc=0; for d in $(TEST_DIRS); do \
		echo "mypy $$d"; MYPYPATH=$$d $(BIN)/mypy $$d || rc=1; \
	done; exit $$rc

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .venv-gpu build *.egg-info
