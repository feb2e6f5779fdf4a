# fedra's entry points. Each target installs what it needs into .venv first.
#   make demo   coordinator + 3 sites on localhost (SQLite), digits, summary in demo-out/
#   make test   the whole test suite (unit and multi-process)
#   make lint   ruff, mypy and the generated-protobuf staleness check
#   make bench  the round benchmark (N = 2, 8 sites; 1M and 10M parameters)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Tests run in this many processes side by side (pytest-xdist). Most multi-process tests
# wait on their processes more than they compute: one at a time kept 1.2 of 2 cores busy.
TEST_WORKERS ?= 2

.PHONY: install demo test lint protos bench clean

$(STAMP): pyproject.toml constraints.txt
	@echo "Installing fedra and what it needs into $(VENV): the first time takes a few minutes."
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar on -c constraints.txt -e '.[dev,examples,tracking]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedra demo --out demo-out

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=40

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy -p fedra
	PYTHON=$(PY) protos/generate.sh --check

protos: $(STAMP)
	PYTHON=$(PY) protos/generate.sh

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) bench/round_bench.py

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache
