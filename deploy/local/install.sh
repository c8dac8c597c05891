#!/usr/bin/env bash
# Installs what the local services and the build need, skipping whatever is already there:
# redis-server, kcat, Prometheus (promtool, for the monitoring tests), OpenSSL headers, a JRE +
# Maven, Python, curl, PostgreSQL (the store's tests) and Chromium with chromedriver (the
# console's browser test) from Debian's packages, and Apache Kafka's jars from Maven Central.
# Safe to run any number of times.
set -euo pipefail
source "$(dirname "$0")/common.sh"

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)
command -v kcat >/dev/null || missing+=(kcat)
command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || missing+=(maven)
command -v cc >/dev/null || missing+=(build-essential)
command -v perl >/dev/null || missing+=(perl)
command -v promtool >/dev/null || missing+=(prometheus)
command -v pkg-config >/dev/null || missing+=(pkg-config)
dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
command -v python3 >/dev/null || missing+=(python3)
command -v curl >/dev/null || missing+=(curl)
# The PostgreSQL store's tests start private servers from Debian's binaries.
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || missing+=(postgresql)
# The console's browser test: Debian's Chromium and its WebDriver.
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
if ((${#missing[@]})); then
  log "installing ${missing[*]} from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The jars of release $kafka_version; .complete names the release they are of, .classes lists
# the classes of Kafka's own jars (for kafka_tool).
if [[ $(cat "$libs/.complete" 2>/dev/null) != "$kafka_version" ]]; then
  log "resolving Apache Kafka $kafka_version's jars from Maven Central into $libs"
  rm -rf "$libs"
  mkdir -p "$libs"
  mvn -q -B -f "$root/deploy/kafka/pom.xml" dependency:copy-dependencies \
    -Dkafka.version="$kafka_version" -DincludeScope=runtime -DoutputDirectory="$libs"
  python3 -c 'import sys, zipfile
for jar in sys.argv[1:]:
    print("\n".join(n for n in zipfile.ZipFile(jar).namelist() if n.endswith(".class")))' \
    "$libs"/kafka*.jar >"$libs/.classes"
  echo "$kafka_version" >"$libs/.complete"
fi
