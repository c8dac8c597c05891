# Shared settings for the deploy/local scripts; sourced, not run.
# Every path and port can be moved with an environment variable, so that two checkouts can coexist.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
state=${TALLY_LOCAL_DIR:-$root/.local}
kafka_port=${TALLY_KAFKA_PORT:-9092}
controller_port=${TALLY_KAFKA_CONTROLLER_PORT:-9093}
redis_port=${TALLY_REDIS_PORT:-6379}
postgres_port=${TALLY_POSTGRES_PORT:-5433}
topic=${TALLY_TOPIC:-tally.events}
dlq_topic=${TALLY_DEAD_LETTER_TOPIC:-tally.events.dlq}
partitions=${TALLY_PARTITIONS:-8}
libs=$state/kafka-libs
# The Apache Kafka release the local brokers run (deploy/local/compat.sh runs the end-to-end
# tests on several). Releases from 3.3 (KRaft without ZooKeeper) on start with these scripts.
kafka_version=${TALLY_KAFKA_VERSION:-4.1.1}

log() { printf '[tally-local %ss] %s\n' "$SECONDS" "$*" >&2; }

# port_open PORT: true when something accepts TCP connections on 127.0.0.1:PORT.
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# wait_for TIMEOUT_S DESCRIPTION COMMAND...: polls COMMAND until it succeeds, or fails loudly.
wait_for() {
  local timeout=$1 what=$2; shift 2
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "gave up after ${timeout}s waiting for $what"
      return 1
    fi
    sleep 0.5
  done
}

# Quiet broker and tool logs, for log4j 2 (Kafka 4) and log4j 1 (Kafka 3, through reload4j).
kafka_logging=(-Dlog4j2.configurationFile="$root/deploy/kafka/log4j2.properties"
  -Dlog4j.configuration="file:$root/deploy/kafka/log4j.properties")

kafka_java() {
  java -Xms128m -Xmx512m "${kafka_logging[@]}" -cp "$libs/*" "$@"
}

# kafka_tool NAME ARGS...: runs one of Kafka's command-line tools (TopicCommand, ConfigCommand,
# ...) from the package this release keeps it in: the tools moved from kafka.admin to
# org.apache.kafka.tools between 3.3 and 4.4, one by one.
kafka_tool() {
  local name=$1 class
  shift
  class=$(grep -m1 -E "^(org/apache/kafka/tools|kafka/admin)/$name\.class$" "$libs/.classes") ||
    { log "Kafka $kafka_version has no tool named $name"; return 2; }
  class=${class%.class}
  kafka_java "${class//\//.}" "$@"
}

# create_topic NAME PARTITIONS: creates a topic unless it exists.
create_topic() {
  kafka_tool TopicCommand --bootstrap-server "127.0.0.1:$kafka_port" \
    --create --if-not-exists --topic "$1" --partitions "$2" --replication-factor 1
}

# cargo may live in ~/.cargo/bin, which a non-login shell (CI) may not have on its PATH.
if ! command -v cargo >/dev/null 2>&1 && [[ -x $HOME/.cargo/bin/cargo ]]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi

# The newest PostgreSQL server binaries Debian installed (/usr/lib/postgresql/<version>/bin).
postgres_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }

# as_postgres CMD...: runs CMD as the postgres user when we are root (PostgreSQL refuses root).
as_postgres() {
  if [[ $(id -u) == 0 ]]; then
    setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"
  else
    "$@"
  fi
}

# The local PostgreSQL's URL (trust authentication on loopback, user tally).
postgres_url="postgres://tally@127.0.0.1:$postgres_port/postgres"

# wait_flushed PORT N PID LOG: waits until the aggregator PID, serving its metrics on PORT, has
# flushed N events (tally_events_flushed_total); fails, naming its LOG, if it exits first.
wait_flushed() {
  local port=$1 events=$2 pid=$3 log_file=$4 v
  while :; do
    v=$(curl -s "127.0.0.1:$port/metrics" | awk '/^tally_events_flushed_total/ { print $2 }') || true
    [[ -n $v && ${v%.*} -ge $events ]] && return 0
    kill -0 "$pid" 2>/dev/null || { log "the aggregator exited; see $log_file"; return 1; }
    sleep 0.02
  done
}
