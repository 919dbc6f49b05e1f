#!/usr/bin/env bash
# `make test`: the whole suite in two pytest runs, then its total wall time.
#   1. every test that needs no lab (the unit tests, those with a private Docker daemon, the static checks,
#      molecule) on two xdist workers: none shares state with another;
#   2. the lab tests, serially (integration first, faults after): they share one lab cluster, and the fault tests'
#      time bounds, like the preflight's clock check, hold on a machine the lab's jobs have to themselves. A test
#      that runs jobs side by side does so itself (tests/support/per_mode_jobs.py).
# Arguments go to both runs (a path or -k picks tests). A run that collects nothing (exit 5) is no failure when the
# other collected something.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
start=$(date +%s)
# Without a path among the arguments, the lab run takes its folders in this order.
lab_order=(tests/integration tests/faults tests/unit tests/test_*.py)
for arg in "$@"; do
    if [ -e "${arg%%::*}" ]; then lab_order=(); fi
done

# SUITE_JUNIT_DIR, when set, keeps each run's junit XML there (where the time went, test by test).
junit() { if [ -n "${SUITE_JUNIT_DIR:-}" ]; then echo "--junitxml=$SUITE_JUNIT_DIR/$1.xml"; fi; }

"$PYTHON" -m pytest -m "not lab" -n 2 --durations=10 $(junit no-lab) "$@"
no_lab=$?
"$PYTHON" -m pytest -m lab -p no:xdist --durations=20 $(junit lab) "${lab_order[@]}" "$@"
lab=$?

elapsed=$(( $(date +%s) - start ))
echo "make test: $(( elapsed / 60 )) min $(( elapsed % 60 )) s of wall time (no-lab run: exit $no_lab, lab run: exit $lab)"
for rc in "$no_lab" "$lab"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$no_lab" -eq 5 ] && [ "$lab" -eq 5 ]; then exit 5; fi
exit 0
