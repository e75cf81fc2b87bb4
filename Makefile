# The two commands of the README, and the checks behind them. Each target sets up
# what it needs: a virtual environment in the checkout, with the project and its
# development tools installed from pyproject.toml.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test lint typecheck unit demo bench docs clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

lint: $(BIN)/.installed
	$(BIN)/ruff check relay relay_tools tests
	$(BIN)/ruff format --check relay relay_tools tests

typecheck: $(BIN)/.installed
	$(BIN)/mypy

unit: $(BIN)/.installed
	$(BIN)/python -m pytest tests/unit

# The whole suite: lint, types, unit, integration (the machine's Postgres and NATS,
# started here if they are down) and faults (throwaway servers the tests start).
test: lint typecheck
	tests/ensure-environment.sh
	$(BIN)/python -m pytest

# Throwaway Postgres and NATS, a producer, the relay and a deduping consumer, with a
# live line, until Ctrl-C. With OUTBOX_RELAY_DATABASE_URL / _NATS_URL set, it uses
# those servers instead.
demo: $(BIN)/.installed
	@$(BIN)/outbox-relay demo

# The documentation site (docs/, mkdocs.yml) into site/; --strict: a broken link
# or a page missing from the navigation fails it.
$(BIN)/.docs-installed: pyproject.toml
	$(MAKE) $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $@

docs: $(BIN)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Every figure of the performance page (several minutes).
bench: $(BIN)/.installed
	$(BIN)/outbox-relay bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info site
