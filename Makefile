# specserve: run `make help` for the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SPECSERVE_HOME ?= $(HOME)/.cache/specserve
export SPECSERVE_HOME
SPECULATOR_MINUTES ?= 10
SPECULATOR_EPOCHS ?= 20
SPECULATOR_PROMPTS ?= 3584
SPECULATOR_MAX_NEW_TOKENS ?= 128

.DEFAULT_GOAL := help

.PHONY: help
help: ## Show this help
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | \
		awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 is the CPU build; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	# The editable install generates server/pb (setup.py).
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

.PHONY: install
install: $(VENV)/.installed ## Create .venv and install specserve with its dev tools, at constraints.txt's versions

.PHONY: gen-proto
gen-proto: install ## Generate server/pb from proto/generation.proto (after editing the proto)
	$(PY) -m server.proto_gen

.PHONY: models
models: install ## Prepare SmolLM2-135M-Instruct and the tiny test checkpoints in $SPECSERVE_HOME
	$(PY) -m tools.prepare_models

.PHONY: lint
lint: gen-proto ## ruff + mypy, hadolint on the Dockerfile, docker-compose.yml against the compose spec, deploy/ against the Kubernetes and KServe schemas
	$(VENV)/bin/ruff check engine server training tests bench tools integration_tests deploy
	$(VENV)/bin/ruff format --check engine server training tests bench tools integration_tests deploy
	$(VENV)/bin/mypy engine server training tools
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml
	$(VENV)/bin/kubernetes-validate --strict --kubernetes-version 1.29.0 --quiet deploy/kubernetes/*.yaml
	$(PY) deploy/kserve/schemas/generate.py --check
	$(VENV)/bin/check-jsonschema --schemafile deploy/kserve/schemas/servingruntime.json deploy/kserve/servingruntime.yaml
	$(VENV)/bin/check-jsonschema --schemafile deploy/kserve/schemas/inferenceservice.json deploy/kserve/inferenceservice*.yaml

.PHONY: format
format: install ## Apply ruff's formatting and fixes
	$(VENV)/bin/ruff format engine server training tests bench tools integration_tests deploy
	$(VENV)/bin/ruff check --fix engine server training tests bench tools integration_tests deploy

.PHONY: test
test: models lint gen-proto ## Install, prepare models, lint, run all tests
	$(PY) -m pytest -q tests integration_tests/text_generation_tests

.PHONY: test-fast
test-fast: models gen-proto ## The unit tests only (tests/unit: no server process, no lint)
	$(PY) -m pytest -q -m "not server" tests

DEFAULT_SPECULATOR := $(SPECSERVE_HOME)/speculators/SmolLM2-135M-Instruct-accelerator

.PHONY: run
run: models gen-proto ## Serve the default model (with its speculator once `make speculator` made it): gRPC 8033, HTTP 3000
	@if [ -z "$$MODEL_NAME$$SPECULATOR_PATH$$SPECULATOR_NAME" ] && [ -f "$(DEFAULT_SPECULATOR)/config.json" ]; then \
		export SPECULATOR_PATH="$(DEFAULT_SPECULATOR)"; echo "speculator: $$SPECULATOR_PATH"; fi; \
		exec $(PY) -m server.main

.PHONY: speculator
speculator: models ## Train the default model's speculator (cached; about 32 min on 2 CPU cores); prints its folder last
	$(PY) -m training.train --num-prompts $(SPECULATOR_PROMPTS) \
		--max-new-tokens $(SPECULATOR_MAX_NEW_TOKENS) --epochs $(SPECULATOR_EPOCHS) \
		--minutes $(SPECULATOR_MINUTES)

.PHONY: image
image: ## docker build the CUDA image specserve:latest (the Dockerfile's default target)
	docker build -t specserve:latest .

.PHONY: image-cpu
image-cpu: ## docker build the CPU image specserve:cpu (the default model baked in)
	docker build --target cpu -t specserve:cpu .

.PHONY: bench
bench: models ## Decode tokens/s of this engine vs transformers (batch 1 and 16), the matmul floor, and int8 and GPTQ 4-bit vs float32 at batch 1
	$(PY) -m bench.bench_decode

.PHONY: bench-kernels
bench-kernels: install ## Time every linear-layer kernel for the default model's shapes
	$(PY) -m bench.bench_kernels

.PHONY: bench-stream
bench-stream: install ## How fast one core and all cores stream weights through the rows kernel, from 1 row to its widest tile, per prefetch mode
	$(PY) -m bench.bench_stream

.PHONY: bench-verify
bench-verify: models ## Cost of verifying a [5,3,2]x5 draft tree at batch 1 vs the bare matmuls and a plain step (SPECULATOR=PATH; TEMPERATURE=0.7 TOP_P=0.9 adds tokens per step, greedy and sampled)
	$(PY) -m bench.bench_verify $(if $(SPECULATOR),--speculator $(SPECULATOR)) \
		$(if $(TEMPERATURE),--temperature $(TEMPERATURE)) $(if $(TOP_P),--top-p $(TOP_P))

.PHONY: bench-gil
bench-gil: models ## Decode tokens/s at Python's GIL switch interval and the server's, beside an idle or a busy Python thread
	$(PY) -m bench.gil_switch

.PHONY: bench-sampling
bench-sampling: models ## Sampled vs greedy batch decode tokens/s, 32 requests x 64 tokens, speculation off and on (MIX=top-k: every request with a top-k)
	$(PY) -m bench.bench_sampling $(if $(MIX),--mix $(MIX))

.PHONY: bench-serving
bench-serving: models gen-proto ## gRPC streaming clients at concurrency 1/4/16/32 (SmolLM2 fp32); SPECULATOR=PATH adds an on/off comparison and a plot; VARIANT='int8 QUANTIZE=int8' a second server, PEER=HOST:PORT [PEER_NAME=NAME] a running TGIS server (bench/peer_vllm.sh), with ratios
	$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install -q -c constraints.txt 'matplotlib>=3.8'
	$(PY) -m bench.bench_serving $(if $(SPECULATOR),--speculator $(SPECULATOR)) $(if $(VARIANT),--variant $(VARIANT)) $(if $(PEER),--peer $(PEER) $(if $(PEER_NAME),--peer-name $(PEER_NAME)))

.PHONY: bench-openai
bench-openai: models gen-proto ## 32 streaming clients through the OpenAI-compatible HTTP API vs through gRPC, aggregate tokens/s (SmolLM2 fp32)
	$(PY) -m bench.bench_openai

.PHONY: bench-spec-onoff
bench-spec-onoff: models ## Speculation on vs off in one engine, alternating 2.5 s windows, 1/4/16/32 clients (SPECULATOR=PATH, default: make speculator's; TEMPERATURE=0.7 TOP_P=0.9: sampled clients)
	$(PY) -m bench.spec_onoff --speculator $(or $(SPECULATOR),$(DEFAULT_SPECULATOR)) \
		$(if $(TEMPERATURE),--temperature $(TEMPERATURE)) $(if $(TOP_P),--top-p $(TOP_P))

.PHONY: bench-tree-rules
bench-tree-rules: models ## Tokens per verified tree against its rows for each candidate selection rule, offline on held-out answers (SPECULATOR=PATH, default: make speculator's)
	$(PY) -m bench.tree_rules --speculator $(or $(SPECULATOR),$(DEFAULT_SPECULATOR))

.PHONY: bench-spec-sampled
bench-spec-sampled: models gen-proto ## Seeded sampling, speculation on vs off: identical tokens offline and via gRPC for 3 models, random/scripted/trained speculators
	$(PY) -m bench.spec_sampled_equality

.PHONY: bench-tp
bench-tp: models ## Tensor parallelism on this host: per-rank memory and tokens/s with 1 and 3 shards (SHARDS="1 2 4", MODEL=PATH)
	$(PY) -m bench.tensor_parallel $(if $(SHARDS),--shards $(SHARDS)) $(if $(MODEL),--model $(MODEL))

.PHONY: gpu-check
gpu-check: ## Prove the CUDA path in one run (<8 min) with the system python3, no venv; GPU_CHECK_ARGS="--device cpu --small" dry-runs it
	$(PYTHON) -m bench.gpu_check $(GPU_CHECK_ARGS)

.PHONY: clean
clean: ## Remove the virtual environment and caches (not $SPECSERVE_HOME)
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
	rm -f server/pb/*_pb2*.py server/pb/*_pb2*.pyi
