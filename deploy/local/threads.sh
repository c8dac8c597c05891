#!/usr/bin/env bash
# Where one catch-up's CPU goes: starts BINARY (a tally-aggregator) with a fresh consumer group
# and key prefix on TOPIC, times it from launch until tally_events_flushed_total reaches N, and
# prints each of its threads' CPU seconds summed by name (the consume loop runs on the main
# thread, named after the binary; `tokio-rt-worker` are the fetcher and flushes; `tally-ids`
# decides idempotency keys), the wall time and rate, the Kafka broker's and redis-server's CPU
# seconds over the run and the machine's idle share (lowered by this script's own polling of the
# metrics every 20 ms: judge by the CPU seconds). Its keys are deleted afterwards. Flags
# after N go to the aggregator:
#
#   deploy/local/threads.sh BINARY TOPIC N [FLAGS...]
#   deploy/local/threads.sh target/release/tally-aggregator bench-1-events-ids 5000000 --namespaces idem.toml
set -euo pipefail
source "$(dirname "$0")/common.sh"
[[ $# -ge 3 ]] || { log "usage: $0 BINARY TOPIC N [FLAGS...]"; exit 1; }
bin=$1 topic=$2 events=$3
shift 3
ticks=$(getconf CLK_TCK)
port=$((19000 + RANDOM % 1000)) group=threads-$RANDOM-$$
cpu_of() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
kafka=$(pgrep -f kafka.Kafka | head -1) redis=$(pgrep -x redis-server | head -1)
k0=$(cpu_of "$kafka") r0=$(cpu_of "$redis")
read -r _ u n s i w x y z _ </proc/stat
t0=$((u + n + s + i + w + x + y + z)) i0=$((i + w))
start=$(date +%s.%N)
"$bin" --brokers "127.0.0.1:$kafka_port" --redis-url "redis://127.0.0.1:$redis_port" \
  --topic "$topic" --group "$group" --key-prefix "$group" --metrics-addr "127.0.0.1:$port" \
  "$@" >"$state/threads-$group.log" 2>&1 &
pid=$!
wait_flushed "$port" "$events" "$pid" "$state/threads-$group.log" || exit 1
end=$(date +%s.%N)
read -r _ u n s i w x y z _ </proc/stat
t1=$((u + n + s + i + w + x + y + z)) i1=$((i + w))
k1=$(cpu_of "$kafka") r1=$(cpu_of "$redis")
for task in /proc/"$pid"/task/*; do
  awk -v t="$ticks" '{ name = $2; gsub(/[()]/, "", name); print name, ($14 + $15) / t }' "$task/stat"
done | awk '{ cpu[$1] += $2 } END { for (name in cpu) if (cpu[name] >= 0.01) printf "%s %.2f  ", name, cpu[name]; print "CPU s" }'
kill "$pid"
wait "$pid" 2>/dev/null || true
awk -v s="$start" -v e="$end" -v n="$events" -v k=$((k1 - k0)) -v r=$((r1 - r0)) -v t="$ticks" \
  -v a=$((t1 - t0)) -v b=$((i1 - i0)) \
  'BEGIN { printf "wall %.2f s, %.0f events/s; Kafka broker %.2f, redis-server %.2f CPU s; machine %.0f%% idle\n", e - s, n / (e - s), k / t, r / t, 100 * b / a }'
redis-cli -p "$redis_port" --scan --pattern "$group*" | xargs -r -n 5000 redis-cli -p "$redis_port" unlink >/dev/null
