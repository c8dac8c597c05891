#!/usr/bin/env bash
# Compares two tally-aggregator builds on one topic, alternating them (each round in the order
# opposite to the last), so that the machine's drift between runs (20-30% on this 2-core
# machine) falls on both alike. Each run starts the
# binary with a fresh consumer group and key prefix, times it from launch until
# tally_events_flushed_total reaches N (read from its /metrics), and reports events/s, the
# aggregator's CPU seconds per million events, its peak RSS and redis-server's CPU per event
# (INFO cpu before and after); its keys are deleted afterwards. At the end it prints each
# round's rate ratio (new over old) and their median,
# with the median's 95% confidence interval from the order statistics (nothing assumed of the
# noise's shape): on this 2-core machine one binary against itself gives pairs from 0.90 to
# 1.12, so judge by the median of many rounds, not by one.
#
#   deploy/local/ab.sh OLD_BINARY NEW_BINARY TOPIC N [ROUNDS]
#
# The topic must hold exactly N events (for example written by `tally load --events N` or by
# `kcat -P` from a file). Build the old binary from another checkout with its own
# CARGO_TARGET_DIR. AB_OLD_FLAGS and AB_NEW_FLAGS add flags to each side's command line, so one
# binary can be compared with itself under two settings, for example:
#
#   AB_NEW_FLAGS="--namespaces windows.toml" deploy/local/ab.sh BIN BIN TOPIC N
set -euo pipefail
source "$(dirname "$0")/common.sh"
die() { log "$*"; exit 1; }
[[ $# -ge 4 ]] || die "usage: $0 OLD_BINARY NEW_BINARY TOPIC N [ROUNDS]"
old=$1 new=$2 topic=$3 events=$4 rounds=${5:-3}
ticks=$(getconf CLK_TCK)

# redis-server's CPU seconds so far (user + system).
redis_cpu() {
  redis-cli -p "$redis_port" info cpu | awk -F: '/^used_cpu_(sys|user):/ { s += $2 } END { printf "%.4f", s }'
}

run() {
  local bin=$1 label=$2 flags=$3 port group start end v cpu pid rss redis_before redis_after
  port=$((19000 + RANDOM % 1000))
  group=ab-$RANDOM-$$
  redis_before=$(redis_cpu)
  start=$(date +%s.%N)
  "$bin" --brokers "127.0.0.1:$kafka_port" --redis-url "redis://127.0.0.1:$redis_port" \
    --topic "$topic" --group "$group" --key-prefix "$group" \
    --metrics-addr "127.0.0.1:$port" $flags >"$state/ab-$group.log" 2>&1 &
  pid=$!
  wait_flushed "$port" "$events" "$pid" "$state/ab-$group.log" || exit 1
  end=$(date +%s.%N)
  redis_after=$(redis_cpu)
  cpu=$(awk -v t="$ticks" '{ print ($14 + $15) / t }' "/proc/$pid/stat")
  rss=$(awk '/^VmHWM/ { print $2 }' "/proc/$pid/status")
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  redis-cli -p "$redis_port" --scan --pattern "$group*" | xargs -r -n 5000 redis-cli -p "$redis_port" unlink >/dev/null
  # UNLINK frees big sets in a background thread, whose CPU would land on the next run.
  until redis-cli -p "$redis_port" info memory | grep -q '^lazyfree_pending_objects:0'; do sleep 0.05; done
  rate=$(awk -v n="$events" -v s="$start" -v e="$end" 'BEGIN { printf "%.0f", n / (e - s) }')
  awk -v l="$label" -v r="$rate" -v c="$cpu" -v n="$events" -v m="$rss" \
    -v rc="$(awk -v a="$redis_before" -v b="$redis_after" 'BEGIN { print b - a }')" \
    'BEGIN { printf "%-4s %9.0f events/s  %.2f CPU s per M events  peak RSS %.0f MiB  redis-server %.2f CPU-us per event\n", l, r, c * 1e6 / n, m / 1024, rc * 1e6 / n }'
}

ratios=()
for ((i = 1; i <= rounds; i++)); do
  # Each round in the order opposite to the last (old, new, then new, old), so that whatever
  # the first run of a round leaves behind (the broker's page cache, Redis's allocator) falls
  # on both alike.
  if ((i % 2)); then
    run "$old" old "${AB_OLD_FLAGS:-}"
    old_rate=$rate
    run "$new" new "${AB_NEW_FLAGS:-}"
    new_rate=$rate
  else
    run "$new" new "${AB_NEW_FLAGS:-}"
    new_rate=$rate
    run "$old" old "${AB_OLD_FLAGS:-}"
    old_rate=$rate
  fi
  ratios+=("$(awk -v a="$new_rate" -v b="$old_rate" 'BEGIN { printf "%.3f", a / b }')")
done
printf '%s\n' "${ratios[@]}" | sort -n | awk -v listed="${ratios[*]}" '
  { r[NR] = $1 }
  END {
    n = NR
    median = n % 2 ? r[(n + 1) / 2] : (r[n / 2] + r[n / 2 + 1]) / 2
    # The widest k with P(Binomial(n, 1/2) < k) <= 2.5%: [r[k], r[n + 1 - k]] holds the median
    # with at least 95% confidence.
    k = 0; below = 0; term = 0.5 ^ n
    for (j = 0; j < n; j++) {
      if (below + term > 0.025) break
      below += term; k = j + 1; term = term * (n - j) / (j + 1)
    }
    printf "new/old per round: %s\n", listed
    printf "median %.2f, range %.2f-%.2f", median, r[1], r[n]
    if (k >= 1) printf ", 95%% CI of the median %.2f-%.2f", r[k], r[n + 1 - k]
    else printf " (too few rounds for a 95%% interval of the median)"
    printf "\n"
  }'
