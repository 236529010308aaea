# `make run` sets up everything and starts the product; `make test` runs the checks and the tests.
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
# python3.12 from PATH if it runs, else pyenv's or the system's 3.12.
PYTHON312 ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	$$p -c 'import sys; print(sys.executable)' 2>/dev/null && break; done)
TEST_ENV := DEBUG=on SECRET_KEY=test-only REDIS_URL=redis://127.0.0.1:6379/15

.DEFAULT_GOAL := help
.PHONY: help setup run test lint typecheck pytest browser lock clean llama-server install-runtime

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(BIN)/.installed: requirements.txt requirements-dev.txt requirements-models.txt
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it or set PYTHON312=/path/to/python3.12"; exit 1; }
	test -x $(BIN)/python || $(PYTHON312) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# Runtime and development sets, every file checked against its hash. llama-cpp-python builds from
	# source once; pip's wheel cache serves later installs.
	$(BIN)/pip install --quiet --require-hashes -r requirements.txt -r requirements-dev.txt
	# Model packages: only their GGUF files are used, so none of their dependencies are installed.
	$(BIN)/pip install --quiet --no-deps -r requirements-models.txt
	touch $@

install-runtime: ## A production install into .venv: the runtime set only (no Playwright, mypy or ruff), and the models
	test -x $(BIN)/python || $(PYTHON312) -m venv $(VENV)
	$(BIN)/pip install --quiet --require-hashes -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -r requirements-models.txt

.env:
	sed "s|^SECRET_KEY=.*|SECRET_KEY=$$($(PYTHON312) -c 'import secrets; print(secrets.token_urlsafe(50))')|" .env.example > .env

setup: $(BIN)/.installed .env browser ## Install everything: venv, requirements, database, model, browser, demo user
	$(BIN)/python manage.py create_database
	$(BIN)/python manage.py migrate --no-input
	$(BIN)/python manage.py collectstatic --no-input --verbosity 0
	$(BIN)/python manage.py prepare_model
	$(BIN)/python manage.py ensure_demo_user

run: setup ## Set up, then start the web process and one inference node (Procfile)
	@echo "Open http://127.0.0.1:$${WEB_PORT:-8000}/ and log in with the demo user above."
	$(BIN)/honcho start

test: $(BIN)/.installed lint typecheck pytest ## Lint, type-check and run the test suite

lint: $(BIN)/.installed ## ruff lint and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(BIN)/.installed ## mypy with django-stubs
	$(TEST_ENV) $(BIN)/mypy .

browser: ## Debian's Chromium, for the browser tests (Playwright drives it; nothing is downloaded by Playwright)
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

pytest: $(BIN)/.installed browser ## The test suite (real Postgres, Redis, Celery worker, model and browser)
	$(TEST_ENV) $(BIN)/python manage.py prepare_model
	$(TEST_ENV) $(BIN)/python manage.py collectstatic --no-input --verbosity 0
	$(TEST_ENV) $(BIN)/pytest

# llama.cpp's own server, for `bench_stack`: built from the llama.cpp source vendored in the pinned
# llama-cpp-python sdist, so both servers run the same kernels. A benchmark tool, not part of `make run`.
LLAMA_CPP_PYTHON := $(shell sed -n 's/^llama-cpp-python==\([^ ]*\).*/\1/p' requirements.txt)
LLAMA_SRC := var/src/llama_cpp_python-$(LLAMA_CPP_PYTHON)

llama-server: var/llama-server ## Build llama.cpp's llama-server into var/ (for bench_stack)

var/llama-server: requirements.txt
	mkdir -p var/src
	test -f $(LLAMA_SRC).tar.gz || $(PYTHON312) -m pip download --quiet --no-binary :all: --no-deps \
		-d var/src llama_cpp_python==$(LLAMA_CPP_PYTHON)
	tar -xzf $(LLAMA_SRC).tar.gz -C var/src
	cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B var/src/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
	cmake --build var/src/build --target llama-server
	cp var/src/build/bin/llama-server $@

PIP_COMPILE := $(BIN)/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
	--no-emit-find-links

lock: ## Re-pin requirements.txt and requirements-dev.txt, with hashes, from their .in files (pip-tools)
	$(PIP_COMPILE) -o requirements.txt requirements.in
	$(PIP_COMPILE) -o requirements-dev.txt requirements-dev.in

clean: ## Remove the venv and caches (not pip's wheel cache)
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache staticfiles
