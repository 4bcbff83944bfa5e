# study, test and notebooks first run scripts/setup.sh: it installs into .venv once, then returns at once.
PY := .venv/bin/python
# Extra pytest arguments, e.g. make test ARGS="-m 'not notebooks' -x"
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup study test notebooks render clean

help:
	@echo "make study      install into .venv, then run kvlab's main study (writes results/)"
	@echo "make test       install into .venv, then run the whole test suite, notebooks included"
	@echo "make notebooks  regenerate notebooks/*.ipynb from their .py sources, without outputs"
	@echo "make render     run every notebook and write it with its figures to docs/rendered/ (what GitHub shows)"
	@echo "make setup      only install (idempotent)"
	@echo "make clean      remove results and caches (keeps .venv)"

setup:
	@bash scripts/setup.sh

study: setup
	$(PY) -m kvlab study

test: setup
	$(PY) -m pytest $(ARGS)

notebooks: setup
	$(PY) scripts/sync_notebooks.py

render: notebooks
	$(PY) scripts/render_notebooks.py

clean:
	rm -rf results build .pytest_cache .hypothesis *.egg-info
	find . -path ./.venv -prune -o -name __pycache__ -type d -exec rm -rf {} +
