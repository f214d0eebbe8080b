# One command each: `make demo` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup test quick demo bench readme-figures clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(None if v == (3, 11) else "hespas-ml needs Python 3.11 (its pinned jax, torch and scalesim resolve together there); $(PYTHON) is %d.%d: run make with PYTHON=python3.11" % v)'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest -q

quick: setup
	$(PY) -m pytest -q -m "not slow"

demo: setup
	$(VENV)/bin/hespas-ml simulate 'zoo:mlp?layers=4&width=2048&batch=512&step=train' --target H100 --system ring:4x150 --out out/demo

bench: setup
	$(PY) eval/bench_pipeline.py

readme-figures: setup
	$(PY) eval/readme_figures.py --all

clean:
	rm -rf out .pytest_cache
