#!/usr/bin/env python3
"""What a like costs Redis by the way a flush writes it (issue: likes at the speed of counts):
EVENTS likes (Zipf over 100,000 counters, 50,000 users) netted into flushes of BATCH events,
each flush a run of likers per counter, written four ways:

- lua: one script per flush that SADDs each run's likers and INCRBYs the counter by what SADD
  added, then sets a ledger field (the shape of tally's flush.lua, without its checks);
- watch: WATCH the ledger, SMISMEMBER every run's likers, then MULTI: SADD the new ones and
  INCRBY the counter by their number, the ledger field, EXEC (no script);
- luasets: one script per flush that only SADDs each run's likers and sets the ledger field,
  the count being the set's SCARD (no counter key);
- scard: WATCH the ledger, then MULTI: SADD each run's likers, the ledger field, EXEC;
- split: WATCH the fence, then MULTI: SADD each run's likers, then a script given only the
  sets' keys that checks their type (one SINTERCARD with a key that does not exist) and sets
  the ledger field, EXEC;
- marked: WATCH the fence, then MULTI: SADD each run's likers, SET a check key, SINTERSTORE
  into it the intersection of a key that does not exist with every set (which deletes it, or
  fails on a key of another type and leaves it), then a script that deletes the check key (a
  failed check stops it) and sets the ledger field, EXEC (tally's flush of likes counted by
  their sets).

Prints redis-server's CPU per event (INFO cpu), median and range over the rounds; the ways
alternate within each round, in the opposite order every other round.

    pip install redis && deploy/local/dedup-paths.py [EVENTS] [BATCH] [ROUNDS]

Uses database 15 of the local Redis (127.0.0.1:6379), which it empties before each way.
"""
import random
import sys

import redis

EVENTS = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
BATCH = int(sys.argv[2]) if len(sys.argv) > 2 else 15_000
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3

r = redis.Redis(host="127.0.0.1", port=6379, db=15)
rng = random.Random(7)
weights = [1 / (i + 1) for i in range(100_000)]
counters = rng.choices(range(100_000), weights=weights, k=EVENTS)
users = [rng.randrange(50_000) for _ in range(EVENTS)]
LEDGER = "t:{g1}:ledger"

SETS_AND_COUNTS = r.register_script("""
local at = 2
for k = 1, tonumber(ARGV[1]) do
  local l = tonumber(ARGV[at])
  local added = redis.call('SADD', KEYS[2 * k], unpack(ARGV, at + 1, at + l))
  at = at + 1 + l
  if added > 0 then redis.call('INCRBY', KEYS[2 * k + 1], added) end
end
redis.call('HSET', KEYS[1], 'p', '1')
return 1
""")

SETS_ONLY = r.register_script("""
local at = 2
for k = 1, tonumber(ARGV[1]) do
  local l = tonumber(ARGV[at])
  redis.call('SADD', KEYS[1 + k], unpack(ARGV, at + 1, at + l))
  at = at + 1 + l
end
redis.call('HSET', KEYS[1], 'p', '1')
return 1
""")

CHECK_SETS = r.register_script("""
for first = 2, #KEYS, 1000 do
  local last = math.min(first + 999, #KEYS)
  redis.call('SINTERCARD', last - first + 2, KEYS[1] .. ':absent', unpack(KEYS, first, last))
end
redis.call('HSET', KEYS[1], 'p', '1')
return 1
""")
FENCE = "t:{g1}:fence"
CHECKED = r.register_script("""
if redis.call('DEL', KEYS[2]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'p', '1')
return 1
""")
CHECK = "t:{g1}:check"


def flushes():
    """Each flush's runs: (member set, counter key, likers)."""
    for start in range(0, EVENTS, BATCH):
        runs = {}
        for c, u in zip(counters[start:start + BATCH], users[start:start + BATCH]):
            runs.setdefault(c, set()).add(f"u{u}")
        yield [(f"t:{{g1}}:m:likes:post:{c}", f"t:{{g1}}:c:likes:post:{c}", sorted(m))
               for c, m in runs.items()]


def lua():
    for runs in flushes():
        keys, args = [LEDGER], [len(runs)]
        for s, c, m in runs:
            keys += [s, c]
            args += [len(m)] + m
        SETS_AND_COUNTS(keys=keys, args=args)


def luasets():
    for runs in flushes():
        keys, args = [LEDGER], [len(runs)]
        for s, _, m in runs:
            keys.append(s)
            args += [len(m)] + m
        SETS_ONLY(keys=keys, args=args)


def watch():
    for runs in flushes():
        with r.pipeline() as p:
            p.watch(LEDGER)
            p.hget(LEDGER, "p")
            reads = r.pipeline(transaction=False)
            for s, _, m in runs:
                reads.smismember(s, m)
            present = reads.execute()
            p.multi()
            for (s, c, m), here in zip(runs, present):
                new = [x for x, h in zip(m, here) if not h]
                if new:
                    p.sadd(s, *new)
                    p.incrby(c, len(new))
            p.hset(LEDGER, "p", "1")
            p.execute()


def scard():
    for runs in flushes():
        with r.pipeline() as p:
            p.watch(LEDGER)
            p.hget(LEDGER, "p")
            p.multi()
            for s, _, m in runs:
                p.sadd(s, *m)
            p.hset(LEDGER, "p", "1")
            p.execute()


def sadds_under_the_fence(p, runs):
    """WATCH the fence, read it and the ledger, then MULTI and each run's SADD."""
    p.watch(FENCE)
    p.hget(FENCE, "p")
    p.hget(LEDGER, "p")
    p.multi()
    for s, _, m in runs:
        p.sadd(s, *m)


def split():
    for runs in flushes():
        with r.pipeline() as p:
            sadds_under_the_fence(p, runs)
            CHECK_SETS(keys=[LEDGER] + [s for s, _, _ in runs], client=p)
            p.execute()


def marked():
    for runs in flushes():
        with r.pipeline() as p:
            sadds_under_the_fence(p, runs)
            p.set(CHECK, "1")
            p.sinterstore(CHECK, [CHECK + ":none"] + [s for s, _, _ in runs])
            CHECKED(keys=[LEDGER, CHECK], client=p)
            assert p.execute()[-1] == 1


def cpu():
    info = r.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


ways = [lua, watch, luasets, scard, split, marked]
results = {w.__name__: [] for w in ways}
for rnd in range(ROUNDS):
    for way in ways if rnd % 2 == 0 else ways[::-1]:
        r.flushdb()
        before = cpu()
        way()
        results[way.__name__].append((cpu() - before) * 1e6 / EVENTS)
r.flushdb()
print(f"{EVENTS} likes in flushes of {BATCH} events, {ROUNDS} rounds")
for name, v in results.items():
    v.sort()
    print(f"{name:8} redis-server {v[len(v) // 2]:.2f} us per event ({v[0]:.2f}-{v[-1]:.2f})")
