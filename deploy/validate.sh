#!/usr/bin/env bash
# Validates the deployment files without a Docker engine or a Kubernetes cluster:
#   - deploy/docker/docker-compose.yml with compose-go (the loader `docker compose` uses: the
#     Compose specification's JSON schema, then resolution);
#   - deploy/k8s/*.yaml by strict decoding into the Kubernetes API types;
#   - deploy/systemd/*.service with `systemd-analyze verify` (any warning fails);
#   - deploy/prometheus: `promtool check rules`, `promtool test rules`, `promtool check config`;
#   - deploy/grafana: every JSON file parses.
# The validator (deploy/validate/, Go) is built with the machine's Go toolchain; its modules come
# from the Go module proxy. deploy/local/test.sh runs this.
set -euo pipefail
source "$(dirname "$0")/local/common.sh"
cd "$root"
mkdir -p "$state"
# Go may live in /usr/local/go/bin, which a non-login shell (CI) may not have on its PATH.
if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:$PATH"
fi

log "building the validator (deploy/validate)"
(cd deploy/validate && go build -o "$state/tally-validate" .)

log "docker compose file"
"$state/tally-validate" compose deploy/docker/docker-compose.yml

log "Kubernetes manifests"
"$state/tally-validate" k8s deploy/k8s/*.yaml

log "systemd unit"
# verify checks that ExecStart's binary exists: point it at one that does, on a copy.
unit_dir=$(mktemp -d)
trap 'rm -rf "$unit_dir"' EXIT
for unit in deploy/systemd/*.service; do
  sed 's|^ExecStart=/usr/local/bin/tally-aggregator|ExecStart=/bin/true|' "$unit" >"$unit_dir/$(basename "$unit")"
  out=$(systemd-analyze verify "$unit_dir/$(basename "$unit")" 2>&1) || { echo "$out" >&2; exit 1; }
  if [[ -n $out ]]; then
    echo "$out" >&2
    log "systemd-analyze verify warned about $unit"
    exit 1
  fi
  echo "$unit: systemd-analyze verify found nothing to report"
done

log "Prometheus rules and configuration"
(cd deploy/prometheus && promtool check rules alerts.yml && promtool test rules alerts.test.yml)
sed "s|/etc/prometheus/alerts.yml|$root/deploy/prometheus/alerts.yml|" \
  deploy/prometheus/prometheus.compose.yml >"$unit_dir/prometheus.yml"
promtool check config "$unit_dir/prometheus.yml"

log "Grafana JSON"
for f in deploy/grafana/dashboards/*.json; do
  python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1] + ": " + str(len(d["panels"])) + " panels")' "$f"
done
log "every deployment file is valid"
