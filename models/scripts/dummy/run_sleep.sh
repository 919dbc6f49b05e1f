#!/bin/sh
# dummy_sleep: runs until stopped (cancel and time-limit tests). Listens nowhere, just waits.
. "$(dirname "$0")/common.sh"
# SLEEP_IGNORES_TERM=1: a model slow to stop, as a trainer writing its checkpoint is: `docker stop` waits out its
# grace before its SIGKILL, so the run module's stop takes that long.
if [ -n "${SLEEP_IGNORES_TERM:-}" ]; then trap '' TERM; fi
echo "sleeping until stopped"
while :; do sleep 5; done
