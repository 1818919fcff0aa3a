# Two commands do all the set-up on a fresh machine (only Python 3.10+ and git needed before):
#   make run    # creates .venv on first use (torch, then the project), then runs the default job
#   make test   # same environment, then python -m pytest -q tests
# Pass arguments with ARGS, e.g.  make run ARGS="experiment=tiny trainer.max_steps=5"
#                                 make test ARGS="-k parity -x"
# scripts/dev.py does the work (python3 scripts/dev.py --help); DEV_FLAGS=--dry-run shows what it would do.
PYTHON ?= python3
ARGS ?=
DEV_FLAGS ?=

.PHONY: run test docs help
help:
	@sed -n '1,6p' Makefile

run:
	$(PYTHON) scripts/dev.py $(DEV_FLAGS) run $(ARGS)

test:
	$(PYTHON) scripts/dev.py $(DEV_FLAGS) test $(ARGS)

docs:
	$(PYTHON) scripts/dev.py $(DEV_FLAGS) docs $(ARGS)
