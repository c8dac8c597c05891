//! An exactly-once write Redis cannot take in full leaves nothing behind, against a real
//! `redis-server`, through both ways of making it atomic: the flush script (which adds each delta
//! with its own `INCRBY` and undoes them all when Redis refuses one) and the `WATCH`/`MULTI`
//! transactions (which read and check every key first). Both report the same refusals; every
//! value, key and expiry is as before; the ledger does not move; and the write without the
//! refused deltas then lands once.

use redis::AsyncCommands;
use tally_aggregator::RedisSink;
use tally_aggregator::machine::batch::{Reset, WindowDelta};
use tally_aggregator::machine::likes::Likes;
use tally_aggregator::machine::pace::{MEMBERSHIPS_PER_ENTRY, MEMBERSHIPS_PER_ENTRY_BEFORE_SCRIPT};
use tally_aggregator::operator::config::Atomicity;
use tally_aggregator::store::sink::{Applied, GroupWrite, Refused, Rejection, Sink, Stamp};
use tally_aggregator::store::transactions::TRANSACTION_GROUP_ENTRIES;
use tally_common::{DeadLetterReason, Keyspace, RedisConn, RedisTarget};
use tally_tests::{RedisServer, unique};

const GROUP: u32 = 0;
const FIELD: &str = "refused/0";
const MINUTE_MS: i64 = 60_000;

/// A sink writing `ks` on the server at `url`.
async fn sink(url: &str, ks: &Keyspace, atomicity: Atomicity) -> RedisSink {
    let conn = RedisConn::connect(url).await.expect("redis");
    let target = RedisTarget::parse(url).expect("target");
    RedisSink::new(conn, &target, ks.clone(), atomicity).expect("sink")
}

/// The sink, the keyspace it writes and its fence's epoch, with the fence stamped.
async fn fenced_sink(redis: &RedisServer, atomicity: Atomicity) -> (RedisSink, Keyspace, u64) {
    let keyspace = Keyspace::new(unique("refused"), 1).expect("keyspace");
    let (sink, epoch) = fenced_sink_in(redis, &keyspace, atomicity).await;
    (sink, keyspace, epoch)
}

/// [`fenced_sink`] writing by `keyspace`.
async fn fenced_sink_in(
    redis: &RedisServer,
    keyspace: &Keyspace,
    atomicity: Atomicity,
) -> (RedisSink, u64) {
    let sink = sink(&redis.url(), keyspace, atomicity).await;
    let epoch = sink.next_epoch(GROUP, FIELD, 1).await.expect("epoch");
    let stamp = sink.stamp_fence(GROUP, FIELD, epoch).await.expect("stamp");
    assert_eq!(stamp, Stamp::Stamped { ledger: -1 });
    (sink, epoch)
}

fn write<'a>(
    epoch: u64,
    deltas: &'a [(String, i64)],
    windows: &'a [WindowDelta],
    members: &'a Likes,
) -> GroupWrite<'a> {
    GroupWrite {
        group: GROUP,
        field: FIELD,
        epoch,
        expected_ledger: -1,
        next_offset: 10,
        deltas,
        windows,
        resets: &[],
        members,
        watermark: None,
    }
}

/// What `write` is refused for, each refusal with its reason; panics if it is not refused.
async fn refusals(
    sink: &RedisSink,
    write: GroupWrite<'_>,
    atomicity: Atomicity,
) -> Vec<(Refused, DeadLetterReason)> {
    let applied = sink.apply_fenced(write).await.expect("write");
    let Applied::Rejected(rejections) = applied else {
        panic!("{atomicity:?}: expected a refusal, got {applied:?}");
    };
    (rejections.into_iter())
        .map(|r| (r.refused, r.reason))
        .collect()
}

fn bucket(counter: &str, start_ms: i64, delta: i64) -> WindowDelta {
    WindowDelta {
        counter: counter.into(),
        width_ms: MINUTE_MS,
        start_ms,
        expire_at_ms: tally_common::event::now_ms() + 3_600_000,
        delta,
    }
}

fn sorted(mut rejections: Vec<Rejection>) -> Vec<(Refused, String)> {
    rejections.sort_by_key(|r| r.refused);
    (rejections.into_iter())
        .map(|r| (r.refused, r.reason.to_string()))
        .collect()
}

