# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= python3
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: install demo test test-fast data clean

# Reinstalls only when the pins change. constraints.txt fixes every package's version (the
# launcher's and the Dataflow workers' environment are the same: Dockerfile).
$(BIN)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --constraint constraints.txt -e '.[dev]'
	touch $@

install: $(BIN)/.installed

# The whole DAG through Prefect, with no server to start: without PREFECT_API_URL, `padir run`
# starts a temporary local API whose SQLite database lives in PREFECT_HOME (work/prefect).
# It prints every stage's output and the report; a second `make demo` reuses them all.
# --lanes 2: the student, the AR student and the drafter train side by side, a core each.
demo: export PREFECT_HOME ?= $(abspath work/prefect)
demo: install
	$(BIN)/padir run configs/demo.yaml --lanes 2
	@echo "more: $(BIN)/padir status configs/demo.yaml; $(BIN)/padir report configs/demo.yaml"

# The tests read Multi30k from PADIR_DATA_ROOT; without it, from the download cache, filled
# first (en, de, fr; checksummed: docs/data.md). Tatoeba's tests need PADIR_DATA_ROOT.
ifndef PADIR_DATA_ROOT
test test-fast: export PADIR_DATA_ROOT := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/padir/data
test test-fast: data
endif

data: install
	$(BIN)/padir data fetch configs/multi30k_en_de.yaml
	$(BIN)/padir data fetch configs/multi30k_en_fr.yaml

# The tests run on every logical CPU (pytest-xdist), a test file per worker: its module
# fixtures (a tiny trained model, a tiny DAG's stages) are built once. A worker holds up to
# 3.5 GB (TensorFlow, JAX, Beam, Prefect), so at most 4. `make test WORKERS=0`: no workers.
WORKERS ?= logical
PYTEST := $(BIN)/pytest -n $(WORKERS) --maxprocesses 4 --dist loadfile

# The whole suite (CI runs it).
test: install
	$(PYTEST)

# The quick tier for development (under 3 minutes on 2 cores): skips the marks `slow` (child
# interpreters, real training, set waits), `server` (a real Prefect server) and `dag` (the
# real stages on the tiny DAG).
test-fast: install
	$(PYTEST) -m "not slow and not server and not dag"

clean:
	rm -rf work .pytest_cache
