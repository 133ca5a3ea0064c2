# make test: fresh clone -> .venv with blasx[test] (builds the C extension blasx._matmul_loops) -> the whole suite.
# make run:  the main job, an out-of-core GEMM on the devices found (GPUs, else the CPU).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test run bench-micro clean

$(STAMP): pyproject.toml setup.py blasx/_matmul_loops.c
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# GPUs: all of them, with a tile cache smaller than the operands (out of core).
# No GPU: the CPU worker. Override with e.g. `make run ARGS="--devices sim:4 --n 2048"`.
ARGS ?= --n 8192
run: $(STAMP)
	$(BIN)/blasx gemm $(ARGS)

bench-micro: $(STAMP)
	$(BIN)/python -m pytest -q bench/micro

clean:
	rm -rf $(VENV) build *.egg-info blasx/*.so
