# The two commands of the README: `make test` and `make demo`. Both set up .venv
# from scratch when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,cuda12]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check jreshard tests benchmarks examples
	JAX_PLATFORMS=cpu HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m jreshard demo

lint: $(STAMP)
	$(BIN)/ruff check jreshard tests benchmarks examples
	$(BIN)/ruff format --check jreshard tests benchmarks examples

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python benchmarks/plan_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
