# make test: fresh clone -> .venv with blasx[test] (builds the C extensions blasx._matmul_loops, _cublas_call) -> the whole suite.
# make run:  the main job, a checked GEMM on the devices found (GPUs, else the CPU).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test run bench-micro clean

$(STAMP): pyproject.toml setup.py blasx/_matmul_loops.c blasx/_cublas_call.c
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# the suite in JOBS processes (pytest-xdist; worksteal: a worker that runs out takes half of what another has
# left, so the run does not end on one worker, as the load scheduler's last handouts could, by ~20 s), then the
# tests with wall-clock bounds alone; test modules
# compiled with pytest's assertion rewriting are kept (__pycache__) even where PYTHONDONTWRITEBYTECODE is set,
# so the second pass and later runs do not rewrite them again (~10 s a process on 2 cores). The second pass
# collects only the test files that name the serial marker (grep -w serial: a file that applies it names it),
# not all of tests/ (~6 s of imports for 4 tests); with no such file it collects everything, as before.
JOBS ?= 2
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q
SERIAL_FILES = $(shell grep -lw serial tests/test_*.py)
test: $(STAMP)
	$(PYTEST) -n $(JOBS) --dist worksteal -m "not serial"
	$(PYTEST) -m serial $(SERIAL_FILES)

# Runs on all GPUs found, else on the CPU; prints its settings first and its result last. The default size takes seconds on a 2-core CPU. GPU sizes: ARGS="--n 16384"
# (in core), ARGS="--n 32768 --cache-bytes 4G" (out of core); sims: ARGS="--devices sim:4 --n 2048".
ARGS ?= --n 4096
run: $(STAMP)
	$(BIN)/blasx gemm $(ARGS)

bench-micro: $(STAMP)
	$(BIN)/python -m pytest -q bench/micro

clean:
	rm -rf $(VENV) build *.egg-info blasx/*.so
