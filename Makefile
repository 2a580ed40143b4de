# make demo: create a venv if missing, install, convert a checkpoint the project builds itself and print the RMSE table.
# make test: same install (with test extras), run the whole test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moepack-installed

.PHONY: demo test install clean bench

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m moepack demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

bench: $(STAMP)
	$(PY) benchmarks/convert.py

clean:
	rm -rf $(VENV) build *.egg-info
