# Two commands do all the set-up:  make run  (install + CPU quick-start)   make test  (install + tests)
PYTHON ?= python3
VENV ?= .venv

.PHONY: install run test clean

$(VENV)/.installed: requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -r requirements.txt
	touch $@

install: $(VENV)/.installed

# The CPU quick-start on the bundled tiny-shakespeare text (see README); any Hydra override via ARGS="...".
run: install
	$(VENV)/bin/python main.py preset=cpu $(ARGS)

test: install
	$(VENV)/bin/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV)  # outputs/ and snapshots/ are your runs: delete them yourself