/// What a key holds: its string value (`None` when absent), and whether it has an expiry.
async fn state(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> (Option<String>, bool) {
    let kind: String = redis::cmd("TYPE")
        .arg(key)
        .query_async(conn)
        .await
        .expect("TYPE");
    let value = match kind.as_str() {
        "none" => None,
        "string" => conn.get(key).await.expect("GET"),
        other => Some(format!("<{other}>")),
    };
    let ttl: i64 = conn.pttl(key).await.expect("PTTL");
    (value, ttl > 0)
}

/// What a cells field holds (`None` when absent), and whether its hash has an expiry.
async fn field_state(
    conn: &mut redis::aio::MultiplexedConnection,
    hash: &str,
    field: &str,
) -> (Option<String>, bool) {
    let value: Option<String> = conn.hget(hash, field).await.expect("HGET");
    let ttl: i64 = conn.pttl(hash).await.expect("PTTL");
    (value, ttl > 0)
}

async fn refused_write_leaves_nothing_behind(atomicity: Atomicity) {
    let redis = RedisServer::start().await;
    let (sink, ks, epoch) = fenced_sink(&redis, atomicity).await;
    let mut conn = tally_tests::connect(&redis.url()).await;
    let key = |counter: &str| ks.counter_key(GROUP, counter);
    let now = tally_common::event::now_ms();
    let minute = now - now % MINUTE_MS;
    // The window buckets: kept:1's field holds 3 in this minute; junk:1's is not cells.
    let cells = |counter: &str| (ks.cells_key(GROUP, counter), counter.to_owned());
    let index_now = minute / MINUTE_MS;

    let _: () = conn.set(key("kept:1"), 7).await.expect("SET");
    let _: () = conn.set(key("min:1"), 5).await.expect("SET");
    let _: () = conn.set(key("kept:2"), 11).await.expect("SET");
    let _: () = conn.set(key("text:1"), "abc").await.expect("SET");
    let _: () = conn
        .hset(key("hash:1"), "not", "a counter")
        .await
        .expect("HSET");
    let _: () = conn.set(key("big:1"), i64::MAX - 10).await.expect("SET");
    let _: () = conn.set(key("zero:1"), 0).await.expect("SET");
    for (counter, value) in [
        ("kept:1", format!("1m={index_now}:3")),
        ("junk:1", "junk".into()),
    ] {
        let (hash, field) = cells(counter);
        let _: () = conn.hset(&hash, field, value).await.expect("HSET");
        let _: () = conn.expire(&hash, 3_600).await.expect("EXPIRE");
    }

    // Refused deltas among accepted ones, before and after them; one accepted delta is i64::MIN,
    // which has no negation in 64 bits.
    let mut deltas = vec![("kept:1".to_owned(), 3), ("min:1".to_owned(), i64::MIN)];
    deltas.extend((1..=20).map(|i| (format!("new:{i}"), i)));
    deltas.push(("text:1".to_owned(), 1));
    deltas.push(("zero:1".to_owned(), 4));
    deltas.push(("nothing:1".to_owned(), 0));
    deltas.push(("kept:2".to_owned(), -6));
    deltas.push(("hash:1".to_owned(), 1));
    deltas.extend((21..=40).map(|i| (format!("new:{i}"), i)));
    deltas.push(("big:1".to_owned(), 100));
    let windows = [
        bucket("kept:1", minute, 2),
        bucket("new:1", minute, 1),
        bucket("text:1", minute, 1),
        bucket("junk:1", minute, 1),
    ];
    let watched: Vec<String> = deltas.iter().map(|(c, _)| key(c)).collect();
    let mut before = Vec::new();
    for k in &watched {
        before.push(state(&mut conn, k).await);
    }
    let fields = ["kept:1", "new:1", "text:1", "junk:1"].map(cells);
    let mut cells_before = Vec::new();
    for (hash, field) in &fields {
        cells_before.push(field_state(&mut conn, hash, field).await);
    }

    let applied = sink
        .apply_fenced(write(epoch, &deltas, &windows, Likes::NONE))
        .await
        .expect("write");
    let Applied::Rejected(rejections) = applied else {
        panic!("{atomicity:?}: expected a refusal, got {applied:?}");
    };
    let index = |counter: &str| {
        deltas
            .iter()
            .position(|(c, _)| c == counter)
            .expect("a delta of the write")
    };
    assert_eq!(
        sorted(rejections),
        vec![
            (Refused::Delta(index("text:1")), "not_an_integer".to_owned()),
            (Refused::Delta(index("hash:1")), "wrong_type".to_owned()),
            (Refused::Delta(index("big:1")), "overflow".to_owned()),
            (Refused::Window(3), "not_an_integer".to_owned()),
        ],
        "{atomicity:?}"
    );
    for ((hash, field), was) in fields.iter().zip(&cells_before) {
        let now = field_state(&mut conn, hash, field).await;
        assert_eq!(
            &now, was,
            "{atomicity:?}: {field}'s buckets changed by a refused write"
        );
    }
    for (k, was) in watched.iter().zip(&before) {
        let now = state(&mut conn, k).await;
        // A key at 0 counts as no key: the script may leave either.
        let zero = |s: &(Option<String>, bool)| s.0.as_deref() == Some("0") && !s.1;
        if !(zero(was) && now.0.is_none()) {
            assert_eq!(&now, was, "{atomicity:?}: {k} changed by a refused write");
        }
    }
    let ledger: Option<i64> = conn.hget(ks.ledger_key(GROUP), FIELD).await.expect("HGET");
    assert_eq!(
        ledger, None,
        "{atomicity:?}: a refused write moved the ledger"
    );

    // The same write without what was refused lands, once.
    let refused = ["text:1", "hash:1", "big:1"];
    let accepted: Vec<(String, i64)> = (deltas.iter())
        .filter(|(c, _)| !refused.contains(&c.as_str()))
        .cloned()
        .collect();
    let windows = &windows[..2];
    let applied = sink
        .apply_fenced(write(epoch, &accepted, windows, Likes::NONE))
        .await
        .expect("write");
    assert_eq!(applied, Applied::Written, "{atomicity:?}");
    let again = sink
        .apply_fenced(write(epoch, &accepted, windows, Likes::NONE))
        .await
        .expect("write");
    assert_eq!(again, Applied::AlreadyApplied, "{atomicity:?}");
    for (counter, delta) in &accepted {
        let base = match counter.as_str() {
            "kept:1" => 7,
            "min:1" => 5,
            "kept:2" => 11,
            _ => 0,
        };
        let value: i64 = conn.get(key(counter)).await.expect("GET");
        assert_eq!(value, base + delta, "{atomicity:?}: {counter}");
    }
    let (hash, field) = cells("kept:1");
    assert_eq!(
        field_state(&mut conn, &hash, &field).await,
        (Some(format!("1m={index_now}:5")), true)
    );
    let (hash, field) = cells("new:1");
    assert_eq!(
        field_state(&mut conn, &hash, &field).await,
        (Some(format!("1m={index_now}:1")), true)
    );
    let ledger: Option<i64> = conn.hget(ks.ledger_key(GROUP), FIELD).await.expect("HGET");
    assert_eq!(ledger, Some(10), "{atomicity:?}");
}

/// A refused membership takes the path that checks everything first; its refusal is listed
/// after the deltas', as both paths list them.
async fn refused_membership_is_listed_after_the_deltas(atomicity: Atomicity) {
    let redis = RedisServer::start().await;
    let (sink, ks, epoch) = fenced_sink(&redis, atomicity).await;
    let mut conn = tally_tests::connect(&redis.url()).await;
    let _: () = conn
        .set(ks.counter_key(GROUP, "text:1"), "abc")
        .await
        .expect("SET");
    let _: () = conn
        .hset(ks.counter_key(GROUP, "liked:1"), "not", "a counter")
        .await
        .expect("HSET");
    // A like count that is not an integer Redis reads, and one a like would take past 64 bits.
    let _: () = conn
        .set(ks.counter_key(GROUP, "liked:3"), "007")
        .await
        .expect("SET");
    let _: () = conn
        .set(ks.counter_key(GROUP, "liked:4"), i64::MAX)
        .await
        .expect("SET");
    let deltas = [("fine:1".to_owned(), 2), ("text:1".to_owned(), 1)];
    let members = Likes::from_actions(
        ["liked:2", "liked:1", "liked:3", "liked:4"].map(|counter| (counter, "u1", true)),
    );
    let reasons = refusals(&sink, write(epoch, &deltas, &[], &members), atomicity).await;
    assert_eq!(
        reasons,
        vec![
            (Refused::Delta(1), DeadLetterReason::NotAnInteger),
            (Refused::Member(1), DeadLetterReason::WrongType),
            (Refused::Member(2), DeadLetterReason::NotAnInteger),
            (Refused::Member(3), DeadLetterReason::Overflow),
        ],
        "{atomicity:?}"
    );
    let fine: Option<i64> = conn
        .get(ks.counter_key(GROUP, "fine:1"))
        .await
        .expect("GET");
    let liked: bool = conn
        .exists(ks.member_key(GROUP, "liked:2"))
        .await
        .expect("EXISTS");
    assert_eq!((fine, liked), (None, false), "{atomicity:?}");
}

/// Runs counted by their sets beside runs counted in the shares, in one write: a run counted
/// by its set writes no counter (whatever the counter's key holds, its like lands) and is
/// refused only for a count set of another type; the others are checked as before. Once the
/// refused memberships are taken out, the write lands, and reads count both kinds.
async fn runs_counted_by_sets_and_in_shares_share_a_write(atomicity: Atomicity) {
    let redis = RedisServer::start().await;
    let by_set = tally_common::keyspace::LikesBySet {
        listed: vec![("liked".to_owned(), true), ("shared".to_owned(), false)],
        others: false,
        every_dedup: false,
        in_shares: true,
    };
    let ks = Keyspace::new(unique("sets"), 1)
        .expect("keyspace")
        .with_likes_by_set(by_set);
    let (sink, epoch) = fenced_sink_in(&redis, &ks, atomicity).await;
    let mut conn = tally_tests::connect(&redis.url()).await;
    // A counter key no integer (its count is its set, so its like lands), a count set of
    // another type, and a share a like would take past 64 bits.
    let _: () = conn
        .hset(ks.counter_key(GROUP, "liked:1"), "not", "a counter")
        .await
        .expect("HSET");
    let _: () = conn
        .set(ks.count_set_key(GROUP, "liked:2"), "a string")
        .await
        .expect("SET");
    let _: () = conn
        .set(ks.counter_key(GROUP, "shared:1"), i64::MAX)
        .await
        .expect("SET");
    let mut members = Likes::from_actions([
        ("liked:1", "u1", true),
        ("liked:2", "u1", true),
        ("shared:1", "u1", true),
        ("shared:3", "u1", true),
        ("liked:3", "u1", true),
        ("liked:3", "u2", true),
    ]);
    let reasons = refusals(&sink, write(epoch, &[], &[], &members), atomicity).await;
    assert_eq!(
        reasons,
        vec![
            (Refused::Member(1), DeadLetterReason::WrongType),
            (Refused::Member(2), DeadLetterReason::Overflow),
        ],
        "{atomicity:?}"
    );
    members.remove(&[1, 2]);
    let applied = sink
        .apply_fenced(write(epoch, &[], &[], &members))
        .await
        .expect("write");
    assert_eq!(applied, Applied::Written, "{atomicity:?}");
    let set = |counter: &str| ks.count_set_key(GROUP, counter);
    let liked_1: Vec<String> = conn.smembers(set("liked:1")).await.expect("SMEMBERS");
    let mut liked_3: Vec<String> = conn.smembers(set("liked:3")).await.expect("SMEMBERS");
    liked_3.sort();
    assert_eq!(
        (liked_1, liked_3),
        (
            vec!["u1".to_owned()],
            vec!["u1".to_owned(), "u2".to_owned()]
        )
    );
    let shares: (bool, Option<i64>, Option<i64>) = (
        conn.exists(ks.counter_key(GROUP, "liked:3"))
            .await
            .expect("EXISTS"),
        conn.get(ks.counter_key(GROUP, "shared:3"))
            .await
            .expect("GET"),
        conn.get(ks.counter_key(GROUP, "shared:1"))
            .await
            .expect("GET"),
    );
    assert_eq!(shares, (false, Some(1), Some(i64::MAX)), "{atomicity:?}");
    let shared: bool = conn
        .sismember(ks.member_key(GROUP, "shared:3"), "u1")
        .await
        .expect("SISMEMBER");
    assert!(shared, "{atomicity:?}");
    let reader = tally_common::Reader::new(
        RedisConn::connect(&redis.url()).await.expect("redis"),
        ks.clone(),
    );
    let totals = reader
        .get_many(&["liked:3", "shared:3", "liked:1"])
        .await
        .expect("read");
    assert_eq!(totals, vec![2, 1, 1], "{atomicity:?}");
    // A count set of another type is no count: the read says so rather than guess.
    assert!(reader.get("liked:2").await.is_err(), "{atomicity:?}");
    assert!(reader.has_liked("liked:3", "u2").await.expect("has_liked"));
    assert!(!reader.has_liked("liked:3", "u3").await.expect("has_liked"));
    // With scripts and transactions both (the default), the write that landed wrote its sets
    // before the script, checked by one SINTERSTORE, whose key is gone.
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .expect("INFO");
    let sets_first = info.contains("cmdstat_sinterstore:calls=");
    assert_eq!(sets_first, atomicity == Atomicity::Auto, "{info}");
    let check: bool = conn.exists(ks.set_check_key(GROUP)).await.expect("EXISTS");
    assert!(!check, "{atomicity:?}");
}

/// A group whose likes were moved to count sets (`tally likes-to-sets` marks its fence) takes
/// no new owner that counts likes in the shares, which would count them again; any other owner
/// takes it as before.
async fn a_group_whose_likes_moved_takes_no_owner_counting_them_in_the_shares(
    atomicity: Atomicity,
) {
    let redis = RedisServer::start().await;
    let ks = Keyspace::new(unique("moved"), 1).expect("keyspace");
    let mut conn = tally_tests::connect(&redis.url()).await;
    let _: () = conn
        .hset(
            ks.fence_key(GROUP),
            tally_common::layout::MOVED_FIELD,
            "sets",
        )
        .await
        .expect("HSET");
    let in_shares = ks
        .clone()
        .with_likes_by_set(tally_common::keyspace::LikesBySet {
            listed: Vec::new(),
            others: false,
            every_dedup: false,
            in_shares: true,
        });
    let shares = sink(&redis.url(), &in_shares, atomicity).await;
    let epoch = shares.next_epoch(GROUP, FIELD, 1).await.expect("epoch");
    let refused = shares.stamp_fence(GROUP, FIELD, epoch).await;
    let error = refused.expect_err("refused");
    // Known as the move's refusal, which stops the aggregator rather than being retried.
    assert!(error.is_likes_moved(), "{atomicity:?}: {error}");
    let error = error.to_string();
    assert!(
        error.contains("were moved to count sets"),
        "{atomicity:?}: {error}"
    );
    // A fenced owner asks, and is told the same; a writer by the sets is not.
    assert!(
        shares.likes_moved(GROUP).await.expect("HGET"),
        "{atomicity:?}"
    );
    let fence: Option<u64> = conn.hget(ks.fence_key(GROUP), FIELD).await.expect("HGET");
    assert_eq!(fence, None, "{atomicity:?}: nothing stamped");
    let sets = sink(&redis.url(), &ks, atomicity).await;
    assert!(
        !sets.likes_moved(GROUP).await.expect("no read"),
        "{atomicity:?}"
    );
    let stamped = sets.stamp_fence(GROUP, FIELD, epoch).await.expect("stamp");
    assert_eq!(stamped, Stamp::Stamped { ledger: -1 }, "{atomicity:?}");
}

/// `n` counters, each in a bucket of its own among `buckets`.
fn in_distinct_buckets(n: usize, buckets: u32) -> Vec<String> {
    let mut used = Vec::new();
    (0..)
        .map(|i| format!("packed:{i}"))
        .filter(|c| {
            let bucket = Keyspace::bucket_of(c, buckets);
            let new = !used.contains(&bucket);
            used.push(bucket);
            new
        })
        .take(n)
        .collect()
}

/// A group packed into hashes (`tally pack`) refuses the same data the keys would, leaves nothing
/// behind, and then takes the rest as fields: a field that is not an integer, a sum past 64 bits,
/// a bucket's hash of another type. A reset then deletes the field. The sink starts not knowing
/// the group packs, and learns it from its first write's answer.
async fn a_packed_group_refuses_and_undoes_as_keys_do(atomicity: Atomicity) {
    const BUCKETS: u32 = 8;
    let redis = RedisServer::start().await;
    let (sink, ks, epoch) = fenced_sink(&redis, atomicity).await;
    let mut conn = tally_tests::connect(&redis.url()).await;
    let _: () = conn
        .hset(
            ks.fence_key(GROUP),
            tally_common::layout::PACKED_FIELD,
            BUCKETS,
        )
        .await
        .expect("mark");
    // Five counters in five buckets: the fourth's bucket holds a string.
    let counters = in_distinct_buckets(5, BUCKETS);
    let hash = |c: &str| ks.packed_key(GROUP, Keyspace::bucket_of(c, BUCKETS));
    let (ok, junk, big, typed, fresh) = (
        &counters[0],
        &counters[1],
        &counters[2],
        &counters[3],
        &counters[4],
    );
    let near = (i64::MAX - 1).to_string();
    for (counter, value) in [(ok, "10"), (junk, "abc"), (big, near.as_str())] {
        let _: () = conn
            .hset(hash(counter), counter, value)
            .await
            .expect("HSET");
    }
    let _: () = conn.set(hash(typed), "x").await.expect("SET");
    let fields = async |conn: &mut redis::aio::MultiplexedConnection| -> Vec<Option<String>> {
        let mut values = Vec::new();
        for c in [ok, junk, big, fresh] {
            values.push(conn.hget(hash(c), c).await.expect("HGET"));
        }
        values
    };
    let before = fields(&mut conn).await;

    let deltas: Vec<(String, i64)> = [(ok, 5), (junk, 1), (big, 5), (typed, 2), (fresh, 3)]
        .map(|(c, d)| (c.clone(), d))
        .to_vec();
    let none = Likes::NONE;
    let mut refused = refusals(&sink, write(epoch, &deltas, &[], none), atomicity).await;
    refused.sort_by_key(|r| r.0);
    assert_eq!(
        refused,
        vec![
            (Refused::Delta(1), DeadLetterReason::NotAnInteger),
            (Refused::Delta(2), DeadLetterReason::Overflow),
            (Refused::Delta(3), DeadLetterReason::WrongType),
        ],
        "{atomicity:?}"
    );
    assert_eq!(
        fields(&mut conn).await,
        before,
        "{atomicity:?}: nothing left behind"
    );
    let ledger: Option<String> = conn.hget(ks.ledger_key(GROUP), FIELD).await.expect("HGET");
    assert_eq!(ledger, None, "{atomicity:?}: the ledger did not move");

    let rest = [deltas[0].clone(), deltas[4].clone()];
    let landed = sink.apply_fenced(write(epoch, &rest, &[], none)).await;
    assert_eq!(landed.expect("write"), Applied::Written, "{atomicity:?}");
    let after = fields(&mut conn).await;
    assert_eq!(after[0].as_deref(), Some("15"), "{atomicity:?}");
    assert_eq!(after[3].as_deref(), Some("3"), "{atomicity:?}");
    let keys: usize = conn
        .exists(&[ks.counter_key(GROUP, ok), ks.counter_key(GROUP, fresh)])
        .await
        .expect("EXISTS");
    assert_eq!(keys, 0, "{atomicity:?}: fields, not keys");

    // A reset of `ok` (with a key of its own beside its field) clears both, then counts 1.
    let _: () = conn.set(ks.counter_key(GROUP, ok), 7).await.expect("SET");
    let reset = [Reset::new(ok.clone(), 15)];
    let again = [(ok.clone(), 1)];
    let write = GroupWrite {
        expected_ledger: 10,
        next_offset: 20,
        resets: &reset,
        ..write(epoch, &again, &[], none)
    };
    assert_eq!(
        sink.apply_fenced(write).await.expect("write"),
        Applied::Written
    );
    // Readers sum the fields as the plan says (`tally pack` records it before any mark).
    let plan = format!("v=1;origin=1;write=1;read=1;buckets={BUCKETS}");
    let _: () = conn.set(ks.plan_key(), plan).await.expect("SET");
    let total = redis.reader(ks.clone()).await.get(ok).await.expect("read");
    let key: Option<String> = conn.get(ks.counter_key(GROUP, ok)).await.expect("GET");
    assert_eq!(key, None, "{atomicity:?}: the reset deleted the key");
    assert_eq!(
        total, 1,
        "{atomicity:?}: the reset cleared the key and the field"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flush_script_undoes_a_refused_write() {
    refused_write_leaves_nothing_behind(Atomicity::Scripts).await;
    refused_membership_is_listed_after_the_deltas(Atomicity::Scripts).await;
    runs_counted_by_sets_and_in_shares_share_a_write(Atomicity::Scripts).await;
    a_group_whose_likes_moved_takes_no_owner_counting_them_in_the_shares(Atomicity::Scripts).await;
    a_packed_group_refuses_and_undoes_as_keys_do(Atomicity::Scripts).await;
}

/// The default on a standalone server: runs counted by their sets go before the script, in one
/// `MULTI`/`EXEC` with it; a set of another type sends the write back to the script alone,
/// which refuses what it would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_written_before_the_script_refuse_the_same_writes() {
    refused_write_leaves_nothing_behind(Atomicity::Auto).await;
    refused_membership_is_listed_after_the_deltas(Atomicity::Auto).await;
    runs_counted_by_sets_and_in_shares_share_a_write(Atomicity::Auto).await;
    a_group_whose_likes_moved_takes_no_owner_counting_them_in_the_shares(Atomicity::Auto).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_refuse_the_same_writes() {
    refused_write_leaves_nothing_behind(Atomicity::Transactions).await;
    refused_membership_is_listed_after_the_deltas(Atomicity::Transactions).await;
    runs_counted_by_sets_and_in_shares_share_a_write(Atomicity::Transactions).await;
    a_group_whose_likes_moved_takes_no_owner_counting_them_in_the_shares(Atomicity::Transactions)
        .await;
    a_packed_group_refuses_and_undoes_as_keys_do(Atomicity::Transactions).await;
}

/// At-least-once in a group marked packed: the deltas go to fields, refused for the same data
/// as keys (a field that is not an integer, a bucket's hash of another type), with every other
/// delta landed once and no key written; a reset clears the counter's key and its field.
#[tokio::test]
async fn at_least_once_packs_where_the_group_is_marked() {
    const BUCKETS: u32 = 8;
    let redis = RedisServer::start().await;
    let url = redis.url();
    let ks = Keyspace::new(unique("alo-packed"), 1).expect("keyspace");
    let sink = sink(&url, &ks, Atomicity::Auto).await;
    let mut conn = tally_tests::connect(&url).await;
    let plan = format!("v=1;origin=1;write=1;read=1;buckets={BUCKETS}");
    let _: () = conn.set(ks.plan_key(), plan).await.expect("SET");
    let mark = tally_common::layout::PACKED_FIELD;
    let _: () = conn
        .hset(ks.fence_key(GROUP), mark, BUCKETS)
        .await
        .expect("HSET");
    let counters = in_distinct_buckets(4, BUCKETS);
    let (ok, junk, typed, fresh) = (&counters[0], &counters[1], &counters[2], &counters[3]);
    let hash = |c: &str| ks.packed_key(GROUP, Keyspace::bucket_of(c, BUCKETS));
    let _: () = conn.hset(hash(ok), ok, 7).await.expect("HSET");
    let _: () = conn.hset(hash(junk), junk, "abc").await.expect("HSET");
    let _: () = conn.set(hash(typed), "x").await.expect("SET");
    let deltas: Vec<(String, i64)> = [(ok, 3), (junk, 1), (typed, 1), (fresh, 5)]
        .map(|(c, d)| (c.clone(), d))
        .to_vec();

    let rejected = sink.apply(GROUP, &deltas, &[], &[]).await.expect("apply");
    assert_eq!(
        sorted(rejected),
        vec![
            (Refused::Delta(1), "not_an_integer".to_owned()),
            (Refused::Delta(2), "wrong_type".to_owned()),
        ]
    );
    for (counter, want) in [(ok, "10"), (junk, "abc"), (fresh, "5")] {
        let got: Option<String> = conn.hget(hash(counter), counter).await.expect("HGET");
        assert_eq!(got.as_deref(), Some(want), "{counter}");
    }
    let keys: usize = (conn.exists(&[ks.counter_key(GROUP, ok), ks.counter_key(GROUP, fresh)]))
        .await
        .expect("EXISTS");
    assert_eq!(keys, 0, "fields, not keys");

    let _: () = conn.set(ks.counter_key(GROUP, ok), 4).await.expect("SET");
    let again = [(ok.clone(), 2)];
    let rejected = sink
        .apply(GROUP, &again, &[], &[Reset::new(ok.clone(), 0)])
        .await;
    assert!(rejected.expect("apply").is_empty());
    let total = redis.reader(ks.clone()).await.get(ok).await.expect("read");
    assert_eq!(total, 2, "the reset cleared the key and the field");
}

/// At-least-once: one `MULTI`/`EXEC` per group, in which Redis runs every command it can. The
/// deltas it refuses for their data come back as refusals, not applied, with the reason read
/// from the key (a string Redis does not read as an integer, `007` included); every other delta
/// landed once; and a server that refuses the whole transaction (out of memory) fails it with
/// nothing applied.
#[tokio::test]
async fn at_least_once_refuses_only_what_the_data_refuses() {
    let redis = RedisServer::start().await;
    let url = redis.url();
    let ks = Keyspace::new(unique("alo-refused"), 1).expect("keyspace");
    let conn = RedisConn::connect(&url).await.expect("redis");
    let target = RedisTarget::parse(&url).expect("target");
    let sink = RedisSink::new(conn, &target, ks.clone(), Atomicity::Auto).expect("sink");
    let mut conn = tally_tests::connect(&url).await;
    let key = |counter: &str| ks.counter_key(GROUP, counter);
    let _: () = conn.set(key("kept:1"), 7).await.expect("SET");
    let _: () = conn.set(key("text:1"), "abc").await.expect("SET");
    let _: () = conn.set(key("padded:1"), "007").await.expect("SET");
    let _: () = conn
        .hset(key("hash:1"), "not", "a counter")
        .await
        .expect("HSET");
    let _: () = conn.set(key("big:1"), i64::MAX - 10).await.expect("SET");
    let deltas: Vec<(String, i64)> = [
        ("kept:1", 3),
        ("text:1", 1),
        ("new:1", 5),
        ("padded:1", 1),
        ("hash:1", 1),
        ("big:1", 100),
    ]
    .into_iter()
    .map(|(c, d)| (c.to_owned(), d))
    .collect();

    let rejected = sink.apply(GROUP, &deltas, &[], &[]).await.expect("apply");
    assert_eq!(
        sorted(rejected),
        vec![
            (Refused::Delta(1), "not_an_integer".to_owned()),
            (Refused::Delta(3), "not_an_integer".to_owned()),
            (Refused::Delta(4), "wrong_type".to_owned()),
            (Refused::Delta(5), "overflow".to_owned()),
        ]
    );
    for (counter, want) in [
        ("kept:1", Some("10".to_owned())),
        ("new:1", Some("5".to_owned())),
        ("text:1", Some("abc".to_owned())),
        ("padded:1", Some("007".to_owned())),
        ("big:1", Some((i64::MAX - 10).to_string())),
    ] {
        let got: Option<String> = conn.get(key(counter)).await.expect("GET");
        assert_eq!(got, want, "{counter}");
    }

    // Out of memory: the transaction is refused whole, with nothing applied.
    redis::cmd("CONFIG")
        .arg(&["SET", "maxmemory", "1"])
        .exec_async(&mut conn)
        .await
        .expect("CONFIG SET");
    let error = sink
        .apply(GROUP, &deltas[..3], &[], &[])
        .await
        .expect_err("refused whole");
    assert!(format!("{error}").contains("OOM"), "{error}");
    redis::cmd("CONFIG")
        .arg(&["SET", "maxmemory", "0"])
        .exec_async(&mut conn)
        .await
        .expect("CONFIG SET");
    let kept: Option<String> = conn.get(key("kept:1")).await.expect("GET");
    assert_eq!(kept.as_deref(), Some("10"), "nothing applied");
}

/// At-least-once window deltas, through `scripts/cells.lua` and through a transaction: a field
/// that is not cells refuses its deltas, a bucket at the 64-bit limit refuses the delta past it,
/// and every other delta, of the same fields too, lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_windows_refuse_only_what_the_data_refuses() {
    let redis = RedisServer::start().await;
    let url = redis.url();
    let mut conn = tally_tests::connect(&url).await;
    let now = tally_common::event::now_ms();
    let minute = now - now % MINUTE_MS;
    let index = minute / MINUTE_MS;
    for atomicity in [Atomicity::Auto, Atomicity::Transactions] {
        let ks = Keyspace::new(unique("alo-windows"), 1).expect("keyspace");
        let sink = sink(&url, &ks, atomicity).await;
        let field = |counter: &str| (ks.cells_key(GROUP, counter), counter.to_owned());
        let full = format!("1m={index}:{}", i64::MAX);
        for (counter, value) in [("junk:1", "junk".to_owned()), ("max:1", full.clone())] {
            let (hash, name) = field(counter);
            let _: () = conn.hset(hash, name, value).await.expect("HSET");
        }
        let windows = [
            bucket("kept:1", minute, 2),
            bucket("junk:1", minute, 1),
            bucket("max:1", minute, 1),
            bucket("max:1", minute - MINUTE_MS, 4),
        ];
        let rejected = sink.apply(GROUP, &[], &windows, &[]).await.expect("apply");
        assert_eq!(
            sorted(rejected),
            vec![
                (Refused::Window(1), "not_an_integer".to_owned()),
                (Refused::Window(2), "overflow".to_owned()),
            ],
            "{atomicity:?}"
        );
        for (counter, want) in [
            ("kept:1", format!("1m={index}:2")),
            ("junk:1", "junk".to_owned()),
            ("max:1", format!("{full},{}:4", index - 1)),
        ] {
            let (hash, name) = field(counter);
            let got: Option<String> = conn.hget(&hash, name).await.expect("HGET");
            assert_eq!(
                got.as_deref(),
                Some(want.as_str()),
                "{atomicity:?}: {counter}"
            );
            // A hash written expires with its last bucket (junk:1's was set up without one).
            let ttl: i64 = conn.pttl(&hash).await.expect("PTTL");
            assert!(
                counter == "junk:1" || ttl > 0,
                "{atomicity:?}: {hash} expires"
            );
        }
    }
}

/// Two partitions' flushes of the same counter's buckets, racing: each reads the field, computes
/// its new value and writes it only if the field still holds what it read, reading again
/// otherwise; none is lost or counted twice, through scripts and through transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_flushes_of_one_counters_buckets_lose_nothing() {
    const WRITES: i64 = 150;
    let redis = RedisServer::start().await;
    let url = redis.url();
    let now = tally_common::event::now_ms();
    let minute = now - now % MINUTE_MS;
    for atomicity in [Atomicity::Scripts, Atomicity::Transactions] {
        let ks = Keyspace::new(unique("race"), 1).expect("keyspace");
        let mut writers = Vec::new();
        for partition in 0..2 {
            let sink = sink(&url, &ks, atomicity).await;
            writers.push(tokio::spawn(async move {
                let field = format!("race/{partition}");
                let epoch = sink.next_epoch(GROUP, &field, 1).await.expect("epoch");
                sink.stamp_fence(GROUP, &field, epoch).await.expect("stamp");
                let deltas = [("hot:1".to_owned(), 1)];
                // Both write this minute; each also writes a minute of its own.
                let windows = [
                    bucket("hot:1", minute, 1),
                    bucket("hot:1", minute - (1 + partition) * MINUTE_MS, 1),
                ];
                for i in 0..WRITES {
                    let write = GroupWrite {
                        group: GROUP,
                        field: &field,
                        epoch,
                        expected_ledger: i - 1,
                        next_offset: i,
                        deltas: &deltas,
                        windows: &windows,
                        resets: &[],
                        members: Likes::NONE,
                        watermark: None,
                    };
                    let applied = sink.apply_fenced(write).await.expect("write");
                    assert_eq!(applied, Applied::Written, "{field} write {i}");
                }
            }));
        }
        for writer in writers {
            writer.await.expect("writer");
        }
        let mut conn = tally_tests::connect(&url).await;
        let total: i64 = conn.get(ks.counter_key(GROUP, "hot:1")).await.expect("GET");
        let held: String = conn
            .hget(ks.cells_key(GROUP, "hot:1"), "hot:1")
            .await
            .expect("HGET");
        let index = minute / MINUTE_MS;
        assert_eq!(
            (total, held),
            (
                2 * WRITES,
                format!(
                    "1m={index}:{},{}:{WRITES},{}:{WRITES}",
                    2 * WRITES,
                    index - 1,
                    index - 2
                )
            ),
            "{atomicity:?}"
        );
    }
}

/// How many `HMGET`s the server has run, in scripts or not (`INFO commandstats`).
async fn hmget_calls(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    (info.lines())
        .find_map(|l| l.strip_prefix("cmdstat_hmget:calls="))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// A writer that has learnt to write its cells without reading them (it remembers what it
/// wrote) still counts exactly when they change behind it: another writer adds to a bucket, the
/// hash is deleted (as when it expires), a field holds junk. Each write lands once, with what
/// the field held, through the flush script and the at-least-once cells script; that the writer
/// did skip its read is seen in the server's count of `HMGET`s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remembered_cells_changed_behind_the_writer_are_read_again() {
    let redis = RedisServer::start().await;
    let url = redis.url();
    let now = tally_common::event::now_ms();
    let minute = now - now % MINUTE_MS;
    let index = minute / MINUTE_MS;
    for exactly_once in [true, false] {
        let (sink, ks, epoch) = fenced_sink(&redis, Atomicity::Scripts).await;
        let mut conn = tally_tests::connect(&url).await;
        let hash = ks.cells_key(GROUP, "tail:1");
        let mut offset = 0;
        let mut apply = async |windows: &[WindowDelta]| {
            if exactly_once {
                let write = GroupWrite {
                    expected_ledger: offset - 1,
                    next_offset: offset,
                    ..write(epoch, &[], windows, Likes::NONE)
                };
                offset += 1;
                match sink.apply_fenced(write).await.expect("write") {
                    Applied::Written => Vec::new(),
                    Applied::Rejected(rejections) => {
                        // Nothing landed: the write goes again without what was refused.
                        offset -= 1;
                        rejections
                    }
                    other => panic!("write: {other:?}"),
                }
            } else {
                sink.apply(GROUP, &[], windows, &[]).await.expect("write")
            }
        };
        // New fields (nothing there, as predicted), then the same field again and again: the
        // writer comes to trust what it remembers.
        for i in 0..2 * tally_aggregator::store::recall::TRUST_AFTER {
            apply(&[bucket(&format!("new:{i}"), minute, 1)]).await;
        }
        for _ in 0..2 * tally_aggregator::store::recall::TRUST_AFTER {
            apply(&[bucket("tail:1", minute, 1)]).await;
        }
        let mut expected = 2 * i64::from(tally_aggregator::store::recall::TRUST_AFTER);
        // By now it writes without reading: the script's check is the write's only HMGET.
        let counts = || sink.recall_counts().expect("a Redis sink remembers cells");
        let (before, counted) = (hmget_calls(&mut conn).await, counts());
        apply(&[bucket("tail:1", minute, 1)]).await;
        expected += 1;
        assert_eq!(
            hmget_calls(&mut conn).await - before,
            1,
            "a trusted write reads"
        );
        // Its metrics: one write predicted, none found stale.
        let now = counts();
        assert_eq!(now.predicted_writes - counted.predicted_writes, 1);
        assert_eq!(now.mispredicted_writes, counted.mispredicted_writes);
        assert!(now.fields > 2 * tally_aggregator::store::recall::TRUST_AFTER as usize);
        // Another writer adds 5; then the writer adds 1.
        let _: () = conn
            .hset(&hash, "tail:1", format!("1m={index}:{}", expected + 5))
            .await
            .expect("HSET");
        let (before, counted) = (hmget_calls(&mut conn).await, counts());
        apply(&[bucket("tail:1", minute, 1)]).await;
        expected += 6;
        // Found stale by the script's check, read, and checked again: a prediction that missed.
        assert_eq!(hmget_calls(&mut conn).await - before, 3);
        let now = counts();
        assert_eq!(now.predicted_writes - counted.predicted_writes, 1);
        assert_eq!(now.mispredicted_writes - counted.mispredicted_writes, 1);
        let held: Option<String> = conn.hget(&hash, "tail:1").await.expect("HGET");
        assert_eq!(held, Some(format!("1m={index}:{expected}")));
        // The hash goes (expired): the next write starts from nothing.
        let _: () = conn.del(&hash).await.expect("DEL");
        apply(&[bucket("tail:1", minute, 2)]).await;
        let held: Option<String> = conn.hget(&hash, "tail:1").await.expect("HGET");
        assert_eq!(held, Some(format!("1m={index}:2")));
        // A field that is not cells: its delta is refused, by what Redis holds.
        let _: () = conn.hset(&hash, "tail:1", "junk").await.expect("HSET");
        let refused = apply(&[bucket("tail:1", minute, 1)]).await;
        assert_eq!(
            sorted(refused),
            [(Refused::Window(0), "not_an_integer".to_owned())]
        );
        let held: Option<String> = conn.hget(&hash, "tail:1").await.expect("HGET");
        assert_eq!(held.as_deref(), Some("junk"));
        // The new fields each hold their one event.
        for i in 0..2 * tally_aggregator::store::recall::TRUST_AFTER {
            let counter = format!("new:{i}");
            let held: Option<String> = (conn.hget(ks.cells_key(GROUP, &counter), &counter))
                .await
                .expect("HGET");
            assert_eq!(held, Some(format!("1m={index}:1")));
        }
    }
}

/// A write that changes more fields of one hash than Lua's `unpack` gives at once (about 8,000
/// values: here a deployment with one cells hash per group) lands whole through both scripts,
/// its deletions too: the scripts check, set and delete the fields in slices.
#[tokio::test]
async fn a_write_of_thousands_of_fields_into_one_hash_lands_whole() {
    let redis = RedisServer::start().await;
    let now = tally_common::event::now_ms();
    let minute = now - now % MINUTE_MS;
    let index = minute / MINUTE_MS;
    for exactly_once in [true, false] {
        let ks = Keyspace::new(unique("wide"), 1)
            .expect("keyspace")
            .with_cells_stripes(1);
        let sink = sink(&redis.url(), &ks, Atomicity::Scripts).await;
        let epoch = sink.next_epoch(GROUP, FIELD, 1).await.expect("epoch");
        sink.stamp_fence(GROUP, FIELD, epoch).await.expect("stamp");
        let mut conn = tally_tests::connect(&redis.url()).await;
        let counters: Vec<String> = (0..9_000).map(|i| format!("wide:{i}")).collect();
        let hash = ks.cells_key(GROUP, &counters[0]);
        let mut offset = 0;
        // Each counter once into the minute, then once out of it (its field is deleted).
        for delta in [1, -1] {
            let windows: Vec<WindowDelta> = (counters.iter())
                .map(|c| bucket(c, minute, delta))
                .collect();
            if exactly_once {
                let write = GroupWrite {
                    expected_ledger: offset - 1,
                    next_offset: offset,
                    ..write(epoch, &[], &windows, Likes::NONE)
                };
                offset += 1;
                let applied = sink.apply_fenced(write).await.expect("write");
                assert_eq!(applied, Applied::Written);
            } else {
                let refused = sink.apply(GROUP, &[], &windows, &[]).await.expect("write");
                assert!(refused.is_empty(), "{refused:?}");
            }
            let held: Vec<Option<String>> = redis::cmd("HMGET")
                .arg(&hash)
                .arg(&counters)
                .query_async(&mut conn)
                .await
                .expect("HMGET");
            let want = (delta == 1).then(|| format!("1m={index}:1"));
            assert!(held.iter().all(|v| *v == want), "after {delta}: {want:?}");
        }
        let len: usize = conn.hlen(&hash).await.expect("HLEN");
        assert_eq!(len, 0, "every field deleted");
    }
}

/// Likes counted by their sets written before the script (the default on a standalone server)
/// land only where the script takes the rest: not while Redis refuses writes (out of memory,
/// read-only: the whole transaction is refused), not again once landed (a later change to a set
/// stays), and never from an owner whose fence was taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sets_written_before_the_script_land_once_and_only_for_the_owner() {
    let redis = RedisServer::start().await;
    let ks = Keyspace::new(unique("before"), 1)
        .expect("keyspace")
        .with_likes_by_set(tally_common::keyspace::LikesBySet {
            listed: Vec::new(),
            others: true,
            every_dedup: true,
            in_shares: false,
        });
    let (sink, epoch) = fenced_sink_in(&redis, &ks, Atomicity::Auto).await;
    // Batches weigh memberships by what they cost here: more to an entry than through the
    // script.
    assert_eq!(
        sink.memberships_per_entry(),
        MEMBERSHIPS_PER_ENTRY_BEFORE_SCRIPT
    );
    for atomicity in [Atomicity::Scripts, Atomicity::Transactions] {
        let other = crate::sink(&redis.url(), &ks, atomicity).await;
        assert_eq!(
            other.memberships_per_entry(),
            MEMBERSHIPS_PER_ENTRY,
            "{atomicity:?}"
        );
    }
    let in_shares = Keyspace::new(unique("shares"), 1).expect("keyspace");
    let shares = crate::sink(&redis.url(), &in_shares, Atomicity::Auto).await;
    assert_eq!(shares.memberships_per_entry(), MEMBERSHIPS_PER_ENTRY);
    let mut conn = tally_tests::connect(&redis.url()).await;
    let members = Likes::from_actions([
        ("post:1", "u1", true),
        ("post:1", "u2", true),
        ("post:2", "u1", true),
    ]);
    let set = |counter: &str| ks.count_set_key(GROUP, counter);
    let ledger = || async {
        let mut conn = tally_tests::connect(&redis.url()).await;
        let entry: Option<i64> = conn.hget(ks.ledger_key(GROUP), FIELD).await.expect("HGET");
        entry
    };
    for (refuse, undo) in [
        (
            vec!["CONFIG", "SET", "maxmemory", "1"],
            vec!["CONFIG", "SET", "maxmemory", "0"],
        ),
        (
            vec!["REPLICAOF", "127.0.0.1", "1"],
            vec!["REPLICAOF", "NO", "ONE"],
        ),
    ] {
        let _: () = redis::cmd(refuse[0])
            .arg(&refuse[1..])
            .query_async(&mut conn)
            .await
            .expect("refuse");
        let failed = sink.apply_fenced(write(epoch, &[], &[], &members)).await;
        let _: () = redis::cmd(undo[0])
            .arg(&undo[1..])
            .query_async(&mut conn)
            .await
            .expect("undo");
        assert!(failed.is_err(), "{refuse:?}: {failed:?}");
        let sizes: (i64, i64) = (
            conn.scard(set("post:1")).await.expect("SCARD"),
            conn.scard(set("post:2")).await.expect("SCARD"),
        );
        assert_eq!(sizes, (0, 0), "{refuse:?}");
        assert_eq!(ledger().await, None, "{refuse:?}");
    }
    let applied = sink
        .apply_fenced(write(epoch, &[], &[], &members))
        .await
        .expect("write");
    assert_eq!(applied, Applied::Written);
    assert_eq!(ledger().await, Some(10));
    // A later unlike (by hand here): the same write tried again is found done, and writes
    // nothing.
    let _: () = conn.srem(set("post:1"), "u2").await.expect("SREM");
    let again = sink
        .apply_fenced(write(epoch, &[], &[], &members))
        .await
        .expect("write");
    assert_eq!(again, Applied::AlreadyApplied);
    let members_now: Vec<String> = conn.smembers(set("post:1")).await.expect("SMEMBERS");
    assert_eq!(members_now, vec!["u1".to_owned()]);
    // A Redis that forgot its scripts (a restart, SCRIPT FLUSH) refuses the EVALSHA inside the
    // transaction, after the sets: the script is loaded and the whole written again, once.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .expect("SCRIPT FLUSH");
    let next = Likes::from_actions([("post:2", "u1", false), ("post:2", "u3", true)]);
    let mut after_flush = write(epoch, &[], &[], &next);
    (after_flush.expected_ledger, after_flush.next_offset) = (10, 15);
    let applied = sink.apply_fenced(after_flush).await.expect("write");
    assert_eq!(applied, Applied::Written);
    let post_2: Vec<String> = conn.smembers(set("post:2")).await.expect("SMEMBERS");
    assert_eq!(post_2, vec!["u3".to_owned()]);
    assert_eq!(ledger().await, Some(15));
    // A new owner takes the fence: the former one's next write is refused before its sets.
    let newer = sink
        .next_epoch(GROUP, FIELD, epoch + 1)
        .await
        .expect("epoch");
    let stamp = sink.stamp_fence(GROUP, FIELD, newer).await.expect("stamp");
    assert_eq!(stamp, Stamp::Stamped { ledger: 15 });
    let later = Likes::from_actions([("post:3", "u9", true)]);
    let mut zombie = write(epoch, &[], &[], &later);
    (zombie.expected_ledger, zombie.next_offset) = (15, 20);
    let refused = sink.apply_fenced(zombie).await.expect("write");
    assert_eq!(refused, Applied::Fenced);
    let landed: bool = conn.exists(set("post:3")).await.expect("EXISTS");
    assert!(!landed, "a fenced writer's like landed");
    assert_eq!(ledger().await, Some(15));
}

