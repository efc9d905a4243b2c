# make run : set up .venv and run the main job (ridge demo on the embedded random model)
# make test: set up .venv and run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch 2.13.0 is the CPU wheel on these machines; a torch already installed (a CUDA build
# on a GPU box, say) is kept: the venv sees system packages and pip only adds what is missing.
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test setup clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m ridge.layers.cpu_kernels
	touch $@

setup: $(VENV)/.ready

run: setup
	$(VENV)/bin/ridge demo

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
