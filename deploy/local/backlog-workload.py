#!/usr/bin/env python3
# Issue 43's windowed backlog, for a producer that is not tally's: 2,000,000 JSON events with no
# message key, Zipf (1.1) over 100,000 counters, event times spread evenly over the 3 hours before
# now (a backlog after an outage). Write it, then compare a namespace without windows against one
# with ["1m", "1h", "1d"]:
#   deploy/local/backlog-workload.py events.jsonl
#   source deploy/local/common.sh; create_topic win-backlog 8
#   kcat -P -b 127.0.0.1:9092 -t win-backlog -l events.jsonl
#   AB_OLD_FLAGS="--namespaces plain.toml" AB_NEW_FLAGS="--namespaces win3.toml" \
#     deploy/local/ab.sh BIN BIN win-backlog 2000000 5
# Run it shortly before the catch-ups: the event times are relative to when it ran.
import bisect, itertools, random, sys, time

random.seed(7)
N, C = 2_000_000, 100_000
w = [1 / (k ** 1.1) for k in range(1, C + 1)]
cum = list(itertools.accumulate(w))
tot = cum[-1]
now = int(time.time() * 1000)
with open(sys.argv[1], 'w') as out:
    for _ in range(N):
        c = bisect.bisect_left(cum, random.random() * tot)
        ts = now - random.randrange(3 * 3600 * 1000)
        out.write(f'{{"counter":"likes:post:{c}","delta":1,"ts_ms":{ts}}}\n')
