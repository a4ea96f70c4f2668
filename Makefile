# One-command entry points. Everything installs into .venv from the repo's own files.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8001
PYTEST_ARGS ?=

.PHONY: install install-dev run token test test-fast lint bench demo agent-wheel clean soak soak-short interop

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

## The orchestrator's runtime only (requirements.txt) into $(VENV): what `make run` needs
install: $(VENV)/.installed

## The runtime plus the tools of the tests, the lint and the agent wheel's build (requirements-dev.txt)
install-dev: $(VENV)/.installed-dev

## Run the orchestrator on the embedded default (SQLite in ./var, no Redis) at http://$(HOST):$(PORT)
run: install
	$(VENV)/bin/simpletuner server --host $(HOST) --port $(PORT)

## Print a new operator API token for user "admin" (created as superuser if missing)
token: install
	@$(PY) manage.py create_api_token admin --superuser | tail -n 1

## The whole test suite (PostgreSQL/Redis tests run when DATABASE_URL/REDIS_URL are set)
test: install-dev
	$(PY) -m pytest $(PYTEST_ARGS)

## The quick tier: SQLite, no Redis; no browser, no end-to-end servers, no soak. Its tests are shared among
## one pytest-xdist process per core
test-fast: install-dev
	env -u DATABASE_URL -u REDIS_URL $(PY) -m pytest -p no:cacheprovider -n auto \
		-m "not e2e and not browser and not postgres and not redis" $(PYTEST_ARGS)

## The layering contract (.importlinter): each layer imports only the layers below it
lint: install-dev
	$(VENV)/bin/lint-imports

## A whole fleet on this machine: orchestrator + 2 labelled agents + the built-in local worker, 5 jobs to completion
demo: install
	$(PY) scripts/demo.py

## The agent's own wheel (requests, psutil, nvidia-ml-py only) into dist/, to install on GPU nodes
agent-wheel: install-dev
	rm -rf build/agent && mkdir -p build && cp -r worker_agent build/agent && rm -rf build/agent/__pycache__
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w dist build/agent
	rm -rf build/agent
	@ls dist/simpletuner_worker_agent-*.whl

## Benchmarks (see docs/benchmarks.md)
bench: install
	$(PY) bench/stream_cost.py --streams 2000
	$(PY) bench/sweep_cost.py
	$(PY) bench/metrics_cost.py
	$(PY) bench/admin_cost.py
	$(PY) bench/dispatch_cost.py
	$(PY) bench/prepared_cost.py

## The proof with SimpleTuner's own trainer (docs/testing.md): make_tiny.py's tiny SDXL LoRA trained on CPU through a
## real orchestrator and real agents, its node killed mid-run and resumed elsewhere, on SQLite and (with DATABASE_URL
## and REDIS_URL) on PostgreSQL + Redis. Needs SimpleTuner's venv (../shared/peer/build.sh; PEER_VENV moves it);
## without it, says why and skips.
interop: install-dev
	@reason="$$($(PY) -m tests.e2e.interop)"; \
	if [ -n "$$reason" ]; then echo "make interop: skipped: $$reason"; \
	else SIMPLETUNER_INTEROP=1 $(PY) -m pytest -p no:cacheprovider -s tests/e2e/test_interop.py $(PYTEST_ARGS); fi

## Chaos soak (see docs/reliability.md): agents and the orchestrator killed while jobs run, then an audit of
## lost / twice-completed / inconsistent jobs. SEED=n replays a run's chaos plan; the default is random (printed).
SEED ?= $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
soak: install
	$(PY) -m tests.soak.soak --seed $(SEED) --jobs 800 --agents 5 --packed-agents 2 --trainer-seconds 1 6 --duration 600

## The CI soak: under 2 minutes in all (start-up and drain included)
soak-short: install
	$(PY) -m tests.soak.soak --seed $(SEED) --jobs 120 --agents 4 --packed-agents 2 --duration 60 --short

clean:
	rm -rf $(VENV) var .pytest_cache
