#!/usr/bin/env bash
# `make test`: the whole suite as two pytest runs side by side, then its total wall time.
#   * the lab tests, serially, in the foreground: they share one lab cluster. The integration tests come first, so
#     the fault tests (several assert time bounds) run after the other run has ended, on a machine of their own;
#   * every test that needs no lab (the unit tests, those with a private Docker daemon, the static checks, molecule)
#     in the background, its output shown when it ends: it fills the CPU the lab's jobs leave idle while they wait
#     on SLURM, srun and Docker.
# Arguments go to both runs (a path or -k picks tests). A run that collects nothing (exit 5) is no failure when the
# other collected something.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
start=$(date +%s)
no_lab_log=$(mktemp /tmp/slurm-multi-no-lab-tests.XXXXXX.log)
# Without a path among the arguments, the lab run takes its folders in that order.
lab_order=(tests/integration tests/faults tests/unit tests/test_*.py)
for arg in "$@"; do
    if [ -e "${arg%%::*}" ]; then lab_order=(); fi
done

"$PYTHON" -m pytest -m "not lab" -p no:xdist "$@" >"$no_lab_log" 2>&1 &
no_lab_pid=$!
"$PYTHON" -m pytest -m lab -p no:xdist "${lab_order[@]}" "$@"
lab=$?
wait "$no_lab_pid"
no_lab=$?
echo "===== the tests that need no lab (run beside the lab tests) ====="
cat "$no_lab_log" && rm -f "$no_lab_log"

elapsed=$(( $(date +%s) - start ))
echo "make test: $(( elapsed / 60 )) min $(( elapsed % 60 )) s of wall time (lab tests: exit $lab, the others: exit $no_lab)"
for rc in "$lab" "$no_lab"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$lab" -eq 5 ] && [ "$no_lab" -eq 5 ]; then exit 5; fi
exit 0
