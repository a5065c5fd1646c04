# lowtide — `make demo` and `make test` set everything up themselves on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: venv demo test test-fast lint fmt bench clean prometheus step-user nginx

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

# Steps run as one uid per job in this user's group when lowtide runs as root (executor.run_as,
# docs/architecture.md §6.4); created when we are root and it is missing.
step-user:
	@[ "$$(id -u)" != 0 ] || id -u lowtide-step >/dev/null 2>&1 || \
	  useradd --system --no-create-home --shell /usr/sbin/nologin lowtide-step

demo: venv step-user
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

test: lint prometheus step-user
	$(BIN)/pytest -q

test-fast: venv
	$(BIN)/pytest -q -m "not slow"

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

clean:
	rm -rf $(VENV) .lowtide .lowtide-demo .lowtide-inference .pytest_cache .mypy_cache .ruff_cache benchmarks/results
