# Two entry points for a fresh machine: `make demo` (main job on the built-in tiny model)
# and `make test`. Each creates its own virtualenv in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_DIR := build/demo

# the torch 2.13.0 CPU wheel expects triton 3.7.1; a bare `triton` resolves to 3.9.
PINS := torch==2.13.0 triton==3.7.1 numpy

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(PINS)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: venv demo test clean
venv: $(BIN)/.installed

demo: venv
	rm -rf $(DEMO_DIR)
	$(BIN)/dspark-compile synth --preset tiny --out $(DEMO_DIR)/ckpt
	$(BIN)/dspark-compile build $(DEMO_DIR)/ckpt --out $(DEMO_DIR)/engine --buckets 1,2,4 --max-seq-len 160 --dtype float64 \
		--device cpu --prefill-chunks none
	$(BIN)/dspark-compile run $(DEMO_DIR)/engine --prompt-ids 11,12,13,14,15,16,17,18 --prompt-ids 7,7,7 \
		--max-new-tokens 32 --check-lossless

# two processes (pytest-xdist; CI has 2 cores): the kernel tests run the Triton interpreter one
# thread each; the engine tests stay in one process (tests/conftest.py, pytest_xdist_make_scheduler)
test: venv
	$(BIN)/python -m pytest -q -x -n 2 tests

clean:
	rm -rf $(VENV) build
