# lowtide — `make demo` and `make test` set everything up themselves on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: venv torch demo demo-cli test test-fast test-cluster cluster-env lint fmt bench chaos clean prometheus step-user nginx web

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

# The web dashboard (web/, docs/architecture.md §12): npm ci from the lock file, then a Vite build
# into src/lowtide/web_dist/ (served by the API at /ui/); each part is skipped when up to date.
WEB_OUT := src/lowtide/web_dist/index.html
WEB_SRC := $(shell find web/src -type f 2>/dev/null) web/index.html web/package.json web/vite.config.ts web/tsconfig.json
web: $(WEB_OUT)

web/node_modules/.package-lock.json: web/package-lock.json
	cd web && npm ci --no-audit --no-fund --loglevel=error

$(WEB_OUT): web/node_modules/.package-lock.json $(WEB_SRC)
	cd web && npm run build

# Steps run as one uid per job in this user's group when lowtide runs as root (executor.run_as,
# docs/architecture.md §6.4); created when we are root and it is missing.
step-user:
	@[ "$$(id -u)" != 0 ] || id -u lowtide-step >/dev/null 2>&1 || \
	  useradd --system --no-create-home --shell /usr/sbin/nologin lowtide-step

# A compressed day (scripts/demo.py): DEMO_MINUTES=10, DEMO_KEEP=1 to keep the dashboard up at the
# end, DEMO_TORCH=1 (the default here) installs PyTorch's CPU wheel into .venv for the SFT job.
DEMO_TORCH ?= 1
demo: venv web step-user
	DEMO_TORCH=$(DEMO_TORCH) $(BIN)/python scripts/demo.py

# The older walk through the CLI (validate, submit, logs, a surge), kept as a script.
demo-cli: venv web step-user
	bash scripts/demo.sh

lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

# Tests start a real Prometheus server; install it when we can (root on Debian), else they skip.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null)); } || \
	  echo "note: prometheus is not installed; its integration tests will skip (CI installs it)"

# Three workers (pytest-xdist): most tests wait on processes, so 3 beat 2 on two cores. The
# `serial` tests (the fault harness: a takeover within the lease, exits within a tick of recovery;
# the compressed demo day) are timed stories, so they run alone afterwards, on a quiet machine.
# PyTorch's CPU wheel (torch==2.13.0: pip takes it from this machine's local index) for the
# demo's SFT trainer and its test; make demo installs it the same way.
torch: venv
	@$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/python -m pip install --quiet torch==2.13.0

test: lint web prometheus step-user torch
	$(BIN)/pytest -q -n 3 -m "not serial and not cluster"
	$(BIN)/pytest -q -m "serial and not cluster"

test-fast: venv
	$(BIN)/pytest -q -n 3 -m "not slow and not cluster"

# The cluster tier (docs/cluster.md "The cluster test tier"): the scenarios of tests/cluster on a
# real cluster with Argo. Needs LOWTIDE_CLUSTER_KUBECONFIG, LOWTIDE_CLUSTER_NAMESPACE and
# LOWTIDE_CLUSTER_IMAGE (an image with lowtide-step-shim); `make test` deselects it.
test-cluster: cluster-env venv
	$(BIN)/pytest -q -m cluster tests/cluster

cluster-env:
	@test -n "$$LOWTIDE_CLUSTER_KUBECONFIG" || { echo "make test-cluster: set LOWTIDE_CLUSTER_KUBECONFIG (a kubeconfig of a cluster with Argo), LOWTIDE_CLUSTER_NAMESPACE and LOWTIDE_CLUSTER_IMAGE; see docs/cluster.md \"The cluster test tier\"" >&2; exit 2; }
	@test -n "$$LOWTIDE_CLUSTER_NAMESPACE" -a -n "$$LOWTIDE_CLUSTER_IMAGE" || { echo "make test-cluster: LOWTIDE_CLUSTER_NAMESPACE and LOWTIDE_CLUSTER_IMAGE must be set too" >&2; exit 2; }

fmt: venv
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

# benchmarks/gateway.py measures nginx beside the gateway; installed like prometheus when we can.
nginx:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { [ "$$(id -u)" = 0 ] && \
	  command -v apt-get >/dev/null 2>&1 && \
	  (apt-get install -y -qq --no-install-recommends nginx-light >/dev/null 2>&1 || \
	   (apt-get update -qq && apt-get install -y -qq --no-install-recommends nginx-light >/dev/null)); } || \
	  echo "note: nginx is not installed; benchmarks/gateway.py will measure without it"

bench: venv nginx
	$(BIN)/python benchmarks/scheduler.py
	$(BIN)/python benchmarks/fanout.py
	$(BIN)/python benchmarks/api_submit.py
	$(BIN)/python benchmarks/metrics_ingest.py
	$(BIN)/python benchmarks/gateway.py
	$(BIN)/python benchmarks/reclaim.py
	$(BIN)/python benchmarks/simulate.py

# The long fault run (issue 12): kill -9s, restarts under load, a store outage, clock jumps, two
# control planes on PostgreSQL; prints every invariant's violations, exits 1 on any (minutes).
chaos: venv
	$(BIN)/python benchmarks/chaos.py --two-control-planes

clean:
	rm -rf $(VENV) web/node_modules src/lowtide/web_dist test-output .lowtide .lowtide-demo .lowtide-inference .pytest_cache .mypy_cache .ruff_cache benchmarks/results
