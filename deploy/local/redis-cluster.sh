#!/usr/bin/env bash
# A 3-master Redis Cluster on loopback (no replicas), AOF on, for trying tally against
# `redis+cluster://` by hand; the cluster tests start their own the same way (tests/src/lib.rs).
#
#   deploy/local/redis-cluster.sh start   # start three nodes, create the cluster, wait for every slot
#   deploy/local/redis-cluster.sh url     # print the URL tally takes (redis+cluster://...)
#   deploy/local/redis-cluster.sh stop    # stop the nodes and delete their data
#
# Ports: TALLY_REDIS_CLUSTER_PORTS (default 17001,17002,17003); state in TALLY_REDIS_CLUSTER_DIR
# (default .local/redis-cluster).
set -euo pipefail
source "$(dirname "$0")/common.sh"

dir=${TALLY_REDIS_CLUSTER_DIR:-$state/redis-cluster}
IFS=, read -r -a ports <<<"${TALLY_REDIS_CLUSTER_PORTS:-17001,17002,17003}"

cluster_ok() { redis-cli -p "${ports[0]}" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }

case ${1:-} in
  start)
    "$here/install.sh"
    for port in "${ports[@]}"; do
      if redis-cli -p "$port" ping >/dev/null 2>&1; then
        log "node $port already answers"
        continue
      fi
      mkdir -p "$dir/$port"
      redis-server --port "$port" --bind 127.0.0.1 --cluster-enabled yes --cluster-node-timeout 2000 \
        --cluster-config-file "$dir/$port/nodes.conf" --save "" --appendonly yes --appendfsync everysec \
        --dir "$dir/$port" --daemonize yes --pidfile "$dir/$port/redis.pid" --logfile "$dir/$port/redis.log"
      wait_for 30 "redis node $port" redis-cli -p "$port" ping
    done
    if ! cluster_ok; then
      nodes=()
      for port in "${ports[@]}"; do nodes+=("127.0.0.1:$port"); done
      redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >/dev/null
      wait_for 30 "the cluster to serve every slot" cluster_ok
    fi
    log "ready: $("$0" url)"
    ;;
  url)
    echo "redis+cluster://127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}"
    ;;
  stop)
    for port in "${ports[@]}"; do
      redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
    done
    rm -rf "$dir"
    ;;
  *)
    sed -n '2,10p' "$0" >&2
    exit 2
    ;;
esac
