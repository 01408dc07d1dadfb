# Two entry points: `make demo` (the main job on local sandbox hosts) and `make test`.
# Each creates or refreshes .venv and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch==2.13.0 is the CPU build on this fleet's controllers; triton pinned to the GPU hosts' version.
PINS := torch==2.13.0 triton==3.6.0

.PHONY: venv sshd demo test bench-cli typecheck clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PINS) -e '.[test]'
	touch $@

# Debian's openssh-server, for the sandbox hosts (fresh machine, run as root).
sshd:
	@test -x /usr/sbin/sshd || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server; }

demo: venv sshd
	$(BIN)/python -m flows.pipelines.demo

test: venv sshd
	$(BIN)/python -m pytest

# start-up time of `kdbench --help` and `kdbench hosts list`, each also as a multiple of `python -c pass`
# (a benchmark, not a test)
bench-cli: venv
	$(BIN)/python tests/bench_cli_startup.py

# attribute errors on typed rows (a misspelt column, a row of the wrong table) in the controller; not in CI:
# optional values and the remaining argument types are not checked
typecheck: venv
	$(BIN)/python -m pip install -q mypy
	$(BIN)/python -m mypy --ignore-missing-imports --follow-imports=silent --no-strict-optional \
		$(foreach c,arg-type call-arg assignment misc return-value var-annotated,--disable-error-code=$(c)) \
		flows engine/rows.py

clean:
	rm -rf $(VENV) .sandbox
