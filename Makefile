# nanscan: `make demo` and `make test` set everything up on a fresh machine (.venv, dependencies, native build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch that dev machines and CI have on disk; a plain `torch` would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# Ranges matching the extras in pyproject.toml (tested with transformers 5.24, lightning 2.6.6, accelerate 1.15,
# wandb 0.31: its tests run it offline, no account or network; deepspeed 0.19.8 on the CPU, whose ZeRO internals
# nanscan.integrations.deepspeed reads, hence the narrow range; peft 0.21 for the frozen-weight LoRA test; datasets
# 5.2 for the quarantine's HF datasets path, nanscan.skip_quarantined).
FRAMEWORKS := "transformers>=5.0,<6" "lightning>=2.4,<3" "accelerate>=1.1,<2" "wandb>=0.19" "deepspeed>=0.19,<0.20" \
	"peft>=0.21,<1" "datasets>=2.14"
NATIVE_SOURCES := $(shell find csrc -type f) setup.py pyproject.toml

.PHONY: all install demo test test-slow test-native test-numba bench bench-all gpu-check clean

all: install

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

# Dependencies first (torch pinned), then nanscan itself without build isolation so it builds against them.
$(VENV)/.deps: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install -q $(TORCH_PIN) "pybind11>=2.12" "numpy>=1.24"
	$(PY) -m pip install -q "numba>=0.59" "matplotlib>=3.7" "Pillow>=10" "pyarrow>=14" "tokenizers>=0.15" \
		"safetensors>=0.4" "rich>=13" "markdown-it-py>=2.2" "click>=8.1" "tensorboard>=2.14" "google-crc32c>=1.5" "pytest>=8" "pytest-timeout>=2" \
		"hypothesis>=6"
	# The frameworks of nanscan/integrations/, so their tests run (after torch: they must not replace the pin).
	# DS_BUILD_OPS=0: DeepSpeed builds no native op at install (its tests need none on the CPU).
	DS_BUILD_OPS=0 $(PY) -m pip install -q $(TORCH_PIN) $(FRAMEWORKS)
	# torchtitan 0.3.0 requires a CUDA torch build and datasets<4.8: its wheel and the two packages its optimizer
	# module imports go in without their dependencies (tests/test_optimizer_containers.py builds its real
	# OptimizersContainer), tyro with its own.
	$(PY) -m pip install -q $(TORCH_PIN) "tyro>=0.9"
	$(PY) -m pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" "torch_checkpointing>=0.1"
	touch $@

$(VENV)/.installed: $(VENV)/.deps $(NATIVE_SOURCES)
	NANSCAN_REQUIRE_NATIVE=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) -m nanscan info
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/nanscan demo

# Every test with the native backends, then again with the numba fallback as the default backend
# (NANSCAN_BACKEND=numba) those whose outcome can change with it: all but the ones marked `once` (NOTE: [two passes]
# in tests/two_passes.py).
test: install
	$(PY) -m pytest -q -m "not slow"
	NANSCAN_BACKEND=numba $(PY) -m pytest -q -m "not once and not slow"

# The tests marked `slow`: several processes (gloo ranks, DeepSpeed, writers killed mid-write) or a build of the
# extension; CI runs them after `make test`, which stays within 15 minutes on a 2-core machine without them.
test-slow: install
	$(PY) -m pytest -q -m slow
	NANSCAN_BACKEND=numba $(PY) -m pytest -q -m "slow and not once"

bench: install
	$(PY) benchmarks/bench_scan.py --json benchmarks/results/bench_scan_cpu.json

bench-all: bench
	$(PY) benchmarks/bench_overhead.py --json benchmarks/results/bench_overhead.json
	$(PY) benchmarks/bench_many_tensors.py --json benchmarks/results/bench_many_tensors.json
	$(PY) benchmarks/bench_data.py --json benchmarks/results/bench_data.json
	$(PY) benchmarks/bench_frozen.py --json benchmarks/results/bench_frozen.json
	$(PY) benchmarks/bench_window.py --json benchmarks/results/bench_window.json

gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf build *.egg-info nanscan/_C*.so .pytest_cache .hypothesis
