# Quick start:  make demo   (setup + default model + demo)
#               make test   (setup + default model + tests)
PY := .venv/bin/python

.PHONY: setup models demo test test-unit test-engine clean

setup:
	@bash scripts/setup.sh

models: setup
	@$(PY) -m vllm_dsbd.cli models prepare

demo: models
	@$(PY) -m vllm_dsbd.cli demo

test: models
	@bash scripts/pytest.sh tests

test-unit: setup
	@bash scripts/pytest.sh tests -m "not engine"

test-engine: models
	@bash scripts/pytest.sh tests -m engine

clean:
	rm -rf .venv .pytest_cache
