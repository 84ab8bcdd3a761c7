# Each target does its own setup: a .venv with the CPU build of torch 2.13.0, then this project.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: train test lint bench setup mutate device-wheels

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

train: setup  ## the main job: a tiny Llama on Python's own documentation text, on the CPU
	$(BIN)/trainer fit recipes/llama_tiny.yaml

# three pytest-xdist workers on 2 cores: idle core time halves against two, though in a same-hour pair the
# wall time did not fall (the busy CPU rose as much; README, "Tests"); a launch of 3+ processes waits to run
# alone (tests/helpers.py rank_slots). loadscope: a module's tests share a worker, so
# its module-scoped launches run once (loadgroup would not: xdist 3.8 marks groups in a test id pytest 9 ignores);
# --no-loadscope-reorder: modules in the order tests/conftest.py gives them (the longest first), not by test count.
# --durations: CI's log names the slowest tests, where the suite's time goes.
# PYTHONDONTWRITEBYTECODE unset: where the environment sets it (this machine's does), a clean checkout has no
# bytecode to read, and every worker rewrote the asserts of all ~230 test files (~7 CPU-s of its ~21 s of
# collection) and every fresh interpreter compiled the project again; the caches go to ignored __pycache__ folders
TEST_WORKERS ?= 3
test: setup  ## the whole test suite (slow tests included)
	env -u PYTHONDONTWRITEBYTECODE WANDB_MODE=offline HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports

bench: setup
	$(BIN)/python bench/overhead.py && $(BIN)/python bench/throughput.py && $(BIN)/python bench/scaling.py && $(BIN)/python bench/checkpoint.py && $(BIN)/python bench/guards.py && $(BIN)/python bench/pipeline.py && $(BIN)/python bench/dpsgd.py && $(BIN)/python bench/moe.py

mutate: setup  ## mutation testing of the core files (hours; SAMPLE=N: N mutants per file; GLOO=N: strategies vs gloo tests)
	$(BIN)/pip install -q -e '.[dev,mutate]'
	$(BIN)/python .ci/mutate.py $(if $(SAMPLE),--sample $(SAMPLE)) $(if $(GLOO),--gloo $(GLOO)) $(if $(SEED),--seed $(SEED))

# torchft and the OpenTelemetry packages it imports, the versions this project's .venv holds, built for a lent
# device's Python 3.12 (it has torch and the rest, not these): bench/ft_cores.sh installs them there
DEVICE_PY ?= 3.12
device-wheels: setup  ## wheels for bench/ft_cores.sh on a device, into .device-wheels (carried by `run`)
	rm -rf .device-wheels  # (its own folder: wheels of an earlier .venv would be installed beside these)
	$(BIN)/pip download -q --no-deps --only-binary :all: --python-version $(DEVICE_PY) -d .device-wheels \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	  $$($(BIN)/pip freeze | grep -E '^(torchft|opentelemetry-[a-z-]+|googleapis-common-protos|protobuf)==')
