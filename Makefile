# Two commands do all the set-up:  make run  (install + CPU quick-start)   make test  (install + tests)
PYTHON ?= python3
VENV ?= .venv
# The optional parts, each installed by name (README, "Install"): .venv/bin/pip install -r requirements-NAME.txt
EXTRAS = requirements-hf.txt requirements-mlflow.txt requirements-wandb.txt requirements-tensorboard.txt

.PHONY: install install-test run test clean

# pip's own options for both set-ups, e.g. INSTALL_FLAGS=--no-compile (.ci/run: its tests' processes cache the
# bytecode of what they import, a fraction of what pip would compile).
INSTALL_FLAGS ?=

# What a training run imports (requirements.txt), nothing more: `make run`'s set-up.
$(VENV)/.installed-run: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(INSTALL_FLAGS) -r requirements.txt
	touch $@

# The same, and the tests' tools with every optional part (requirements-test.txt): `make test`'s set-up.
$(VENV)/.installed-test: $(VENV)/.installed-run requirements-test.txt $(EXTRAS)
	$(VENV)/bin/python -m pip install $(INSTALL_FLAGS) -r requirements.txt -r requirements-test.txt
	touch $@

install: $(VENV)/.installed-run
install-test: $(VENV)/.installed-test

# The CPU quick-start on the bundled tiny-shakespeare text (see README); any Hydra override via ARGS="...".
run: install
	$(VENV)/bin/python main.py preset=cpu $(ARGS)

# The whole suite, TEST_WORKERS tests at a time (pytest-xdist: a file's tests in one worker, the longest files first,
# in tests/conftest.py's order; docs/testing.md). TEST_WORKERS=1: one at a time.
TEST_WORKERS ?= 2
test: install-test
	$(VENV)/bin/python -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(ARGS)

clean:
	rm -rf $(VENV) .venv-oldest .venv-oldest-fsdp  # outputs/ and snapshots/ are your runs: delete them yourself

# Wheels for a GPU machine without internet that has its own CUDA torch (and numpy, fsspec, tqdm, tensorboard,
# matplotlib, safetensors, pytest, pyyaml, packaging): what else main.py imports, i.e. hydra-core and omegaconf at
# requirements.txt's pins and hydra's parser runtime (antlr4-python3-runtime==4.9.*, an sdist only on PyPI: built
# here as a pure-Python wheel). s3fs is left out: only s3:// paths load it. All three are pure Python (py3-none-any,
# any CPython 3), 0.4 MB together, and committed in .gpu-wheels/ so that every copy of the working tree carries them
# (a lent machine gets the tracked files, no network); gpu_check.sh installs them into a temporary folder (never
# into that torch). Run this after a change of requirements.txt's pins and commit the folder
# (tests/e2e/test_gpu_check.py fails while it holds other versions).
GPU_WHEELS = .gpu-wheels
ANTLR4 = antlr4-python3-runtime==4.9.3

.PHONY: gpu-wheels
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	@pins=$$(grep -oE '^(hydra-core|omegaconf)==[^ #]+' requirements.txt); \
	test "$$(echo $$pins | wc -w)" = 2 || { echo "error: requirements.txt pins no hydra-core==/omegaconf==" >&2; exit 1; }; \
	echo "pip download" $$pins; \
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d $(GPU_WHEELS) $$pins
	$(PYTHON) -m pip wheel -q --no-deps --no-binary=:all: -w $(GPU_WHEELS) $(ANTLR4)
	@test "$$(ls $(GPU_WHEELS)/*-py3-none-any.whl | wc -l)" = 3 || { echo "error: not 3 pure-Python wheels" >&2; exit 1; }
	@ls $(GPU_WHEELS) && du -sh $(GPU_WHEELS)
