# The README's set-up commands: each target creates the venv when it is missing.
# PYTHON picks the interpreter and VENV its folder, so one checkout tests several
# JAX releases side by side: `make test PYTHON=python3.13 VENV=.venv-3.13`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What is installed: the package and its dependencies (RUNTIME), the test and lint
# tools on top (TESTING), and the third-party models for the whole suite (MODELS), so
# `make demo` on a fresh clone waits only for the first.
RUNTIME := $(VENV)/.installed
TESTING := $(VENV)/.installed-test
MODELS := $(VENV)/.installed-models

.PHONY: demo test test-quick durations versions bench lint format clean

$(RUNTIME): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(RUNTIME)

$(TESTING): $(RUNTIME)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(TESTING)

# The third-party models the whole suite pipelines (pyproject's `models` extra; their
# tests are slow, so test-quick does without). recurrentgemma 1.0.1 pins numpy<2.4 and
# absl-py<2, which its JAX modules do not need: it goes in without its dependencies
# (the extra holds the ones it imports), so the suite runs on the numpy the JAX stack
# pairs with.
$(MODELS): $(TESTING)
	$(BIN)/python -m pip install -q -e '.[models]'
	$(BIN)/python -m pip install -q --no-deps 'recurrentgemma>=1.0.1,<2'
	touch $(MODELS)

demo: $(RUNTIME)
	$(BIN)/python -m pjit_pipe demo

# The interpreter and the JAX stack a test run uses, printed before it runs.
versions: $(TESTING)
	@$(BIN)/python -c "import sys, jax, jaxlib, flax, optax, orbax.checkpoint as ocp; print(f'python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, optax {optax.__version__}, orbax-checkpoint {ocp.__version__}')"

# The multi-process tests (marked `processes`) run last and one at a time: their
# processes must meet real collective and heartbeat timeouts of a few seconds, which
# a test compiling beside them on a 2-core machine can push them past.
test: $(MODELS) versions
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not exhaustive and not processes"
	$(BIN)/python -m pytest -q -n 0 -m "processes and not exhaustive"

# The inner loop: everything but the slow tests (marked, or recorded over
# QUICK_SECONDS in tests/durations.json: tests/conftest.py).
test-quick: versions
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow"

# Record every test's time (setup and teardown included) in tests/durations.json.
durations: $(MODELS) versions
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
