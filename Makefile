# The two commands a new user needs: `make demo` (the main job on the built-in lab cluster) and `make test`.
# Both install everything first (Debian packages, the venv), on a fresh Debian machine as root.
# The Debian packages are listed once, in slurm_multi/lab/cluster.py (DEBIAN_PACKAGES): `lab-up` installs them when a command
# is missing - docker.io, slurm, munge, busybox-static, iptables (the dead-node fault), docker-registry (registry
# mode's registry on 127.0.0.1:17500) and apache2-utils (htpasswd, for a registry that asks for a login).

VENV     ?= .venv
PYTHON   ?= python3
BIN      := $(VENV)/bin
NODES    ?= 3

.PHONY: setup demo test unit coverage collection lab-up lab-down clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -m venv --help >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q python3-venv python3-pip)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# The checkout's own bytecode, as pip compiles an installed package's: under PYTHONDONTWRITEBYTECODE (set on CI's
	# machine) every Python a job starts would compile the project's code again (0.1-0.2 s of CPU in each).
	$(BIN)/python -m compileall -q slurm_multi module_utils plugins >/dev/null
	@touch $@

lab-up: setup
	$(BIN)/slurm-multi lab up --nodes $(NODES)

lab-down: setup
	$(BIN)/slurm-multi lab down

# MODEL=<name> runs another sample of models/models.json (pyt_ddp_tiny: a real PyTorch job); default dummy_lastrank.
# RUNTIME=charliecloud runs it with no Docker (docs/no-docker.md); default docker.
demo: lab-up
	MODEL=$(MODEL) RUNTIME=$(RUNTIME) $(BIN)/python -m slurm_multi.lab.demo

# The HTML report's browser test drives Debian's chromium through Playwright (the venv's test extra), which never
# downloads a browser of its own.
test: lab-up
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)
	PYTHON=$(BIN)/python bash tests/run_suite.sh $(PYTEST_ARGS)

# The inner loop: the tests that need no lab and no Docker daemon, on two workers.
unit: setup
	$(BIN)/python -m pytest -m "not lab and not docker" -n 2 -q $(PYTEST_ARGS)

# The suite's line coverage in every process it starts (tests/support/suite_coverage.py): COVERAGE_DIR/covered.json
# per pipeline mode; `python -m tests.support.suite_coverage compare OLD.json NEW.json` lists any line lost.
COVERAGE_DIR ?= /tmp/slurm-multi-coverage
coverage: lab-up
	rm -rf $(COVERAGE_DIR)
	SLURM_MULTI_COVERAGE=$$($(BIN)/python -m tests.support.suite_coverage install $(COVERAGE_DIR)) \
	  PYTHON=$(BIN)/python bash tests/run_suite.sh $(PYTEST_ARGS); \
	$(BIN)/python -m tests.support.suite_coverage combine $(COVERAGE_DIR)

# The slurm_multi.pipeline Ansible collection, built from the checkout's folders with real files:
# build/collection/slurm_multi-pipeline-<version>.tar.gz, for `ansible-galaxy collection install` (docs/cluster.md,
# "Installing as a collection").
collection: setup
	$(BIN)/python -m slurm_multi.collection --output build/collection

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
