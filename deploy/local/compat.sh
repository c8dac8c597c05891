#!/usr/bin/env bash
# The broker compatibility matrix: the end-to-end tests that lean hardest on the broker, run
# against several Apache Kafka releases one after another, ending in a results table.
#
#   deploy/local/compat.sh [RELEASE...]     # default: 3.3.2 3.9.1 4.1.1 4.4.0
#
# Per release: tally's own fetcher against what independent producers write (fetch_paths.rs),
# the 3-broker cluster's faults and group protocols (kafka_cluster.rs), exactly-once through a
# crash between flush and commit and through a broker restart (fault_crash_before_commit.rs,
# fault_kafka_restart.rs), exact totals from the producer crate (stream_totals.rs, producer.rs);
# then the broker's answers are captured as tally-kafka's fixtures
# (kafka/tests/fixtures/capture.sh). Each release runs from its own state directory,
# .local/compat/RELEASE, on the usual ports, so the default local stack (start.sh) is stopped
# first; start it again with deploy/local/start.sh. About 4 minutes per release on two cores.
# The table goes to stdout and to .local/compat/results.md; the exit status is 1 if any test
# failed.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$root"

releases=("$@")
((${#releases[@]})) || releases=(3.3.2 3.9.1 4.1.1 4.4.0)
tests=(fetch_paths kafka_cluster fault_crash_before_commit fault_kafka_restart stream_totals producer)
results=$state/compat/results.md
mkdir -p "$state/compat"

log "stopping the default local stack: each release runs its own on the same ports"
"$here/stop.sh"
if port_open "$kafka_port"; then
  log "something else still answers on 127.0.0.1:$kafka_port: stop it first"
  exit 1
fi
"$here/install.sh"
log "building the binaries and tests"
cargo build --workspace --bins --locked
# The test executables, run directly below: cargo would rebuild them if the sources changed
# during the hour this may take.
declare -A executable
while read -r name path; do executable[$name]=$path; done < <(
  cargo test -p tally-tests --locked --no-run --message-format=json "${tests[@]/#/--test=}" |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')

rows=()
failed=0
for release in "${releases[@]}"; do
  export TALLY_KAFKA_VERSION=$release TALLY_LOCAL_DIR=$state/compat/$release
  log "Kafka $release (state in $TALLY_LOCAL_DIR)"
  if ! "$here/start.sh"; then
    rows+=("| $release | (all) | broker did not start | | |")
    failed=1
    continue
  fi
  for test in "${tests[@]}"; do
    out=$TALLY_LOCAL_DIR/$test.log
    started=$SECONDS
    status=ok
    (cd tests && TALLY_TEST_BROKERS="127.0.0.1:$kafka_port" "${executable[$test]}") >"$out" 2>&1 ||
      { status=FAILED; failed=1; }
    counts=$(awk '/^test result:/ { printf "%s passed, %s failed", $4, $6 }' "$out")
    rows+=("| $release | \`$test.rs\` | $status | ${counts:-no result (see $out)} | $((SECONDS - started)) s |")
    log "Kafka $release, $test: $status ($counts)"
  done
  "$here/../../kafka/tests/fixtures/capture.sh" || { rows+=("| $release | fixtures | FAILED | | |"); failed=1; }
  "$here/stop.sh"
done

{
  echo "Broker compatibility, $(date -u +%Y-%m-%d), commit $(git describe --always --dirty) (deploy/local/compat.sh)"
  echo
  echo "| Kafka | test file | result | tests | time |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$results"
exit "$failed"
