# The two commands of the README: `make test` and `make demo`. Both set up .venv
# from scratch when it is missing (the test environment's pins: tools/test-constraints.txt).
# `make demo` installs only what the demo runs on (jreshard itself: jax and numpy, about
# 0.5 GB); `make test` installs every extra into the same .venv (CuPy, NCCL, MPI, NIXL, Tunix,
# the docs and dev tools), and a .venv that `make test` set up serves `make demo` as it is.
# `make docs` builds the documentation site into site/.
# `make test` also checks that the GPU machine's package set runs benchmarks/gpu_check.py
# (tools/check_gpu_packages.py, in the background beside the other steps; its environment is
# cached in .cache/, its output printed at the end). mypy runs in the background too, at a lower
# priority than the tests (it takes the cores' idle time; its output is printed at the end and
# fails the target as it would in line). The tests run on two workers
# (pytest-xdist, work stealing), one per core of the CI machine; tests/test_docs_site.py builds the docs
# with `mkdocs build --strict`. They write bytecode caches (__pycache__/, ignored by git) even where
# PYTHONDONTWRITEBYTECODE is set: the suite starts several hundred Python processes, and each would
# compile jreshard (about 0.3 s) and its test modules again.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
SOURCES := pyproject.toml setup.py tools/test-constraints.txt jreshard/views/_casts.c jreshard/schedule/_rows.c \
	jreshard/schedule/_rows.h jreshard/engine/_replay.c jreshard/engine/_strided.c jreshard/engine/_delta.c jreshard/_stream.h

.PHONY: test demo docs lint bench clean

$(STAMP): $(SOURCES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,cuda12,tunix]' -c tools/test-constraints.txt
	$(BIN)/python -m pip install -q --no-deps nixl-cu12
	$(BIN)/python -c "from jreshard.views import native; assert native.available(), 'the compiled casts were not built'"
	$(BIN)/python -c "from jreshard.schedule import kernels; assert kernels.compiled_rows(), 'the compiled byte rows were not built'"
	$(BIN)/python -c "from jreshard.engine import replay; assert replay.compiled_replay(), 'the compiled replay was not built'"
	$(BIN)/python -c "from jreshard.engine import strided; assert strided.compiled(), 'the compiled strided copies were not built'"
	$(BIN)/python -c "from jreshard.engine import delta; assert delta.compiled(), 'the compiled delta kernels were not built'"
	touch $(STAMP)

$(DEMO_STAMP): $(SOURCES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e . -c tools/test-constraints.txt
	touch $(DEMO_STAMP)

# $(call await,file,what): wait for a background step's status file, at most 20 minutes.
await = n=0; while [ ! -f $(1) ]; do n=$$((n + 1)); if [ $$n -gt 1200 ]; then echo "$(2) gave no status in 20 minutes"; exit 1; fi; sleep 1; done

GPU_LOG := .cache/gpu-packages.log
GPU_RC := .cache/gpu-packages.rc
MYPY_LOG := .cache/mypy.log
MYPY_RC := .cache/mypy.rc

test: $(STAMP)
	mkdir -p .cache && rm -f $(GPU_RC) $(MYPY_RC)
	( $(BIN)/python tools/check_gpu_packages.py > $(GPU_LOG) 2>&1; echo $$? > $(GPU_RC) ) &
	( nice -n 10 $(BIN)/python -m mypy jreshard > $(MYPY_LOG) 2>&1; echo $$? > $(MYPY_RC) ) &
	$(BIN)/ruff check jreshard tests benchmarks examples tools
	$(BIN)/ruff format --check jreshard tests benchmarks examples tools
	PYTHONDONTWRITEBYTECODE= JAX_PLATFORMS=cpu HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -n 2 --dist worksteal
	@$(call await,$(MYPY_RC),mypy); echo "mypy jreshard:"; cat $(MYPY_LOG); test $$(cat $(MYPY_RC)) = 0
	@$(call await,$(GPU_RC),the GPU-package check); cat $(GPU_LOG); exit $$(cat $(GPU_RC))

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict
	@echo "site/index.html"

# The full environment where `make test` built it (up to date), else the demo's own.
demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	JAX_PLATFORMS=cpu $(BIN)/python -m jreshard demo

lint: $(STAMP)
	$(BIN)/ruff check jreshard tests benchmarks examples tools
	$(BIN)/ruff format --check jreshard tests benchmarks examples tools

bench: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python benchmarks/plan_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site .cache
