# `make run`: set up .venv/ if needed and run the embedded default (pass Hydra overrides in ARGS=...).
# `make test`: set up .venv/ if needed and run the whole test suite.
VENV := .venv

.PHONY: setup run test
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh

run: setup
	$(VENV)/bin/molt-run $(ARGS)

test: setup
	$(VENV)/bin/pytest $(PYTEST_ARGS)
