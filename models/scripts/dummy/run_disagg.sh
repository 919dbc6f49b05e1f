#!/bin/sh
# dummy_disagg: the shape of SGLang disaggregated serving, with busybox. madengine's sglang-disagg launcher gives
# every node SGLANG_NODE_IPS (all nodes' addresses, rank order) and SGLANG_NODE_RANK: rank 0 is the proxy, ranks
# 1..SGLANG_DISAGG_PREFILL_NODES serve prefill, the rest decode. Each server answers on its own address; the proxy
# asks every one, then says "done" on its own address, which stops the servers; it reports how many answered.
. "$(dirname "$0")/common.sh"
set -eu
: "${SGLANG_DISAGG_MODE:?run with distributed.launcher sglang-disagg}" "${SGLANG_NODE_IPS:?}" "${SGLANG_NODE_RANK:?}"
port="$MASTER_PORT"
address_of() { echo "$SGLANG_NODE_IPS" | cut -d, -f"$(($1 + 1))"; }
own=$(address_of "$SGLANG_NODE_RANK")
proxy=$(address_of 0)
root=$(mktemp -d)
httpd -f -p "$own:$port" -h "$root" &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
# GET http://<address>:<port>/<file>'s body (busybox-static's wget crashes on this libc; nc does not).
get() {
  printf 'GET /%s HTTP/1.0\r\n\r\n' "$2" | nc -w 2 "$1" "$port" 2>/dev/null |
    awk 'NR == 1 && $2 != 200 { exit 1 } body { print } /^\r?$/ { body = 1 }'
}

if [ "$SGLANG_NODE_RANK" -gt 0 ]; then
  role=decode
  if [ "$SGLANG_NODE_RANK" -le "$SGLANG_DISAGG_PREFILL_NODES" ]; then role=prefill; fi
  echo "$role server rank $SGLANG_NODE_RANK at $own" > "$root/answer"
  echo "serving $role on $own:$port"
  # Until the proxy says done (120 s at most: a proxy that never does fails the run).
  for _ in $(seq 240); do
    if [ "$(get "$proxy" status)" = done ]; then echo "proxy done: stopping"; exit 0; fi
    sleep 0.5
  done
  echo "RuntimeError: the proxy at $proxy never said done" >&2
  exit 1
fi

echo serving > "$root/status"
answered=0
rank=1
while [ "$rank" -lt "$SGLANG_DISAGG_TOTAL_NODES" ]; do
  address=$(address_of "$rank")
  answer=""
  for _ in $(seq 120); do
    answer=$(get "$address" answer) && [ -n "$answer" ] && break
    sleep 0.5
  done
  if [ -n "$answer" ]; then answered=$((answered + 1)); echo "rank $rank answered: $answer"; else
    echo "rank $rank at $address did not answer"; fi
  rank=$((rank + 1))
done
echo done > "$root/status"
# The servers poll every 0.5 s: give each time to read "done" before the proxy's own server goes.
sleep 2
echo "performance: $answered servers_answered"
