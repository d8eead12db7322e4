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

# the demo model is the trained tiny pair (dspark_compile/factory/data/tiny-trained); the prompts are text,
# encoded with its tokenizer, and the generated ids are decoded back to text at the end
TOK := $(BIN)/python -m dspark_compile.factory.tokenizer
DEMO_PROMPTS := 'import os\nimport sys\n\n\ndef main(' '    def __init__(self, '

demo: venv
	rm -rf $(DEMO_DIR)
	$(BIN)/dspark-compile synth --preset tiny-trained --out $(DEMO_DIR)/ckpt
	$(BIN)/dspark-compile build $(DEMO_DIR)/ckpt --out $(DEMO_DIR)/engine --buckets 1,2 --max-seq-len 160 --dtype float64 \
		--device cpu --prefill-chunks none
	set -e; args=""; for p in $(DEMO_PROMPTS); do \
		ids=$$($(TOK) encode $(DEMO_DIR)/ckpt "$$p" --escapes); args="$$args --prompt-ids $$ids"; \
		printf 'prompt %s text: %s\n' "$$ids" "'$$p'"; done; \
	rc=0; $(BIN)/dspark-compile run $(DEMO_DIR)/engine $$args --max-new-tokens 32 --check-lossless \
		> $(DEMO_DIR)/run.txt || rc=$$?; cat $(DEMO_DIR)/run.txt; [ $$rc -eq 0 ] || exit $$rc; \
	$(TOK) decode $(DEMO_DIR)/ckpt --from-run $(DEMO_DIR)/run.txt; grep '^lossless' $(DEMO_DIR)/run.txt
	@echo "sampled (temperature 1.0, top-p 0.95, block verification; the model card's sampling), the same prompts:"
	set -e; args=""; for p in $(DEMO_PROMPTS); do \
		args="$$args --prompt-ids $$($(TOK) encode $(DEMO_DIR)/ckpt "$$p" --escapes)"; done; \
	$(BIN)/dspark-compile run $(DEMO_DIR)/engine $$args --max-new-tokens 32 --temperature 1.0 \
		--top-p 0.95 --seed 0 --verify block > $(DEMO_DIR)/run_sampled.txt; \
	cat $(DEMO_DIR)/run_sampled.txt; $(TOK) decode $(DEMO_DIR)/ckpt --from-run $(DEMO_DIR)/run_sampled.txt

# two processes (pytest-xdist; CI has 2 cores): the kernel tests run the Triton interpreter one
# thread each; the engine tests stay in one process (tests/conftest.py, pytest_xdist_make_scheduler)
test: venv
	$(BIN)/python -m pytest -q -x -n 2 --durations=30 tests

clean:
	rm -rf $(VENV) build
