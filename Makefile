# The two commands of the README: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install serve test bench
install:
	PAGEFLEET_VENV=$(VENV) bash scripts/install.sh

serve: install
	$(VENV)/bin/pagefleet serve $(ARGS)

test: install
	$(VENV)/bin/pytest -q $(ARGS)

bench: install
	$(PY) benchmarks/offline_throughput.py
