# The two commands of the README.  Both set everything up first (Java 17, .venv, pins).
VENV := .venv
STAMP := $(VENV)/.raymq-installed
# kafkajs for the Kafka listener's tests (npm ci writes this file)
KAFKAJS := tests/wire/kafkajs/node_modules/.package-lock.json

.PHONY: demo test bench install lint

$(STAMP): pyproject.toml .ci/install.sh
	bash .ci/install.sh

install: $(STAMP)

$(KAFKAJS): tests/wire/kafkajs/package-lock.json .ci/install_test_clients.sh
	bash .ci/install_test_clients.sh

demo: $(STAMP)
	$(VENV)/bin/raymq demo

test: $(STAMP) $(KAFKAJS)
	$(VENV)/bin/python -m pytest

bench: $(STAMP)
	$(VENV)/bin/raymq bench

# the layout's rules (tests/test_layout.py), printing the largest functions and classes
lint: $(STAMP)
	$(VENV)/bin/python -m pytest -q -s tests/test_layout.py -k "over or way or root"
