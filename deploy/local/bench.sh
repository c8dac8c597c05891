#!/usr/bin/env bash
# The benchmark command (README, "Performance"): on the local Kafka and Redis (started if they are
# not running), builds the release binaries, runs the criterion microbenchmark of decode +
# aggregate, then tally-bench: every scenario with its yardsticks (kcat, redis-benchmark, the
# naive consumer). Writes results.json, results.md and SVG plots to $BENCH_OUT (bench-results).
#
#   deploy/local/bench.sh                                   # defaults: a few minutes on 2 cores
#   deploy/local/bench.sh --events 1000000 --only catch-up,yardsticks
#   deploy/local/bench.sh --help                            # every scenario size
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$root"
out=${BENCH_OUT:-bench-results}

"$here/start.sh"
log "building the release binaries (the first build takes a few minutes)"
cargo build --release --locked --quiet --bins -p tally-aggregator -p tally-cli -p tally-bench
mkdir -p "$out"
if [[ " $* " != *" --only "* || " $* " == *micro* ]]; then
  log "criterion: decode + aggregate on one core"
  cargo bench --locked --quiet -p tally-aggregator --bench decode_aggregate >"$out/micro.txt"
fi
./target/release/tally-bench --brokers "127.0.0.1:$kafka_port" \
  --redis-url "redis://127.0.0.1:$redis_port" --out "$out" "$@"
