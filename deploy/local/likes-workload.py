#!/usr/bin/env python3
# The likes workload of issue 42, for a producer that is not tally's:
# (create the topic first, e.g. 8 partitions: `source deploy/local/common.sh; create_topic likes-wl 8`)
#   deploy/local/likes-workload.py events.tsv expected.json
#   kcat -P -b 127.0.0.1:9092 -t likes-wl -K "$(printf '\t')" -l events.tsv
# then deploy/local/ab.sh BIN BIN likes-wl 1000000 5 with AB_OLD_FLAGS/AB_NEW_FLAGS naming
# namespace files without and with dedup = true. expected.json: each counter's likes standing.
import random, json, sys, bisect, itertools
random.seed(42)
N, C, U = 1_000_000, 100_000, 50_000
w = [1 / (k ** 1.1) for k in range(1, C + 1)]
cum = list(itertools.accumulate(w)); tot = cum[-1]
state = {}
out = open(sys.argv[1], 'w')
sent = 0; eid = 0
while sent < N:
    c = bisect.bisect_left(cum, random.random() * tot)
    counter = f"likes:post:{c}"
    actor = f"u{random.randrange(U)}"
    like = random.random() >= 0.15
    eid += 1
    line = f'{counter}\t{{"counter":"{counter}","delta":{1 if like else -1},"actor":"{actor}","event_id":"e{eid}"}}\n'
    copies = 2 if random.random() < 0.05 else 1
    copies = min(copies, N - sent)
    for _ in range(copies):
        out.write(line)
        s = state.setdefault(counter, set())
        (s.add if like else s.discard)(actor)
    sent += copies
out.close()
json.dump({k: len(v) for k, v in state.items() if v}, open(sys.argv[2], 'w'))
print("counters", len(state), "likes standing", sum(len(v) for v in state.values()))
