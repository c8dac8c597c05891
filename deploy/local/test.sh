#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs and starts Kafka and Redis (start.sh, in
# the background during the build), checks formatting, validates the deployment files
# (deploy/validate.sh), builds every target with clippy's lints as errors, and runs every test.
# Services are left running for the next run; deploy/local/stop.sh stops them.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$root"

# A full build and test run writes about 5 GiB under target/ (debug builds, ~40 test binaries);
# a disk that fills mid-link makes the linker die of SIGBUS, far from the cause. Say so up front.
need_kib=$((6 * 1024 * 1024))
target_dir=${CARGO_TARGET_DIR:-$root/target}
mkdir -p "$target_dir"
free_kib=$(df -Pk "$target_dir" | awk 'NR == 2 { print $4 }')
if ((free_kib < need_kib)); then
  log "only $((free_kib / 1024)) MiB free on the disk holding $target_dir: the build and tests need about 6 GiB"
  exit 1
fi

# What the build needs is installed first; the services (start.sh: Redis, PostgreSQL, Kafka's
# JVM) then start in the background while the build runs, and the tests wait for them.
"$here/install.sh"
mkdir -p "$state"
start_log=$state/start.log
log "starting the local stack in the background (deploy/local/start.sh, log: $start_log)"
"$here/start.sh" >"$start_log" 2>&1 &
start_pid=$!

log "cargo fmt --check"
cargo fmt --all -- --check
driver="$(rustc --print sysroot)/bin/clippy-driver"
if [[ ! -x $driver ]]; then
  log "clippy is not installed with this toolchain: adding it (rustup component add clippy)"
  rustup component add clippy || {
    log "clippy is required (the lint step is part of the test run) and could not be installed"
    exit 1
  }
fi

log "validating the deployment files (deploy/validate.sh)"
"$root/deploy/validate.sh"

# One build both lints and compiles: clippy's driver compiles the workspace's own crates (what
# `cargo clippy --workspace --all-targets -- -D warnings` does, with code generation too), so the
# dependencies are compiled once rather than checked for clippy and then built again (the build
# step took 327-361 s in two rehearsals, against 380 s for clippy and the build before). The tests then run under the same driver, so `cargo test`
# rebuilds nothing: a plain `cargo test` after this script recompiles the workspace's crates.
export RUSTC_WORKSPACE_WRAPPER=$driver
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
log "cargo clippy and the build of every target (binaries, tests, examples, benches)"
cargo build --workspace --all-targets --locked

log "waiting for the local stack (deploy/local/start.sh)"
if ! wait "$start_pid"; then
  cat "$start_log" >&2
  log "deploy/local/start.sh failed: no test can run"
  exit 1
fi
cat "$start_log" >&2

log "running the tests against Kafka 127.0.0.1:$kafka_port"
out=$state/test-output.txt
status=0
TALLY_TEST_BROKERS="127.0.0.1:$kafka_port" cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$out" || status=$?
# One closing line for the whole suite (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "%d passed, %d failed\n", p, f }' "$out"
exit "$status"
