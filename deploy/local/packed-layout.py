#!/usr/bin/env python3
"""What a packed layout of counters would cost Redis (issue: every counter write near Redis's
floor): N distinct counters written once each, as tally's flush script writes them (one Lua
script per 1,000 counters), either as a key per counter (`INCRBY`, today's layout) or as fields
of small hashes (`HINCRBY`, a counter per field, N / buckets counters per hash). Prints
redis-server's CPU per write (INFO cpu) and its memory per counter (INFO memory).

    pip install redis && deploy/local/packed-layout.py [N] [ROUNDS]

Layouts alternate within each round; each is reported as its median and range over the rounds
(this 2-core machine drifts 20-30% between runs).

Uses database 15 of the local Redis (127.0.0.1:6379), which it empties before each run.
"""
import sys
import time

import redis

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
BATCH = 1_000
r = redis.Redis(db=15)

INCRBY = r.register_script("""
for i = 1, #KEYS do redis.call('INCRBY', KEYS[i], ARGV[i]) end
return 1""")
HINCRBY = r.register_script("""
for i = 1, #KEYS do redis.call('HINCRBY', KEYS[i], ARGV[i], 1) end
return 1""")


def cpu():
    info = r.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def run(buckets):
    """CPU-us per write and bytes per counter of one run."""
    r.flushdb()
    time.sleep(0.5)
    memory, used = r.info("memory")["used_memory"], cpu()
    for start in range(0, N, BATCH):
        ids = range(start, start + BATCH)
        if buckets == 0:
            INCRBY(keys=[f"p:{{g1}}:c:likes:post:{i}" for i in ids], args=["1"] * BATCH)
        else:
            HINCRBY(keys=[f"p:{{g1}}:C:{i % buckets}" for i in ids],
                    args=[f"likes:post:{i}" for i in ids])
    used = cpu() - used
    memory = r.info("memory")["used_memory"] - memory
    return 1e6 * used / N, memory / N


LAYOUTS = (0, N // 8, N // 32, N // 128)
runs = {b: [] for b in LAYOUTS}
for _ in range(ROUNDS):
    for buckets in LAYOUTS:
        runs[buckets].append(run(buckets))
r.flushdb()
for buckets, got in runs.items():
    layout = "a key per counter" if buckets == 0 else f"{N // buckets} counters per hash"
    cpus = sorted(c for c, _ in got)
    memory = sorted(m for _, m in got)[len(got) // 2]
    print(f"{layout:>22}: redis-server {cpus[len(cpus) // 2]:.2f} CPU-us per write "
          f"({cpus[0]:.2f}-{cpus[-1]:.2f}), {memory:.1f} bytes per counter")
