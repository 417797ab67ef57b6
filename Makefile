# Two commands on a fresh clone: `make run` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VENV_STAMP := $(VENV)/.created
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

# Point the demo at real engines: make run PREFILL="http://p1:8100 http://p2:8100" DECODE=http://d:8200
PREFILL ?=
DECODE ?=

.PHONY: install run lint format test test-fast bench bench-quick prometheus-tools

$(VENV_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	touch $@

# make run: the gateway and what its demo needs (the demo extra), not the test tools.
$(RUN_STAMP): setup.cfg setup.py $(VENV_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@

# make test and make install: the test tools too.
$(STAMP): setup.cfg setup.py $(VENV_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(STAMP)

run: $(RUN_STAMP)
	$(BIN)/python -m devtools.demo $(if $(PREFILL),--prefill $(PREFILL)) $(if $(DECODE),--decode $(DECODE))

# The lowest supported versions (constraints/lowest.txt, the floors of setup.cfg) in a venv of
# their own: the embedding tests (a legacy Flask app under its own gunicorn) run there too.
LOWEST := .venv-lowest
LOWEST_STAMP := $(LOWEST)/.installed

$(LOWEST_STAMP): setup.cfg setup.py constraints/lowest.txt
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet --upgrade pip
	$(LOWEST)/bin/python -m pip install --quiet -c constraints/lowest.txt -e '.[test-embedding]' setuptools
	touch $@

# promtool and prometheus, from Debian's package, for the operator's kit (tests/test_deploy.py).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
prometheus-tools:
	@command -v promtool >/dev/null || { \
	  echo "installing Debian's prometheus package (promtool) for tests/test_deploy.py"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $(SUDO) apt-get install -y -q --no-install-recommends prometheus >/dev/null || { \
	    $(SUDO) apt-get update -q >/dev/null && \
	    $(SUDO) apt-get install -y -q --no-install-recommends prometheus >/dev/null; }; }

# The checks that keep the code within its style and types (ruff.toml, setup.cfg's [mypy]): lint,
# the format check, mypy on gateway/ emulator/ devtools/. make format applies ruff's format.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .

test: $(STAMP) $(LOWEST_STAMP) prometheus-tools lint
	$(BIN)/python -m pytest
	$(LOWEST)/bin/python -m pytest tests/embedding

# The quick loop: the tests that start no process (no engine, gateway, Redis or tool: those are
# marked `processes`, tests/conftest.py), in .venv. Its -m replaces setup.cfg's, hence "not slow".
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not processes"

# Benchmarks (docs/BENCHMARKS.md): the gateway beside the seed proxy and vllm-router (each in a venv
# of its own under bench/, made on first use) over the same emulated engines.
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench.run

bench-quick: $(BENCH_STAMP)
	$(BIN)/python -m bench.run --quick

# Bounded headless load run (locust) against the gateway and emulated engines:
# make load USERS=300 DURATION=60s [WORKLOAD=long]; CSV files land in bench/out/load/.
# WORKLOAD=long: 128-token replies, which the next turn's P reads from D (short ones it recomputes).
USERS ?= 300
DURATION ?= 60s
WORKLOAD ?= short
LOAD_STAMP := $(VENV)/.installed-load

.PHONY: load

$(LOAD_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,load]'
	touch $@

load: $(LOAD_STAMP)
	$(BIN)/python -m bench.load --users $(USERS) --duration $(DURATION) --workload $(WORKLOAD)

# Soak under chaos (tests/test_soak.py, marked slow): mixed traffic while engines fail one at a
# time, then a check that nothing leaked; gevent and gthread, SOAK_SECONDS of chaos each.
SOAK_SECONDS ?= 120

.PHONY: soak

soak: $(STAMP)
	SOAK_SECONDS=$(SOAK_SECONDS) $(BIN)/python -m pytest -m slow -s tests/test_soak.py
