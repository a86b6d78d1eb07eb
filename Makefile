# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3
export PADIR_DATA_ROOT ?= $(abspath ../shared/data)
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: install demo test benchmarks clean

# Reinstalls only when pyproject.toml changes.
$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/padir run configs/demo.yaml

test: install
	$(BIN)/pytest

clean:
	rm -rf work .pytest_cache
