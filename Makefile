# The two commands of the README.  Both set everything up first (Java 17, .venv, pins).
VENV := .venv
STAMP := $(VENV)/.raymq-installed

.PHONY: demo test bench install lint

$(STAMP): pyproject.toml .ci/install.sh tests/wire/kafkajs/package-lock.json
	bash .ci/install.sh

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raymq demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest

bench: $(STAMP)
	$(VENV)/bin/raymq bench

# the layout's rules (tests/test_layout.py), printing the largest functions and classes
lint: $(STAMP)
	$(VENV)/bin/python -m pytest -q -s tests/test_layout.py -k "over or way or root"
