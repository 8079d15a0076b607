# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# torch is pinned and installed first, so that nothing resolves an unpinned torch
# (which would pull several GB of CUDA packages).
TORCH_PIN ?= torch==2.13.0
PYTEST_WORKERS ?= 2

.PHONY: install demo test lint typecheck bench bench-quick stress clean conformance-cases

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[dev,torch]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m ucpformat.cli demo

test: $(STAMP)
	$(BIN)/python -m ruff check ucpformat tests conformance benchmarks examples
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -q

lint: $(STAMP)
	$(BIN)/python -m ruff check ucpformat tests conformance benchmarks examples

typecheck: $(STAMP)
	$(BIN)/python -m mypy

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --quick

conformance-cases: $(STAMP)
	$(BIN)/python -m conformance.generate

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
