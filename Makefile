# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# torch is pinned and installed first, so that nothing resolves an unpinned torch
# (which would pull several GB of CUDA packages).
TORCH_PIN ?= torch==2.13.0
DEEPSPEED_PIN ?= deepspeed==0.19.8
# megatron-core 0.17+ needs Python 3.12; its dependencies are all in torch's set
MEGATRON_PIN ?= megatron-core==0.16.1
TORCHTITAN_PINS ?= torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.4.4 einops==0.8.2 spmd_types==0.2.3
PYTEST_WORKERS ?= 2

.PHONY: install demo test lint typecheck bench bench-quick stress fuzz clean conformance-cases docs browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[dev,torch,import,bench,docs,trainers,jax]"
	# Real frameworks for the importer tests; flags pip extras cannot carry: no CUDA ops
	# built, and the pinned torch kept (no build isolation).
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-build-isolation "$(DEEPSPEED_PIN)"
	$(BIN)/python -m pip install -q --no-deps "$(MEGATRON_PIN)"
	# torchtitan's checkpoint manager without its dependency set (datasets<4.8 would
	# downgrade huggingface_hub and fsspec, which the importer and S3 tests need): only
	# the modules it imports (docs/trainers.md)
	$(BIN)/python -m pip install -q --no-deps $(TORCHTITAN_PINS)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m ucpformat.cli demo

test: $(STAMP) browser
	$(BIN)/python -m ruff check
	$(BIN)/python -m mypy
	# --dist loadfile: a module's tests on one worker, so its module fixtures (the trainers'
	# multi-process launches) run once, not once per worker
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -q

# The rendered specification (site/): mkdocs-material, pages assembled by spec/site/build.py.
docs: $(STAMP)
	$(BIN)/python -m spec.site.build

# Headless Chromium for the spec site's browser test (tests/test_spec_site.py): Debian's
# package, installed as root (or with sudo) where it is missing.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

lint: $(STAMP)
	$(BIN)/python -m ruff check

typecheck: $(STAMP)
	$(BIN)/python -m mypy

# The full run (several minutes; writes out/benchmarks.{md,json,png}). To refresh the
# committed BENCHMARKS.md on a quiet machine:
#   make bench BENCH_ARGS="--wait-load 1.5 --doc BENCHMARKS.md --chart benchmarks/benchmarks.png"
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --quick

# Long modes of the reliability harnesses (each prints its figures; see docs/reliability.md).
stress: $(STAMP)
	$(BIN)/python -m ucpformat.testing.faults --trials 300 --gloo-trials 20 --exchange-trials 40 --gloo-exchange-trials 10
	$(BIN)/python -m ucpformat.testing.corruption --trials 2000
	$(BIN)/python -m ucpformat.testing.hostile --examples 500
	$(BIN)/python -m ucpformat.testing.link_attacks --trials 20 --reads 3000 --dist-trials 20
	$(BIN)/python -m ucpformat.testing.concurrency --trials 100 --gloo-trials 100
	$(BIN)/python -m ucpformat.testing.failed_saves --trials 100
	$(BIN)/python -m ucpformat.testing.planted --trials 20

# Coverage-guided fuzzing with atheris (not part of make test): FUZZ_RUNS inputs.
FUZZ_RUNS ?= 20000
fuzz: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[fuzz]"
	mkdir -p .fuzz-corpus
	$(BIN)/python -m ucpformat.testing.fuzz_atheris --seed-corpus .fuzz-corpus
	$(BIN)/python -m ucpformat.testing.fuzz_atheris -atheris_runs=$(FUZZ_RUNS) -timeout=20 .fuzz-corpus

# Regenerate the committed conformance cases (deterministic: byte-identical output).
conformance-cases: $(STAMP)
	$(BIN)/python -m conformance.generate

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .fuzz-corpus site build/spec-site
