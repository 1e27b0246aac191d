# Two commands on a fresh machine: `make up` (serve the demo model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= models/demo
# The drafter `make up` serves beside MODEL (empty: MODEL/drafter, `ddtree up`'s default).
DRAFTER ?=
# Where the trained demo pair is absent, `make up` serves a random checkpoint of the same format.
FALLBACK_MODEL ?= models/random
TORCH_CPU ?= torch==2.13.0
# PyPI's Linux torch wheel is the CUDA build: the CPU build comes from PyTorch's own index, unless a
# local wheel (pip's find-links) has it already.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install test up protos clean

$(VENV)/.installed: pyproject.toml compose/gpu-constraints.txt Makefile
	@# pyproject.toml's requires-python, checked before minutes of installs end in pip's refusal; a
	@# .venv of an older Python is not reused (venv keeps its interpreter).
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "ddtree-serve needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) -V 2>&1). Run with PYTHON=python3.11 (or newer)." >&2; exit 1; }
	@if [ -x $(PY) ] && ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
	  echo "$(VENV) holds $$($(PY) -V 2>&1); remove it (make clean) and run again." >&2; exit 1; fi
	@echo "Installing ddtree-serve into $(VENV) (a minute or more; torch first: its CPU build where no GPU is present)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@# Without a GPU take the CPU build of torch first, so the project's torch requirement is met
	@# by it instead of pulling a multi-GB CUDA build (where it cannot be had, stop: not go on to that).
	@# With one, take the torch and Triton the GPU kernels were measured on (compose/gpu-constraints.txt).
	@# The local attempt's errors are kept: where the index fails too, they may be the real cause
	@# (a full disk reads as the index's network errors otherwise).
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  { $(PY) -m pip install -q --no-index --no-deps "$(TORCH_CPU)" 2>$(VENV)/torch-local.log || \
	    $(PY) -m pip install -q --index-url "$(TORCH_CPU_INDEX)" "$(TORCH_CPU)" || \
	    { echo "$(TORCH_CPU) could not be installed; the local attempt (pip --no-index) said:" >&2; \
	      cat $(VENV)/torch-local.log >&2; exit 1; }; } && \
	  $(PY) -m pip install -q -e '.[dev]'; \
	else $(PY) -m pip install -q -c compose/gpu-constraints.txt -e '.[dev,gpu]'; fi
	@touch $@
	@echo "Installed: $(VENV)/bin/ddtree"

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

up: install
	@# The random checkpoint stands in for the demo pair only: a MODEL the user named must be there.
	@if [ -f "$(MODEL)/config.json" ]; then m="$(MODEL)"; \
	elif [ "$(origin MODEL)" != "file" ]; then \
	  echo "MODEL=$(MODEL): no config.json there (a Hugging Face checkpoint directory)" >&2; exit 2; else \
	  m="$(FALLBACK_MODEL)"; \
	  [ -f "$$m/config.json" ] || $(VENV)/bin/ddtree make-checkpoint "$$m"; \
	  echo "$(MODEL) not found: serving the random checkpoint $$m" >&2; fi; \
	exec $(VENV)/bin/ddtree up --model "$$m" $(if $(DRAFTER),--drafter "$(DRAFTER)")

protos: install
	PYTHON=$(PY) bash protos/generate.sh

clean:
	rm -rf $(VENV) *.egg-info
