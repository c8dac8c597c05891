#!/usr/bin/env bash
# Starts, on loopback, a real single-node Apache Kafka (KRaft; 4.1.1, or the release
# TALLY_KAFKA_VERSION names, 3.3 or later), a redis-server and a private
# PostgreSQL server (for --store postgres: postgres://tally@127.0.0.1:5433/postgres), waits until
# they answer, and creates the events topic and the dead-letter topic. Installs what is missing
# first.
# Idempotent: services already answering are left alone, existing topics are kept.
set -euo pipefail
source "$(dirname "$0")/common.sh"
"$here/install.sh"
mkdir -p "$state"

if redis-cli -p "$redis_port" ping >/dev/null 2>&1; then
  log "redis-server already answers on 127.0.0.1:$redis_port"
else
  log "starting redis-server on 127.0.0.1:$redis_port"
  redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
    --daemonize yes --pidfile "$state/redis.pid" --logfile "$state/redis.log" --dir "$state"
  wait_for 30 "redis-server" redis-cli -p "$redis_port" ping
fi

if port_open "$postgres_port"; then
  log "PostgreSQL already answers on 127.0.0.1:$postgres_port"
else
  pg=$state/postgres
  if [[ ! -f $pg/data/PG_VERSION ]]; then
    log "creating a PostgreSQL cluster in $pg/data"
    rm -rf "$pg" && mkdir -p "$pg"
    [[ $(id -u) == 0 ]] && chown postgres:postgres "$pg"
    as_postgres "$(postgres_bin)/initdb" -A trust -U tally -E UTF8 -D "$pg/data" >"$pg/initdb.log"
  fi
  log "starting PostgreSQL on 127.0.0.1:$postgres_port (log: $pg/postgres.log)"
  as_postgres "$(postgres_bin)/pg_ctl" -D "$pg/data" -l "$pg/postgres.log" -w start \
    -o "-p $postgres_port -k $pg -c listen_addresses=127.0.0.1 -c shared_preload_libraries=pg_stat_statements" >/dev/null
fi

if port_open "$kafka_port"; then
  log "Kafka already answers on 127.0.0.1:$kafka_port"
else
  data=$state/kafka-data
  props=$state/server.properties
  cat >"$props" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$controller_port
listeners=PLAINTEXT://127.0.0.1:$kafka_port,CONTROLLER://127.0.0.1:$controller_port
advertised.listeners=PLAINTEXT://127.0.0.1:$kafka_port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$data
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
group.consumer.session.timeout.ms=10000
group.consumer.min.session.timeout.ms=6000
group.consumer.heartbeat.interval.ms=1000
group.consumer.min.heartbeat.interval.ms=1000
auto.create.topics.enable=false
log.retention.hours=168
PROPS
  # A log formatted by one release may not start under another (an older one refuses a newer
  # metadata version): say so rather than let the broker fail.
  formatted_by=$(cat "$data.version" 2>/dev/null || echo 4.1.1)
  if [[ -f $data/meta.properties && $formatted_by != "$kafka_version" ]]; then
    log "$data was formatted by Kafka $formatted_by, not $kafka_version: remove it, or choose another TALLY_LOCAL_DIR"
    exit 1
  fi
  if [[ ! -f $data/meta.properties ]]; then
    log "formatting Kafka $kafka_version's storage in $data"
    cluster_id=$(kafka_java kafka.tools.StorageTool random-uuid)
    kafka_java kafka.tools.StorageTool format -t "$cluster_id" -c "$props" >/dev/null
    echo "$kafka_version" >"$data.version"
  fi
  log "starting Kafka $kafka_version on 127.0.0.1:$kafka_port (log: $state/kafka.log)"
  nohup java -Xms256m -Xmx768m -XX:+UseG1GC \
    "${kafka_logging[@]}" -Dkafka.logs.dir="$state" \
    -cp "$libs/*" kafka.Kafka "$props" >"$state/kafka.log" 2>&1 &
  echo $! >"$state/kafka.pid"
  wait_for 120 "Kafka on port $kafka_port" port_open "$kafka_port" || { tail -20 "$state/kafka.log" >&2; exit 1; }
fi

# The broker accepts connections a little before it accepts admin requests: retry until it does.
wait_for 120 "topic $topic" create_topic "$topic" "$partitions"
wait_for 60 "topic $dlq_topic" create_topic "$dlq_topic" 1
log "ready: Kafka 127.0.0.1:$kafka_port (topics $topic x$partitions, $dlq_topic), Redis 127.0.0.1:$redis_port, PostgreSQL $postgres_url"
