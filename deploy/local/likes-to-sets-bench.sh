#!/usr/bin/env bash
# Times `tally likes-to-sets` on a deployment made by a real catch-up: an aggregator counting
# likes in the shares (the layout record set to `shares` first) takes TOPIC (N events of the
# deduplicating namespace `likes`, e.g. written by deploy/local/likes-workload.py), stops, and
# the move runs; a sample of 200 counters' totals is read before and after with `tally get` and
# must be the same. Prints the member sets before, what the move printed, its time, and what is
# left. Its keys are deleted afterwards. Release builds of tally-aggregator and tally are used.
#
#   deploy/local/likes-to-sets-bench.sh TOPIC N
set -euo pipefail
source "$(dirname "$0")/common.sh"
[[ $# -eq 2 ]] || { log "usage: $0 TOPIC N"; exit 1; }
topic=$1 events=$2
bin=$root/target/release
redis="redis://127.0.0.1:$redis_port"
prefix=likes-move-$RANDOM-$$ port=$((19000 + RANDOM % 1000))
namespaces=$state/likes-move-namespaces.toml
printf '[namespaces.likes]\ndedup = true\n' > "$namespaces"
rcli() { redis-cli -p "$redis_port" "$@"; }
rcli hset "$prefix:layout" origin recorded likes shares >/dev/null
"$bin/tally-aggregator" --brokers "127.0.0.1:$kafka_port" --redis-url "$redis" --topic "$topic" \
  --group "$prefix" --key-prefix "$prefix" --metrics-addr "127.0.0.1:$port" \
  --namespaces "$namespaces" >"$state/$prefix.log" 2>&1 &
pid=$!
wait_flushed "$port" "$events" "$pid" "$state/$prefix.log" || exit 1
kill "$pid"
wait "$pid" 2>/dev/null || true
echo "member sets: $(rcli --scan --pattern "$prefix:*:m:*" | wc -l)"
mapfile -t sample < <(rcli --scan --pattern "$prefix:*:m:*" | sed 's/.*}:m://' | sort | head -200)
get() { "$bin/tally" get --redis-url "$redis" --key-prefix "$prefix" --namespaces "$namespaces" "${sample[@]}"; }
before=$(get)
start=$(date +%s.%N)
"$bin/tally" likes-to-sets --redis-url "$redis" --key-prefix "$prefix" --namespaces "$namespaces"
end=$(date +%s.%N)
after=$(get)
[[ $before == "$after" ]] || { log "totals differ after the move"; diff <(echo "$before") <(echo "$after"); exit 1; }
echo "a sample of ${#sample[@]} totals reads the same before and after"
awk -v s="$start" -v e="$end" 'BEGIN { printf "the move took %.2f s\n", e - s }'
echo "member sets left: $(rcli --scan --pattern "$prefix:*:m:*" | wc -l), count sets: $(rcli --scan --pattern "$prefix:*:s:*" | wc -l)"
rcli --scan --pattern "$prefix*" | xargs -r -n 5000 redis-cli -p "$redis_port" unlink >/dev/null
