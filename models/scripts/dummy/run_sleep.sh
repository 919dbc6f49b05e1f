#!/bin/sh
# dummy_sleep: runs until stopped (cancel and time-limit tests). Listens nowhere, just waits.
. "$(dirname "$0")/common.sh"
echo "sleeping until stopped"
while :; do sleep 5; done
