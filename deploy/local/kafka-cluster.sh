#!/usr/bin/env bash
# A 3-broker Apache Kafka cluster (4.1.1, or TALLY_KAFKA_VERSION) in KRaft mode on loopback, beside the single node of
# start.sh: three combined broker+controller nodes (a 3-voter quorum), replication factor 3 and
# min.insync.replicas=2 by default, so one node can be down without losing an acknowledged write.
#
#   deploy/local/kafka-cluster.sh start            # format (first time) and start all three
#   deploy/local/kafka-cluster.sh topic NAME N     # create a topic (N partitions, RF 3, min ISR 2)
#   deploy/local/kafka-cluster.sh kill I           # SIGKILL node I (1-3): a crash
#   deploy/local/kafka-cluster.sh start-node I     # start node I again from its data
#   deploy/local/kafka-cluster.sh stop-node I      # SIGTERM node I (a controlled shutdown) and wait
#   deploy/local/kafka-cluster.sh elect-unclean T P  # elect a leader for partition P of topic T out of sync
#   deploy/local/kafka-cluster.sh restart-node I   # SIGTERM node I, wait, start it, wait until it is back in sync
#   deploy/local/kafka-cluster.sh wait-in-sync     # wait until no partition is under-replicated
#   deploy/local/kafka-cluster.sh bootstrap        # print the bootstrap servers
#   deploy/local/kafka-cluster.sh stop             # stop all three
#
# Ports: TALLY_CLUSTER_BROKER_PORTS (default 19192,19193,19194) and
# TALLY_CLUSTER_CONTROLLER_PORTS (default 19292,19293,19294); state in TALLY_CLUSTER_DIR
# (default .local/kafka-cluster). Installs what is missing first.
set -euo pipefail
source "$(dirname "$0")/common.sh"

cluster_dir=${TALLY_CLUSTER_DIR:-$state/kafka-cluster}
IFS=, read -r -a broker_ports <<<"${TALLY_CLUSTER_BROKER_PORTS:-19192,19193,19194}"
IFS=, read -r -a controller_ports <<<"${TALLY_CLUSTER_CONTROLLER_PORTS:-19292,19293,19294}"
bootstrap="127.0.0.1:${broker_ports[0]},127.0.0.1:${broker_ports[1]},127.0.0.1:${broker_ports[2]}"
voters="1@127.0.0.1:${controller_ports[0]},2@127.0.0.1:${controller_ports[1]},3@127.0.0.1:${controller_ports[2]}"

