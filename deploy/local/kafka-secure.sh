#!/usr/bin/env bash
# A single-node Apache Kafka 4.x (KRaft) on loopback whose client listener requires TLS and SASL,
# as a production cluster would: SASL_SSL with SCRAM-SHA-512 and PLAIN, a certificate signed by
# a throw-away CA made here with openssl. A PLAINTEXT listener for administration stays on a
# second loopback port.
#
#   deploy/local/kafka-secure.sh start    # make the CA and certificate, format, start, wait
#   deploy/local/kafka-secure.sh stop
#
# Settings (environment): TALLY_SECURE_DIR (state; default .local/kafka-secure),
# TALLY_SECURE_PORT (SASL_SSL, 19392), TALLY_SECURE_ADMIN_PORT (PLAINTEXT, 19393),
# TALLY_SECURE_CONTROLLER_PORT (19394), TALLY_SECURE_SCRAM_USER / _PASSWORD (tally /
# tally-scram-secret), TALLY_SECURE_PLAIN_USER / _PASSWORD (tally-plain / tally-plain-secret).
# The CA certificate clients must trust is $TALLY_SECURE_DIR/ca.pem.
set -euo pipefail
source "$(dirname "$0")/common.sh"

dir=${TALLY_SECURE_DIR:-$state/kafka-secure}
port=${TALLY_SECURE_PORT:-19392}
admin_port=${TALLY_SECURE_ADMIN_PORT:-19393}
cport=${TALLY_SECURE_CONTROLLER_PORT:-19394}
scram_user=${TALLY_SECURE_SCRAM_USER:-tally}
scram_password=${TALLY_SECURE_SCRAM_PASSWORD:-tally-scram-secret}
plain_user=${TALLY_SECURE_PLAIN_USER:-tally-plain}
plain_password=${TALLY_SECURE_PLAIN_PASSWORD:-tally-plain-secret}

make_certificates() {
  [[ -f $dir/server.pem ]] && return
  log "making a CA and a server certificate for 127.0.0.1 in $dir"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$dir/ca.key" -out "$dir/ca.pem" -days 30 \
    -subj "/CN=tally local test CA" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -keyout "$dir/server.key" -out "$dir/server.csr" \
    -subj "/CN=localhost" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >"$dir/san.cnf"
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -out "$dir/server.crt" -days 30 -extfile "$dir/san.cnf" 2>/dev/null
  # Kafka's PEM keystore: the unencrypted PKCS#8 key, then the certificate chain.
  openssl pkcs8 -topk8 -nocrypt -in "$dir/server.key" -out "$dir/server.pk8"
  cat "$dir/server.pk8" "$dir/server.crt" "$dir/ca.pem" >"$dir/server.pem"
  chmod 600 "$dir"/*.key "$dir"/*.pk8 "$dir/server.pem"
}

write_props() {
  cat >"$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=SASL_SSL://127.0.0.1:$port,ADMIN://127.0.0.1:$admin_port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=SASL_SSL://127.0.0.1:$port,ADMIN://127.0.0.1:$admin_port
controller.listener.names=CONTROLLER
inter.broker.listener.name=ADMIN
listener.security.protocol.map=SASL_SSL:SASL_SSL,ADMIN:PLAINTEXT,CONTROLLER:PLAINTEXT
sasl.enabled.mechanisms=SCRAM-SHA-512,PLAIN
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$plain_user="$plain_password";
ssl.keystore.type=PEM
ssl.keystore.location=$dir/server.pem
ssl.client.auth=none
log.dirs=$dir/data
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
PROPS
  chmod 600 "$dir/server.properties"
}

"$here/install.sh"
case ${1:-} in
  start)
    mkdir -p "$dir"
    if [[ -f $dir/kafka.pid ]] && kill -0 "$(cat "$dir/kafka.pid")" 2>/dev/null; then
      log "the secure broker already runs"
      exit 0
    fi
    make_certificates
    write_props
    if [[ ! -f $dir/data/meta.properties ]]; then
      kafka_java kafka.tools.StorageTool format -t "$(kafka_java kafka.tools.StorageTool random-uuid)" \
        -c "$dir/server.properties" \
        --add-scram "SCRAM-SHA-512=[name=$scram_user,password=$scram_password]" >/dev/null
    fi
    log "starting the secure broker: SASL_SSL 127.0.0.1:$port, admin PLAINTEXT 127.0.0.1:$admin_port"
    nohup java -Xms128m -Xmx512m -XX:+UseG1GC \
      "${kafka_logging[@]}" -Dkafka.logs.dir="$dir" \
      -cp "$libs/*" kafka.Kafka "$dir/server.properties" >>"$dir/kafka.log" 2>&1 &
    echo $! >"$dir/kafka.pid"
    wait_for 120 "the secure broker on $port" port_open "$port" || { tail -20 "$dir/kafka.log" >&2; exit 1; }
    wait_for 60 "the secure broker's admin listener" kafka_tool TopicCommand \
      --bootstrap-server "127.0.0.1:$admin_port" --list
    log "ready: SASL_SSL 127.0.0.1:$port (CA $dir/ca.pem)"
    ;;
  stop)
    if [[ -f $dir/kafka.pid ]]; then
      pid=$(cat "$dir/kafka.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$dir/kafka.pid"
    fi
    ;;
  *)
    sed -n '2,15p' "$0" >&2
    exit 2
    ;;
esac
