#!/usr/bin/env python3
# The long tail of issue 43 and its Zipf baseline, for a producer that is not tally's: two files
# of 1,000,000 keyed JSON events each, one with every event a distinct counter, one Zipf(1.1)
# over 100,000 counters. Write them with kcat and compare the aggregator on both, alternating:
#   source deploy/local/common.sh; create_topic tail-json 8; create_topic zipf-json 8
#   deploy/local/tail-workload.py tail.tsv zipf.tsv
#   kcat -P -b 127.0.0.1:9092 -t tail-json -K "$(printf '\t')" -z lz4 -l tail.tsv
#   kcat -P -b 127.0.0.1:9092 -t zipf-json -K "$(printf '\t')" -z lz4 -l zipf.tsv
# then deploy/local/ab.sh BIN BIN on each topic in turn (1000000 events), or `tally-bench --only
# cardinality` for the same shape with Redis's own floor measured beside it.
import bisect, itertools, random, sys

random.seed(43)
N, C = 1_000_000, 100_000


def line(counter):
    return f'{counter}\t{{"counter":"{counter}","delta":1}}\n'


with open(sys.argv[1], "w") as tail:
    for i in range(N):
        tail.write(line(f"views:item:{i}"))

cum = list(itertools.accumulate(1 / (k ** 1.1) for k in range(1, C + 1)))
with open(sys.argv[2], "w") as zipf:
    for _ in range(N):
        zipf.write(line(f"views:item:{bisect.bisect_left(cum, random.random() * cum[-1])}"))
