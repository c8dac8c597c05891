#!/usr/bin/env bash
# Stops the services that start.sh started. Safe to run when they are not running.
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [[ -f $state/kafka.pid ]]; then
  pid=$(cat "$state/kafka.pid")
  if kill "$pid" 2>/dev/null; then
    log "stopping Kafka (pid $pid)"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$state/kafka.pid"
fi
if [[ -f $state/redis.pid ]]; then
  log "stopping redis-server"
  redis-cli -p "$redis_port" shutdown nosave >/dev/null 2>&1 || true
  rm -f "$state/redis.pid"
fi
if [[ -f $state/postgres/data/postmaster.pid ]]; then
  log "stopping PostgreSQL"
  as_postgres "$(postgres_bin)/pg_ctl" -D "$state/postgres/data" -m fast -w stop >/dev/null 2>&1 || true
fi