node_dir() { echo "$cluster_dir/node$1"; }
pid_of() { cat "$(node_dir "$1")/kafka.pid" 2>/dev/null || true; }
running() { local pid; pid=$(pid_of "$1"); [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; }

check_node() {
  [[ $1 =~ ^[123]$ ]] || { log "node must be 1, 2 or 3, not '$1'"; exit 2; }
}

write_props() {
  local i=$1 dir port cport
  dir=$(node_dir "$i")
  port=${broker_ports[$((i - 1))]}
  cport=${controller_ports[$((i - 1))]}
  mkdir -p "$dir"
  cat >"$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=$i
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$dir/data
num.partitions=1
default.replication.factor=3
min.insync.replicas=2
offsets.topic.replication.factor=3
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
unclean.leader.election.enable=false
# A broker SIGKILLed is fenced after 4 s without a heartbeat (9 s by default), and a controlled
# shutdown, paced by heartbeats, ends sooner: the faults below take less waiting.
broker.heartbeat.interval.ms=500
broker.session.timeout.ms=4000
group.initial.rebalance.delay.ms=0
group.consumer.session.timeout.ms=10000
group.consumer.min.session.timeout.ms=6000
group.consumer.heartbeat.interval.ms=1000
group.consumer.min.heartbeat.interval.ms=1000
auto.create.topics.enable=false
log.retention.hours=168
PROPS
}

format_all() {
  if [[ -f $cluster_dir/cluster.id ]]; then
    local formatted_by
    formatted_by=$(cat "$cluster_dir/kafka-version" 2>/dev/null || echo 4.1.1)
    [[ $formatted_by == "$kafka_version" ]] && return
    log "$cluster_dir was formatted by Kafka $formatted_by, not $kafka_version: stop the cluster and remove it"
    exit 1
  fi
  mkdir -p "$cluster_dir"
  local id
  # A cluster id as StorageTool's random-uuid makes one (16 random bytes, URL-safe base64, not
  # starting with '-'), without a JVM start.
  id=-
  while [[ $id == -* ]]; do
    id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')
  done
  # The three formats run at once: each is a JVM start of a second or two.
  local pids=()
  for i in 1 2 3; do
    write_props "$i"
    kafka_java kafka.tools.StorageTool format -t "$id" -c "$(node_dir "$i")/server.properties" >/dev/null &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  echo "$id" >"$cluster_dir/cluster.id"
  echo "$kafka_version" >"$cluster_dir/kafka-version"
  log "formatted a 3-node KRaft cluster ($id) in $cluster_dir"
}

start_node() {
  local i=$1 dir
  dir=$(node_dir "$i")
  if running "$i"; then
    log "node $i already runs (pid $(pid_of "$i"))"
    return
  fi
  write_props "$i"
  log "starting node $i on 127.0.0.1:${broker_ports[$((i - 1))]}"
  nohup java -Xms128m -Xmx512m -XX:+UseG1GC \
    "${kafka_logging[@]}" -Dkafka.logs.dir="$dir" \
    -cp "$libs/*" kafka.Kafka "$dir/server.properties" >>"$dir/kafka.log" 2>&1 &
  echo $! >"$dir/kafka.pid"
}

wait_node() {
  local i=$1
  wait_for 120 "node $i on port ${broker_ports[$((i - 1))]}" port_open "${broker_ports[$((i - 1))]}" ||
    { tail -20 "$(node_dir "$i")/kafka.log" >&2; exit 1; }
}

# stop_nodes I...: SIGTERM the nodes together, wait up to 60 s for them to exit, SIGKILL the
# rest. Together, not one after another: a node stopped after the other two has no quorum left
# to confirm its controlled shutdown, and waited out the whole minute.
stop_nodes() {
  local i pid pids=()
  for i in "$@"; do
    pid=$(pid_of "$i")
    if [[ -n $pid ]] && kill "$pid" 2>/dev/null; then
      log "stopping node $i (pid $pid)"
      pids+=("$pid")
    fi
    rm -f "$(node_dir "$i")/kafka.pid"
  done
  for _ in $(seq 1 120); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    sleep 0.5
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

topics() { kafka_tool TopicCommand --bootstrap-server "$bootstrap" "$@"; }

# The cluster's metadata as a broker answers it, through kcat: the polls below run every half
# second, and a JVM tool (TopicCommand) took 3-5 s to start on two busy cores.
metadata() { kcat -L -b "$bootstrap" -m 5 2>/dev/null; }
brokers_in() { grep -c '^  broker ' <<<"$1" || true; }
# Succeeds when all three brokers are registered.
registered() { [[ $(brokers_in "$(metadata)") -eq 3 ]]; }
# Succeeds when every broker is registered and no partition is under-replicated: each has a
# leader and as many in-sync replicas as replicas (TopicCommand's --under-replicated-partitions).
# A line reads `partition 0, leader 1, replicas: 1,2,3, isrs: 1,3`.
in_sync() {
  local out
  out=$(metadata) || return 1
  [[ $(brokers_in "$out") -eq 3 ]] || return 1
  awk '$1 == "partition" {
         r = $6; i = $8; sub(/,$/, "", r); sub(/,$/, "", i)
         if ($4 == "-1," || split(r, a, ",") != split(i, b, ",")) bad = 1
       }
       END { exit bad }' <<<"$out"
}

create() {
  topics --create --if-not-exists --topic "$1" --partitions "$2" --replication-factor 3 \
    --config min.insync.replicas=2
}

"$here/install.sh"
case ${1:-} in
  start)
    format_all
    for i in 1 2 3; do start_node "$i"; done
    for i in 1 2 3; do wait_node "$i"; done
    # A topic with replication factor 3 can only be created once all three brokers registered.
    wait_for 120 "all three brokers to register" registered
    log "ready: 3-broker cluster at $bootstrap"
    ;;
  topic)
    wait_for 60 "topic $2" create "$2" "$3"
    ;;
  kill)
    check_node "$2"
    pid=$(pid_of "$2")
    [[ -n $pid ]] || { log "node $2 is not running"; exit 1; }
    log "SIGKILL node $2 (pid $pid)"
    kill -9 "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    rm -f "$(node_dir "$2")/kafka.pid"
    ;;
  start-node)
    check_node "$2"
    start_node "$2"
    wait_node "$2"
    ;;
  stop-node)
    check_node "$2"
    stop_nodes "$2"
    ;;
  elect-unclean)
    kafka_tool LeaderElectionCommand --bootstrap-server "$bootstrap" \
      --election-type UNCLEAN --topic "$2" --partition "$3"
    ;;
  restart-node)
    check_node "$2"
    stop_nodes "$2"
    start_node "$2"
    wait_node "$2"
    wait_for 180 "every partition back in sync" in_sync
    ;;
  wait-in-sync)
    wait_for 180 "every partition back in sync" in_sync
    ;;
  bootstrap)
    echo "$bootstrap"
    ;;
  stop)
    stop_nodes 1 2 3
    ;;
  *)
    sed -n '2,18p' "$0" >&2
    exit 2
    ;;
esac
