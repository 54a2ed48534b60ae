# The README's set-up commands: each target creates the venv when it is missing.
# PYTHON picks the interpreter and VENV its folder, so one checkout tests several
# JAX releases side by side: `make test PYTHON=python3.13 VENV=.venv-3.13`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What is installed: the package and its dependencies (RUNTIME), and the test and
# lint tools on top (TESTING), so `make demo` on a fresh clone waits only for the
# first.
RUNTIME := $(VENV)/.installed
TESTING := $(VENV)/.installed-test

.PHONY: demo test test-quick durations versions bench lint format clean

$(RUNTIME): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(RUNTIME)

$(TESTING): $(RUNTIME)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(TESTING)

demo: $(RUNTIME)
	$(BIN)/python -m pjit_pipe demo

# The interpreter and the JAX stack a test run uses, printed before it runs.
versions: $(TESTING)
	@$(BIN)/python -c "import sys, jax, jaxlib, flax, optax, orbax.checkpoint as ocp; print(f'python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, optax {optax.__version__}, orbax-checkpoint {ocp.__version__}')"

test: versions
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

# The inner loop: everything but the slow tests (marked, or recorded over
# QUICK_SECONDS in tests/durations.json: tests/conftest.py).
test-quick: versions
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow"

# Record every test's time (setup and teardown included) in tests/durations.json.
durations: versions
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --record-durations

bench: $(RUNTIME)
	$(BIN)/python -m benchmarks.run

lint: $(TESTING)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: $(TESTING)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf .venv .venv-* build *.egg-info .pytest_cache
