# Dispatch: `make run` (set up and serve) and `make test` (the whole suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` and `make test-fast` (README.md "Running the
# tests"): most tests wait on sockets and subprocesses, so more workers than cores pay off.
TEST_WORKERS ?= 3
DIST   ?= dist
CLIENTS := tests/clients
CLUSTER_SERVERS ?= 3
CLUSTER_PORT    ?= 8080
CLUSTER_TLS     ?=

.PHONY: run cluster test test-fast lint bench venv dev dist clean

$(VENV)/bin/python:
	@$(PYTHON) -m venv $(VENV) || { echo "Could not create a virtualenv: install Python's venv module (Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }
	@$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: requirements.txt | $(VENV)/bin/python
	$(PY) -m pip install -q -r requirements.txt
	@touch $@

$(VENV)/.dev-installed: requirements-dev.txt $(VENV)/.installed
	$(PY) -m pip install -q -r requirements-dev.txt
	@touch $@

venv: $(VENV)/.installed
dev: $(VENV)/.dev-installed

## run: set up, migrate, create the first admin (password printed once), serve on HOST:PORT
##      (DISPATCH_PUBLIC_URL, when neither the environment nor .env sets it, is http://HOST:PORT,
##      so agents, shims and peers are told the address actually served; with a wildcard HOST
##      such as 0.0.0.0 there is no such address, and run stops until DISPATCH_PUBLIC_URL is set)
run: venv
	@url="$${DISPATCH_PUBLIC_URL:-$$(sed -n 's/^DISPATCH_PUBLIC_URL=//p' .env 2>/dev/null | tail -n1)}"; \
	  case "$$url:$(HOST)" in :0.0.0.0|:::|:\[::\]|:0) \
	    echo "make run HOST=$(HOST): the public URL would be http://$(HOST):$(PORT), a wildcard address agents, shims, peers and browsers cannot reach. Set DISPATCH_PUBLIC_URL to the address they use, e.g. DISPATCH_PUBLIC_URL=http://laptop.lan:$(PORT) make run HOST=$(HOST) PORT=$(PORT) (or in .env; docs/deployment.md \"Public URL\")" >&2; \
	    exit 2;; \
	  esac
	$(PY) manage.py migrate --noinput -v0
	@$(PY) manage.py ensure_admin
	@url="$${DISPATCH_PUBLIC_URL:-$$(sed -n 's/^DISPATCH_PUBLIC_URL=//p' .env 2>/dev/null | tail -n1)}"; \
	  export DISPATCH_PUBLIC_URL="$${url:-http://$(HOST):$(PORT)}"; \
	  echo "$(PY) manage.py serve --host $(HOST) --port $(PORT)  (public URL $$DISPATCH_PUBLIC_URL)"; \
	  exec $(PY) manage.py serve --host $(HOST) --port $(PORT)

## cluster: CLUSTER_SERVERS (3) `serve --no-background` processes + a dispatch_worker on
##          PostgreSQL + Redis behind a private nginx on 127.0.0.1:CLUSTER_PORT (8080), until
##          Ctrl-C (docs/deploy.md). DATABASE_URL/REDIS_URL from the environment, else database
##          dispatch_cluster on 127.0.0.1:5432 and Redis 127.0.0.1:6379 (prefix dispatch-cluster);
##          CLUSTER_TLS=1: https with a self-signed certificate. Needs nginx (not its service).
cluster: venv
	$(PY) -m deploy.cluster --servers $(CLUSTER_SERVERS) --port $(CLUSTER_PORT) $(if $(filter 1 yes true,$(CLUSTER_TLS)),--tls)