/// In auto mode the sink asks the server at start whether it runs scripts (before any write):
/// one that refuses them gets transactions, whose batches are cut per group for `WATCH`'s sake;
/// one that runs them keeps scripts and uncut batches. Forced modes need no asking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_mode_asks_at_start_and_cuts_batches_only_for_transactions() {
    let redis = RedisServer::start().await;
    let keyspace = Keyspace::new(unique("probe"), 4).expect("keyspace");
    let without_scripts = redis.user_without_scripts().await;

    let scripts = sink(&redis.url(), &keyspace, Atomicity::Auto).await;
    scripts.probe_scripts().await;
    assert_eq!(scripts.max_group_entries(), usize::MAX, "scripts run here");

    let refused = sink(&without_scripts, &keyspace, Atomicity::Auto).await;
    assert_eq!(refused.max_group_entries(), usize::MAX, "not asked yet");
    refused.probe_scripts().await;
    assert_eq!(refused.max_group_entries(), TRANSACTION_GROUP_ENTRIES);

    let forced = sink(&redis.url(), &keyspace, Atomicity::Transactions).await;
    assert_eq!(forced.max_group_entries(), TRANSACTION_GROUP_ENTRIES);
    // Scripts only: refused scripts are an error, never a switch.
    let scripts_only = sink(&without_scripts, &keyspace, Atomicity::Scripts).await;
    scripts_only.probe_scripts().await;
    assert_eq!(scripts_only.max_group_entries(), usize::MAX);
}
