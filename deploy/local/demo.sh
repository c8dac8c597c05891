#!/usr/bin/env bash
# The live demo, from a fresh machine: starts Kafka and Redis, builds tally (release), starts the
# aggregator, sends a burst of Zipf-distributed likes through `tally load`, waits until Redis
# holds exactly what was sent, shows the top counters and the rates reached, and stops cleanly.
#
#   EVENTS=1000000 COUNTERS=10000 ZIPF=1.1 deploy/local/demo.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$root"
events=${EVENTS:-1000000}
counters=${COUNTERS:-10000}
zipf=${ZIPF:-1.1}

"$here/start.sh"
log "building tally (release; the first build takes a few minutes)"
cargo build --release --bins --locked --quiet

# A fresh topic and key prefix per run, so that totals compare with this run's events only.
run_id=demo-$(date +%s)
demo_topic=tally.$run_id
demo_dlq=$demo_topic.dlq
create_topic "$demo_topic" "$partitions" >/dev/null
create_topic "$demo_dlq" 1 >/dev/null
metrics_port=${TALLY_DEMO_METRICS_PORT:-9464}
agg_log=$state/$run_id-aggregator.log
totals=$state/$run_id-totals.txt

log "starting tally-aggregator (log: $agg_log)"
./target/release/tally-aggregator --brokers "127.0.0.1:$kafka_port" --topic "$demo_topic" \
  --dead-letter-topic "$demo_dlq" --group "$run_id" --key-prefix "$run_id" \
  --redis-url "redis://127.0.0.1:$redis_port" --metrics-addr "127.0.0.1:$metrics_port" \
  >"$agg_log" 2>&1 &
agg_pid=$!
trap 'kill "$agg_pid" 2>/dev/null || true' EXIT
wait_for 30 "the aggregator's metrics endpoint" port_open "$metrics_port"

echo
echo "== sending $events likes over $counters posts (Zipf $zipf) through the producer crate"
started=$(date +%s.%N)
./target/release/tally load --brokers "127.0.0.1:$kafka_port" --topic "$demo_topic" \
  --events "$events" --counters "$counters" --zipf "$zipf" --top 0 --totals-out "$totals"

echo
echo "== waiting until every counter in Redis equals what was sent"
./target/release/tally verify --totals "$totals" --top 10 --timeout-s 120 \
  --redis-url "redis://127.0.0.1:$redis_port" --key-prefix "$run_id"
finished=$(date +%s.%N)

metrics=$( (exec 3<>"/dev/tcp/127.0.0.1/$metrics_port"; printf 'GET /metrics HTTP/1.1\r\n\r\n' >&3; cat <&3) )
flushed=$(awk '/^tally_events_flushed_total /{print $2}' <<<"$metrics")
flushes=$(awk '/^tally_flushes_total /{print $2}' <<<"$metrics")
writes=$(awk '/^tally_counter_writes_total /{print $2}' <<<"$metrics")
echo
echo "== pipeline"
awk -v n="$events" -v a="$started" -v b="$finished" -v f="$flushed" -v fl="$flushes" -v w="$writes" 'BEGIN {
  printf "end to end: %d events from first send to exact totals in Redis in %.2fs = %.0f events/s\n", n, b - a, n / (b - a)
  printf "aggregator: %d events flushed in %d flushes as %d counter writes (%.4f per event)\n", f, fl, w, w / f
}'

echo
echo "== stopping the aggregator (SIGTERM: drain, commit, exit)"
kill -TERM "$agg_pid"
wait "$agg_pid" && status=0 || status=$?
trap - EXIT
tail -n 1 "$agg_log" | sed 's/\x1b\[[0-9;]*m//g'
echo "tally-aggregator exited with status $status"
exit "$status"
