# Two entry points (see README): `make demo` trains the built-in 3D demo (dp2 x tp2 x pp2, 8 processes), `make test` runs the suite.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hybridpar train

# The tests marked `numerics` (results compared across layouts and kernels) run first under the
# generic and the AVX2 kernels, then everything under this CPU's own; the first failing pass
# stops make, so the last pytest summary line is the failing pass's or the full suite's.
# The full pass includes the checks on the tree itself: tests/test_limits.py (files <= 500 lines,
# functions <= 60, no import cycle in planner/) and tests/test_docs_links.py (every doc link resolves).
test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/lint-imports --no-cache
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q -m numerics
	ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest -q -m numerics
	$(BIN)/python -m pytest -q --durations=30

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .cache
