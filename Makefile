# Two commands do everything on a fresh machine:
#   make run    the main job: specdec bench --quick on the shipped models (about half a minute)
#   make test   the whole test suite
# Both build .venv first (torch pinned to the CPU build 2.13.0; any other torch request pulls CUDA).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test
run: $(VENV)/.installed
	$(VENV)/bin/specdec bench --quick

test: $(VENV)/.installed
	$(PY) -m pytest -q

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@
