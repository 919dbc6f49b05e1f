#!/usr/bin/env bash
# `make test`: the whole suite in four pytest runs, then its total wall time.
#   0. the lab's time guards (lab_alone), first and with nothing beside them: they measure what a job costs;
#   1. the lab tests marked lab_serial (the faults, and the few that take the lab down, grow it or submit exclusive
#      jobs), one at a time: the fault tests' time bounds hold on a lab whose jobs are their own. They wait more than
#      they compute (half the machine's CPU was idle in that run: timeouts, dead nodes, SLURM's holds), so
#   2. every test that needs no lab (the unit tests, those with a private Docker daemon, the static checks,
#      molecule) runs beside them, on one xdist worker and at a lower priority: it takes the idle core, never both;
#      its output is printed once it ends, not mixed into the lab run's;
#   3. the lab's integration tests, one test module per xdist worker, two at a time, each running its jobs one at a
#      time (SLURM_MULTI_TEST_AT_ONCE=1): two jobs at a time fill the two cores, also while one module waits on a
#      sleeping model or a SLURM requeue. The longest modules start first (tests/conftest.py's LONGEST_FIRST), so
#      neither worker ends alone.
# Arguments go to every run (a path or -k picks tests). A run that collects nothing (exit 5) is no failure when
# another collected something.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
start=$(date +%s)
# Without a path among the arguments, the lab runs take their folders in this order.
lab_order=(tests/integration tests/faults tests/unit tests/test_*.py)
for arg in "$@"; do
    if [ -e "${arg%%::*}" ]; then lab_order=(); fi
done

# SUITE_JUNIT_DIR, when set, keeps each run's junit XML there (where the time went, test by test).
junit() { if [ -n "${SUITE_JUNIT_DIR:-}" ]; then echo "--junitxml=$SUITE_JUNIT_DIR/$1.xml"; fi; }

"$PYTHON" -m pytest -m "lab and lab_alone" -p no:xdist --durations=5 $(junit lab-alone) "${lab_order[@]}" "$@"
lab_alone=$?

# The PyTorch base (debootstrap and the torch wheel, minutes once per machine) is made beside the serial run, where
# the CPU waits more than it works: inside the shared run's first test that needs it, it took 7 of the test's 15
# minutes on a fresh machine, beside another worker's jobs.
base_log=$(mktemp "${TMPDIR:-/tmp}/slurm-multi-pytorch-base.XXXXXX")
nice -n 10 "$PYTHON" -m slurm_multi.cli lab pytorch-base >"$base_log" 2>&1 &
base_pid=$!
no_lab_log=$(mktemp "${TMPDIR:-/tmp}/slurm-multi-no-lab.XXXXXX")
nice -n 5 "$PYTHON" -m pytest -m "not lab" -n 1 --durations=10 $(junit no-lab) "$@" >"$no_lab_log" 2>&1 &
no_lab_pid=$!
"$PYTHON" -m pytest -m "lab and lab_serial and not lab_alone" -p no:xdist --durations=20 $(junit lab-serial) "${lab_order[@]}" "$@"
lab_serial=$?
wait "$no_lab_pid"
no_lab=$?
echo "=== the run beside it, of every test that needs no lab ==="
cat "$no_lab_log"
rm -f "$no_lab_log"
wait "$base_pid" || echo "=== making the PyTorch base failed: the tests that need it will say so ==="
cat "$base_log"
rm -f "$base_log"
SLURM_MULTI_TEST_AT_ONCE=1 "$PYTHON" -m pytest -m "lab and not lab_serial and not lab_alone" -n 2 --dist loadfile \
    --no-loadscope-reorder --durations=20 $(junit lab-shared) "${lab_order[@]}" "$@"
lab_shared=$?

elapsed=$(( $(date +%s) - start ))
echo "make test: $(( elapsed / 60 )) min $(( elapsed % 60 )) s of wall time (exit codes: time guards alone $lab_alone," \
    "serial lab run $lab_serial, no-lab run beside it $no_lab, lab run two at a time $lab_shared)"
for rc in "$lab_alone" "$no_lab" "$lab_serial" "$lab_shared"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
if [ "$lab_alone" -eq 5 ] && [ "$no_lab" -eq 5 ] && [ "$lab_shared" -eq 5 ] && [ "$lab_serial" -eq 5 ]; then exit 5; fi
exit 0
