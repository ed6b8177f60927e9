# The two commands of the README: `make demo` and `make test`. Both set up what they need first.
CACHE ?= $(or $(MEGATRON_OPERATOR_CACHE),$(HOME)/.cache/megatron-operator)
PY := $(CACHE)/venv/bin/python
export PYTHONPATH := $(CURDIR)/contract:$(CURDIR)/operator:$(CURDIR)/trainer:$(CURDIR)/localcluster
export MEGATRON_OPERATOR_CACHE := $(CACHE)

.PHONY: setup demo test lint crds docs cluster-up cluster-down

setup:
	@scripts/setup.sh

demo: setup
	$(PY) -m localcluster.demo

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(CACHE)/venv/bin/lint-imports

crds:
	$(PY) -m megatron_contract.crd --write

# docs/api.md from the contract's models; the chart's values table in docs/configuration.md with helm-docs.
docs:
	$(PY) -m megatron_contract.docs --write
	$(PY) -m localcluster.chart_docs --write