## test: the whole suite (browser tests need Debian's chromium; see README): the tests not
##       marked serial on TEST_WORKERS (3) pytest-xdist workers, then the serial ones alone
##       (memory bounds, benchmarks, frozen dependencies: tests/conftest.py SERIAL). Both
##       steps run; it fails when either does (a step PYTEST_ARGS leaves without tests, pytest's
##       exit 5, is no failure unless both are). PYTEST_ARGS go to both: a -m there combines
##       with each step's `--lane` (tests/conftest.py).
test: dev $(CLIENTS)/node_modules/.installed
	@echo '$(PY) -m pytest -n $(TEST_WORKERS) --lane parallel PYTEST_ARGS, then $(PY) -m pytest --lane serial PYTEST_ARGS'
	@parallel=0; serial=0; \
	$(PY) -m pytest -n $(TEST_WORKERS) --lane parallel $(PYTEST_ARGS) || parallel=$$?; \
	$(PY) -m pytest --lane serial $(PYTEST_ARGS) || serial=$$?; \
	if [ $$parallel -eq 5 ] && [ $$serial -eq 5 ]; then exit 5; fi; \
	[ $$parallel -ne 5 ] || parallel=0; [ $$serial -ne 5 ] || serial=0; \
	[ $$parallel -ne 0 ] && exit $$parallel; exit $$serial

## test-fast: the quick lane, in parallel: no servers started for real, browsers, clusters,
##            benchmarks, real agent CLIs or serial tests (`--lane fast`; a few minutes)
test-fast: dev $(CLIENTS)/node_modules/.installed
	$(PY) -m pytest -n $(TEST_WORKERS) --lane fast $(PYTEST_ARGS)

# The public clients the suite runs (tests/clients/package.json, pinned by its lock file),
# installed once with `npm ci`. Without node/npm nothing is installed and the tests that
# need them are skipped (failed under CI=true) with this command.
$(CLIENTS)/node_modules/.installed: $(CLIENTS)/package.json $(CLIENTS)/package-lock.json
	@if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
	  npm ci --prefix $(CLIENTS) --no-audit --no-fund --loglevel=error && touch $@; \
	else \
	  echo "node/npm not found: the tests that run the TypeScript MCP client and the real agent CLIs (tests/agents/real_cli) will be skipped (apt-get install nodejs npm)"; \
	fi

## lint: ruff (checks and formatting) + mypy + import-linter (the dependency order of docs/architecture.md)
lint: dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/lint-imports --no-cache

## bench: benchmarks beside their baselines (each script writes bench/results/<script>.json;
##        a failing script does not stop the others); ends with the combined table of B1-B12
##        (bench/summary.py), which fails when a result is missing or older than this run
bench: dev
	@mkdir -p bench/results && date +%s > bench/results/.run-started
	-$(PY) bench/remote_calls.py
	-$(PY) bench/machines.py
	-$(PY) bench/live.py
	-$(PY) bench/agents.py
	-$(PY) bench/peers.py
	$(PY) bench/summary.py --since-file bench/results/.run-started

## dist: build the installable clients into dist/ with `python -m build` (each wheel built
##       from its sdist): dispatch_shim-<version>-py3-none-any.whl (the `dispatch-shim`
##       command) and dispatch_remote-<version>-py3-none-any.whl (`from dispatch_remote
##       import Remote`, the `dispatch-remote` command), plus their .tar.gz sdists. They are
##       built from machines/shim/ and remotes/client/ as they are (each folder's
##       pyproject.toml); the version of both is SHIM_VERSION in machines/shim/protocol.py.
##       Needs only `build` (pinned in requirements-dev.txt), not the whole dev set.
##       DIST=DIR builds into DIR instead (the tests do).
dist: | $(VENV)/bin/python
	@$(PY) -m build --version >/dev/null 2>&1 || $(PY) -m pip install -q "$$(grep -E '^build==' requirements-dev.txt)"
	@mkdir -p $(DIST) && rm -f $(DIST)/dispatch_shim-* $(DIST)/dispatch_remote-*
	$(PY) -m build --outdir $(DIST) machines/shim
	$(PY) -m build --outdir $(DIST) remotes/client
	@ls -1 $(DIST)/dispatch_shim-* $(DIST)/dispatch_remote-*

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache $(CLIENTS)/node_modules
