# One-command entry points. Everything installs into .venv from the repo's own files.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8001
PYTEST_ARGS ?=

.PHONY: install run token test lint bench demo agent-wheel clean

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

install: $(VENV)/.installed

## Run the orchestrator on the embedded default (SQLite in ./var, no Redis) at http://$(HOST):$(PORT)
run: install
	$(VENV)/bin/simpletuner server --host $(HOST) --port $(PORT)

## Print a new operator API token for user "admin" (created as superuser if missing)
token: install
	@$(PY) manage.py create_api_token admin --superuser | tail -n 1

## The whole test suite (PostgreSQL/Redis tests run when DATABASE_URL/REDIS_URL are set)
test: install
	$(PY) -m pytest $(PYTEST_ARGS)

## The layering contract (.importlinter): each layer imports only the layers below it
lint: install
	$(VENV)/bin/lint-imports

## A whole fleet on this machine: orchestrator + 2 labelled agents + the built-in local worker, 5 jobs to completion
demo: install
	$(PY) scripts/demo.py

## The agent's own wheel (requests, psutil, nvidia-ml-py only) into dist/, to install on GPU nodes
agent-wheel: install
	rm -rf build/agent && mkdir -p build && cp -r worker_agent build/agent && rm -rf build/agent/__pycache__
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w dist build/agent
	rm -rf build/agent
	@ls dist/simpletuner_worker_agent-*.whl

## Benchmarks (see BENCHMARKS.md)
bench: install
	$(PY) bench/stream_cost.py --streams 2000
	$(PY) bench/sweep_cost.py
	$(PY) bench/metrics_cost.py
	$(PY) bench/admin_cost.py

clean:
	rm -rf $(VENV) var .pytest_cache
