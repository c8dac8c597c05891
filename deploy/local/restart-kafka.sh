#!/usr/bin/env bash
# Restarts the local Kafka broker that start.sh started (SIGTERM, wait for it to exit, start it
# again from the same data directory). Used by the broker-restart fault test; fails if start.sh
# did not start the broker.
set -euo pipefail
source "$(dirname "$0")/common.sh"
if [[ ! -f $state/kafka.pid ]]; then
  log "no Kafka started by start.sh in $state: cannot restart it"
  exit 1
fi
pid=$(cat "$state/kafka.pid")
log "stopping Kafka (pid $pid)"
kill "$pid" 2>/dev/null || true
for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
kill -9 "$pid" 2>/dev/null || true
rm -f "$state/kafka.pid"
"$here/start.sh"
