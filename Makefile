# `make demo` sets up .venv (if missing), installs the project and runs the main job; `make test` runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: a loose requirement would pull a multi-GB build where a local wheel exists
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	# the server extra (torch, ray, FastAPI, ...) and the test tools; a bare `pip install .` is the client only
	$(PY) -m pip install -q -e '.[server,dev]'
	touch $(STAMP)

.PHONY: install demo test
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dit-serve demo --out out/demo

# a process per core (tests/conftest.py says how many), each test file's tests in one of them (they share its
# module-scoped service or engine), files handed out in the order tests/conftest.py gives them
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder
