#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs and starts Kafka and Redis (start.sh),
# checks formatting and lints, validates the deployment files (deploy/validate.sh), builds the
# binaries the end-to-end tests run, and runs every test.
# Services are left running for the next run; deploy/local/stop.sh stops them.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$root"

# A full build and test run writes about 5 GiB under target/ (debug builds, ~40 test binaries);
# a disk that fills mid-link makes the linker die of SIGBUS, far from the cause. Say so up front.
need_kib=$((6 * 1024 * 1024))
free_kib=$(df -Pk "$root" | awk 'NR == 2 { print $4 }')
if ((free_kib < need_kib)); then
  log "only $((free_kib / 1024)) MiB free on the disk holding $root: the build and tests need about 6 GiB"
  exit 1
fi

"$here/start.sh"

log "cargo fmt --check"
cargo fmt --all -- --check
if ! cargo clippy --version >/dev/null 2>&1; then
  log "clippy is not installed with this toolchain: adding it (rustup component add clippy)"
  rustup component add clippy || {
    log "clippy is required (the lint step is part of the test run) and could not be installed"
    exit 1
  }
fi
log "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

log "validating the deployment files (deploy/validate.sh)"
"$root/deploy/validate.sh"

# With the tests in the same build, the binaries get the features the test build resolves
# (dev-dependencies turn on more of regex's and zerocopy's): built alone, they would be built
# once that way and again, with everything above them, by `cargo test`.
log "building the binaries the end-to-end tests run, and the tests"
cargo build --workspace --bins --tests --locked

log "running the tests against Kafka 127.0.0.1:$kafka_port"
out=$state/test-output.txt
status=0
TALLY_TEST_BROKERS="127.0.0.1:$kafka_port" cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$out" || status=$?
# One closing line for the whole suite (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "%d passed, %d failed\n", p, f }' "$out"
exit "$status"
