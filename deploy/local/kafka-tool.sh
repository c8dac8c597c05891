#!/usr/bin/env bash
# Runs one of the local Kafka release's command-line tools by class name, wherever that release
# keeps it, on its jars: `deploy/local/kafka-tool.sh ConfigCommand --bootstrap-server ... --alter`.
set -euo pipefail
source "$(dirname "$0")/common.sh"
kafka_tool "$@"
