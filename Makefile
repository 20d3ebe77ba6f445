# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[serve,dev,vision]"
	-$(BIN)/pip install -q "nixl-cu12==1.5.1"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/asympd demo

test: $(STAMP)
	$(BIN)/ruff check asympd tests
	$(BIN)/python -m pytest -x -q -n 2 --dist loadfile tests

lint: $(STAMP)
	$(BIN)/ruff check asympd tests

clean:
	rm -rf $(VENV)
