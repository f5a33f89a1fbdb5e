# Two entry points, each doing all of its own set-up on a fresh machine:
#   make demo   virtual environment + crew, then train examples/train.py on 2 local ranks
#   make test   the same environment + test extras (+ sshd and pdsh), then the test suite
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python

.PHONY: demo test install gpu-check ds-unit docs compat

install: $(VENV)/.installed

# torch first, pinned: the CPU build; an unpinned resolve would fetch the CUDA one.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: install
	rm -rf runs/demo runs/demo-checkpoints  # the last demo's curve (csv_monitor, examples/ds_config.json) and saves
	$(VENV)/bin/crew run --num_gpus 2 examples/train.py --deepspeed --deepspeed_config examples/ds_config.json \
		--save_dir runs/demo-checkpoints

test: install
	tools/system-deps.sh
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The CUDA check (benchmarks/gpu_check.py): on a GPU machine, in one command; without CUDA one line, exit 0.
# It needs no install step: crew runs from this checkout (PYTHONPATH) under the Python that has CUDA torch
# (GPU_PYTHON: this project's venv when there is one, else python3, as on the lent GPU machines).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# DeepSpeed's own unit tests (tests/unit/ of a DeepSpeed checkout, DS_SRC) against crew's `deepspeed` shim; not
# part of `make test`, which never fetches DeepSpeed. DS_UNIT_ARGS: e.g. --reference /opt/dsvenv/bin/python.
ds-unit: install
	@test -n "$(DS_SRC)" || { echo "make ds-unit DS_SRC=path/to/DeepSpeed (a source checkout)"; exit 2; }
	$(PY) tools/deepspeed_unit_tests.py $(DS_SRC) $(DS_UNIT_ARGS)

# The manual (docs/, mkdocs.yml) as a site in site/: the docs extra, then a strict build (a warning fails it).
docs: install
	$(PY) -m pip install -q -e '.[docs]'
	$(VENV)/bin/mkdocs build --strict --site-dir site

# The torch and Python versions crew promises (pyproject.toml), each in a throwaway venv under .compat/ running a
# quick subset of the tests; prints a table. Not part of `make test`: it downloads several GB. COMPAT_ARGS: e.g.
# --torch 2.11.0 to try one version.
compat:
	$(PYTHON) tools/compat.py $(COMPAT_ARGS)
