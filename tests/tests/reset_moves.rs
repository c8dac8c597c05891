//! A reset racing a compaction move of its counter, against a real `redis-server`, through both
//! ways of writing a group (the flush script and the `WATCH`/`MULTI` transactions). A reset is
//! one write per group, so it can reach the move's two groups on either side of the move's take;
//! here each order is laid out by writing the reset into one group at a time, as an aggregator
//! that stops between two groups' writes leaves it:
//! - the base group has the reset and the source not yet when the share is taken: the amount
//!   predates the reset and is dropped, not added back;
//! - the source had the reset (and an increment after it) and the base not yet: the give waits
//!   until the base applies it, so the increment is not cleared with the base share;
//! - the reset everywhere before the take: the increment after it is moved as usual.
//!
//! Then the compactor closes, and no mark or record of resets is left in any group. A group keeps
//! each partition's last reset of a counter, not only its last: a reset of another partition,
//! applied before, still drops what predates it. And a compactor starting while a flush has
//! reached one group and not the other waits, once it has marked every group, until the flush
//! ends everywhere (the partition's watermark passes it).

use std::collections::HashMap;
use std::time::Duration;

use redis::AsyncCommands;
use tally_aggregator::RedisSink;
use tally_aggregator::machine::batch::Reset;
use tally_aggregator::machine::likes::Likes;
use tally_aggregator::operator::config::Atomicity;
use tally_aggregator::store::sink::{Applied, GroupWrite, Sink, Stamp};
use tally_aggregator::tasks::compact::{CompactError, Compactor};
use tally_common::keyspace::{Spread, Watermark};
use tally_common::layout::MOVING_FIELD;
use tally_common::{Keyspace, Namespaces, RedisConn, RedisTarget};
use tally_tests::{RedisServer, eventually, unique};

const FIELD: &str = "moves/0";
const GROUPS: u32 = 2;

/// A sink writing `ks` by `atomicity`, holding the fence of one partition (`field`, [`FIELD`]
/// unless said) in every group, and the groups' ledger entries as it last wrote them.
struct Writer {
    sink: RedisSink,
    field: &'static str,
    epoch: u64,
    ledgers: HashMap<u32, i64>,
}

impl Writer {
    async fn new(url: &str, ks: &Keyspace, atomicity: Atomicity) -> Self {
        Self::of(url, ks, atomicity, FIELD).await
    }

    async fn of(url: &str, ks: &Keyspace, atomicity: Atomicity, field: &'static str) -> Self {
        let conn = RedisConn::connect(url).await.expect("redis");
        let target = RedisTarget::parse(url).expect("target");
        let sink = RedisSink::new(conn, &target, ks.clone(), atomicity).expect("sink");
        let epoch = sink.next_epoch(0, field, 1).await.expect("epoch");
        for group in 0..GROUPS {
            let stamp = sink.stamp_fence(group, field, epoch).await.expect("stamp");
            assert_eq!(stamp, Stamp::Stamped { ledger: -1 });
        }
        Self {
            sink,
            field,
            epoch,
            ledgers: HashMap::new(),
        }
    }

    /// Writes into `group` up to `next`: `resets` (each at its offset) first, then `deltas`.
    async fn write(
        &mut self,
        group: u32,
        next: i64,
        resets: &[(&str, i64)],
        deltas: &[(&str, i64)],
    ) {
        let deltas: Vec<(String, i64)> = deltas.iter().map(|(c, d)| ((*c).into(), *d)).collect();
        let resets: Vec<Reset> = resets.iter().map(|&(c, o)| Reset::new(c, o)).collect();
        let ledger = self.ledgers.get(&group).copied().unwrap_or(-1);
        let write = GroupWrite {
            group,
            field: self.field,
            epoch: self.epoch,
            expected_ledger: ledger,
            next_offset: next,
            deltas: &deltas,
            windows: &[],
            resets: &resets,
            members: Likes::NONE,
            watermark: None,
        };
        let applied = self.sink.apply_fenced(write).await.expect("write");
        assert_eq!(applied, Applied::Written, "group {group} up to {next}");
        self.ledgers.insert(group, next);
    }

    /// Records that everything before `next` is in every group.
    async fn watermark(&self, next: i64) {
        let ledgers: Vec<i64> = (0..GROUPS)
            .map(|g| self.ledgers.get(&g).copied().unwrap_or(-1))
            .collect();
        let watermark = Watermark::new(next, &ledgers, Spread::uniform(GROUPS)).encode();
        let applied = (self.sink)
            .write_watermark(0, self.field, self.epoch, &watermark)
            .await
            .expect("watermark");
        assert_eq!(applied, Applied::Written);
    }
}

/// A counter whose base group is `base`.
fn counter_in(ks: &Keyspace, name: &str, base: u32) -> String {
    (0..)
        .map(|i| format!("{name}:{i}"))
        .find(|c| ks.shard_group(c, 0) == base)
        .expect("a counter")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_on_either_side_of_a_take_is_neither_undone_nor_undoes_the_move() {
    let redis = RedisServer::start().await;
    for atomicity in [Atomicity::Scripts, Atomicity::Transactions] {
        races(&redis, atomicity).await;
    }
}

async fn races(redis: &RedisServer, atomicity: Atomicity) {
    let ks = Keyspace::new(unique("reset-moves"), GROUPS).expect("keyspace");
    let mut admin = tally_tests::connect(&redis.url()).await;
    let reader = redis.reader(ks.clone()).await;
    let mut writer = Writer::new(&redis.url(), &ks, atomicity).await;
    let (base, source) = (0, 1);
    let [undone, kept, plain] = ["undone", "kept", "plain"].map(|n| counter_in(&ks, n, base));

    // Each counter has 5 in its base group; `undone` also 10 in the other.
    let shares: Vec<(&str, i64)> = [&undone, &kept, &plain]
        .iter()
        .map(|c| (c.as_str(), 5))
        .collect();
    writer.write(base, 10, &[], &shares).await;
    writer.write(source, 10, &[], &[(&undone, 10)]).await;
    writer.watermark(10).await;
    let conn = RedisConn::connect(&redis.url()).await.expect("redis");
    let compactor = Compactor::start(
        conn,
        ks.clone(),
        std::sync::Arc::new(Namespaces::default()),
        Duration::ZERO,
    )
    .await
    .expect("a compactor");
    let epoch = compactor.epoch().to_string();
    for group in 0..GROUPS {
        let mark: Option<String> = admin
            .hget(ks.fence_key(group), MOVING_FIELD)
            .await
            .expect("HGET");
        // `<epoch> <deadline>`: the deadline in ms by the server's clock, a lease from now.
        let (held_by, _deadline) = mark
            .as_deref()
            .and_then(|m| m.split_once(' '))
            .expect("a mark");
        assert_eq!(held_by, epoch, "{atomicity:?}");
    }

    // The base group clears `undone` (reset at 12) and the source does not yet: the move takes
    // 10 that the reset cleared everywhere else.
    writer.write(base, 20, &[(&undone, 12)], &[]).await;
    let record: Option<String> = admin
        .hget(ks.resets_key(base), ks.counter_key(base, &undone))
        .await
        .expect("HGET");
    assert_eq!(record.as_deref(), Some("moves/0 12"), "{atomicity:?}");
    let report = compactor.pass().await.expect("a pass");
    assert!(report.moves >= 1, "{atomicity:?}: {report:?}");
    assert_eq!(compactor.cancelled(), 1, "{atomicity:?}: {report:?}");
    assert_eq!(report.dropped, 1, "{atomicity:?}: {report:?}");
    assert_eq!(reader.get(&undone).await.expect("read"), 0, "{atomicity:?}");
    writer.write(source, 20, &[(&undone, 12)], &[]).await;
    writer.watermark(20).await;
    assert_eq!(reader.get(&undone).await.expect("read"), 0, "{atomicity:?}");

    // The source clears `kept` (reset at 22) and counts 4 after it; the base has not applied
    // the reset when the move takes the 4: its give waits for the base, or the reset would
    // clear the 4 with the base's 5.
    writer
        .write(source, 30, &[(&kept, 22)], &[(&kept, 4)])
        .await;
    let journal = ks.journal_key(source, &kept);
    let base_catches_up = async {
        eventually(Duration::from_secs(30), "the move's take", || {
            let (mut admin, journal) = (admin.clone(), journal.clone());
            async move {
                let taken: bool = admin.exists(&journal).await.ok()?;
                taken.then_some(())
            }
        })
        .await;
        writer.write(base, 30, &[(&kept, 22)], &[]).await;
        writer.watermark(30).await;
    };
    let (report, ()) = tokio::join!(compactor.pass(), base_catches_up);
    let report = report.expect("a pass");
    assert!(report.moves >= 1, "{atomicity:?}: {report:?}");
    assert_eq!(reader.get(&kept).await.expect("read"), 4, "{atomicity:?}");
    let left: Option<String> = admin.get(&journal).await.expect("GET");
    assert_eq!(left, None, "{atomicity:?}: the move finished");

    // Reset everywhere (at 32), then 7 in the source: the 7 is moved.
    writer.write(base, 40, &[(&plain, 32)], &[]).await;
    writer.write(source, 40, &[(&plain, 32)], &[]).await;
    writer.write(source, 50, &[], &[(&plain, 7)]).await;
    writer.watermark(50).await;
    let cancelled = compactor.cancelled();
    compactor.pass().await.expect("a pass");
    assert_eq!(compactor.cancelled(), cancelled, "{atomicity:?}");
    assert_eq!(reader.get(&plain).await.expect("read"), 7, "{atomicity:?}");
    let moved: Option<i64> = admin.get(ks.counter_key(base, &plain)).await.expect("GET");
    assert_eq!(moved, Some(7), "{atomicity:?}: one key, in the base group");

    compactor.close().await.expect("close");
    for group in 0..GROUPS {
        let mark: bool = (admin.hexists(ks.fence_key(group), MOVING_FIELD))
            .await
            .expect("HEXISTS");
        let records: bool = admin.exists(ks.resets_key(group)).await.expect("EXISTS");
        assert!(!mark && !records, "{atomicity:?}: group {group} keeps them");
    }
    // A reset with no compactor running records nothing.
    writer.write(base, 60, &[(&plain, 55)], &[]).await;
    let records: bool = admin.exists(ks.resets_key(base)).await.expect("EXISTS");
    assert!(!records, "{atomicity:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compactor_waits_for_writes_some_groups_have_not_applied_yet() {
    let redis = RedisServer::start().await;
    let ks = Keyspace::new(unique("reset-settle"), GROUPS).expect("keyspace");
    let mut admin = tally_tests::connect(&redis.url()).await;
    let mut writer = Writer::new(&redis.url(), &ks, Atomicity::Scripts).await;
    let counter = counter_in(&ks, "settle", 0);
    writer.write(0, 10, &[], &[(&counter, 1)]).await;
    writer.write(1, 10, &[], &[(&counter, 1)]).await;
    writer.watermark(10).await;
    // A flush up to 20 that reached group 0 (a reset among it) and not yet group 1: a
    // compactor marks every group, then waits until the partition's watermark passes 20.
    writer.write(0, 20, &[(&counter, 15)], &[]).await;
    let conn = RedisConn::connect(&redis.url()).await.expect("redis");
    let namespaces = std::sync::Arc::new(Namespaces::default());
    let mut start = tokio::spawn(Compactor::start(
        conn,
        ks.clone(),
        namespaces,
        Duration::ZERO,
    ));
    eventually(Duration::from_secs(30), "every group marked", || {
        let (mut admin, ks) = (admin.clone(), ks.clone());
        async move {
            for group in 0..GROUPS {
                let mark: Option<String> =
                    admin.hget(ks.fence_key(group), MOVING_FIELD).await.ok()?;
                mark?;
            }
            Some(())
        }
    })
    .await;
    let waited = tokio::time::timeout(Duration::from_millis(500), &mut start).await;
    assert!(
        waited.is_err(),
        "the compactor started before the flush ended"
    );
    writer.write(1, 20, &[(&counter, 15)], &[]).await;
    writer.watermark(20).await;
    let compactor = start.await.expect("task").expect("a compactor");
    compactor.close().await.expect("close");
    let mark: Option<String> = admin
        .hget(ks.fence_key(0), MOVING_FIELD)
        .await
        .expect("HGET");
    assert_eq!(mark, None);
}

/// Unkeyed traffic resets a counter from several partitions, and a group may have applied one
/// partition's reset and not another's. Here the base group applied partition 1's reset (at 12)
/// and then partition 0's (at 22); the source applied only partition 0's, and then counted 3 of
/// partition 1's events from before its reset. The move takes those 3: they predate a reset the
/// base group applied, so they are dropped, and once partition 1's reset reaches the source the
/// counter is 0, as without the move. A group that recorded only its last reset (partition
/// 0's, which the source had applied) gave the 3 to the base group, where they stayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_from_another_partition_is_not_undone_by_a_later_one() {
    let redis = RedisServer::start().await;
    for atomicity in [Atomicity::Scripts, Atomicity::Transactions] {
        let ks = Keyspace::new(unique("reset-partitions"), GROUPS).expect("keyspace");
        let mut admin = tally_tests::connect(&redis.url()).await;
        let reader = redis.reader(ks.clone()).await;
        let url = redis.url();
        let mut first = Writer::of(&url, &ks, atomicity, "moves/0").await;
        let mut second = Writer::of(&url, &ks, atomicity, "moves/1").await;
        let (base, source) = (0, 1);
        let counter = counter_in(&ks, "two", base);
        first.write(base, 10, &[], &[(&counter, 5)]).await;
        first.write(source, 10, &[], &[]).await;
        first.watermark(10).await;
        second.write(base, 5, &[], &[]).await;
        second.write(source, 5, &[], &[]).await;
        second.watermark(5).await;
        let conn = RedisConn::connect(&url).await.expect("redis");
        let namespaces = std::sync::Arc::new(Namespaces::default());
        let compactor = Compactor::start(conn, ks.clone(), namespaces, Duration::ZERO)
            .await
            .expect("a compactor");

        second.write(base, 20, &[(&counter, 12)], &[]).await;
        first.write(base, 30, &[(&counter, 22)], &[]).await;
        first.write(source, 30, &[(&counter, 22)], &[]).await;
        second.write(source, 10, &[], &[(&counter, 3)]).await;
        let record: Option<String> = admin
            .hget(ks.resets_key(base), ks.counter_key(base, &counter))
            .await
            .expect("HGET");
        assert_eq!(
            record.as_deref(),
            Some("moves/1 12;moves/0 22"),
            "{atomicity:?}"
        );
        assert_eq!(
            reader.get(&counter).await.expect("read"),
            3,
            "{atomicity:?}"
        );

        let report = compactor.pass().await.expect("a pass");
        assert_eq!(compactor.cancelled(), 1, "{atomicity:?}: {report:?}");
        assert_eq!(
            reader.get(&counter).await.expect("read"),
            0,
            "{atomicity:?}"
        );
        second.write(source, 20, &[(&counter, 12)], &[]).await;
        assert_eq!(
            reader.get(&counter).await.expect("read"),
            0,
            "{atomicity:?}"
        );
        compactor.close().await.expect("close");
    }
}

/// A compactor renews its groups' moving marks while it runs; one killed leaves them, and they
/// lapse a lease after its last renewal: resets record nothing more (before, each reset or
/// expiry added a field per group until the next compactor ran). And a compactor whose mark
/// lapsed while it lived (a stall past its lease, laid out here by moving the mark's deadline
/// into the past) moves nothing in that group, since resets there may have gone unrecorded: its
/// pass fails, and a compactor started again marks, settles and moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_lapse_when_their_compactor_stops_renewing_them() {
    let redis = RedisServer::start().await;
    let lease_ms: u64 = 1_500;
    let lease = Duration::from_millis(lease_ms);
    for atomicity in [Atomicity::Scripts, Atomicity::Transactions] {
        let ks = Keyspace::new(unique("reset-lease"), GROUPS).expect("keyspace");
        let mut admin = tally_tests::connect(&redis.url()).await;
        let reader = redis.reader(ks.clone()).await;
        let mut writer = Writer::new(&redis.url(), &ks, atomicity).await;
        let (base, source) = (0, 1);
        let [reset, moved] = ["reset", "moved"].map(|n| counter_in(&ks, n, base));
        writer.write(base, 10, &[], &[(&reset, 5)]).await;
        writer.write(source, 10, &[], &[(&reset, 2)]).await;
        writer.watermark(10).await;
        let start = || async {
            let conn = RedisConn::connect(&redis.url()).await.expect("redis");
            let namespaces = std::sync::Arc::new(Namespaces::default());
            Compactor::start_with_lease(conn, ks.clone(), namespaces, Duration::ZERO, lease)
                .await
                .expect("a compactor")
        };
        let records = admin.clone();
        let recorded = |group: u32| {
            let (mut admin, key, field) = (
                records.clone(),
                ks.resets_key(group),
                ks.counter_key(group, &reset),
            );
            async move {
                let record: Option<String> = admin.hget(key, field).await.expect("HGET");
                record
            }
        };

        // Renewed: past where the first mark and one renewal would have lapsed, the marks still
        // hold, and a reset records itself.
        let compactor = start().await;
        let first = mark_and_clock(&admin, &ks, base).await.0;
        eventually(Duration::from_secs(30), "two leases renewed", || async {
            let (deadline, now) = mark_and_clock(&admin, &ks, base).await;
            (now > first + lease_ms && deadline >= now).then_some(())
        })
        .await;
        writer.write(base, 20, &[(&reset, 12)], &[]).await;
        assert_eq!(
            recorded(base).await.as_deref(),
            Some("moves/0 12"),
            "{atomicity:?}"
        );
        // Dropped without closing, as if killed: its marks stay, lapse, and record nothing.
        drop(compactor);
        eventually(Duration::from_secs(30), "the marks lapsed", || async {
            let (deadline, now) = mark_and_clock(&admin, &ks, source).await;
            (now > deadline).then_some(())
        })
        .await;
        writer.write(source, 20, &[(&reset, 12)], &[]).await;
        assert_eq!(recorded(source).await, None, "{atomicity:?}");
        assert_eq!(reader.get(&reset).await.expect("read"), 0, "{atomicity:?}");

        // A live compactor whose mark on the source group lapsed takes nothing there.
        writer.write(source, 30, &[], &[(&moved, 3)]).await;
        writer.watermark(30).await;
        let stalled = start().await;
        let lapsed = format!("{} 1", stalled.epoch());
        let () = (admin.hset(ks.fence_key(source), MOVING_FIELD, lapsed))
            .await
            .expect("HSET");
        let failed = stalled.pass().await;
        assert!(
            matches!(failed, Err(CompactError::Lapsed)),
            "{atomicity:?}: {failed:?}"
        );
        let share: Option<i64> = admin
            .get(ks.counter_key(source, &moved))
            .await
            .expect("GET");
        assert_eq!(share, Some(3), "{atomicity:?}: nothing taken");
        drop(stalled);
        let again = start().await;
        let report = again.pass().await.expect("a pass");
        assert!(report.moves >= 1, "{atomicity:?}: {report:?}");
        let share: Option<i64> = admin.get(ks.counter_key(base, &moved)).await.expect("GET");
        assert_eq!(share, Some(3), "{atomicity:?}: moved to the base group");
        assert_eq!(reader.get(&moved).await.expect("read"), 3, "{atomicity:?}");
        again.close().await.expect("close");
    }
}

/// The deadline of `group`'s moving mark (which must be there) and the server's clock, in ms.
async fn mark_and_clock(
    admin: &redis::aio::MultiplexedConnection,
    ks: &Keyspace,
    group: u32,
) -> (u64, u64) {
    let (mark, (seconds, micros)): (String, (u64, u64)) = redis::pipe()
        .hget(ks.fence_key(group), MOVING_FIELD)
        .cmd("TIME")
        .query_async(&mut admin.clone())
        .await
        .expect("the mark and TIME");
    let deadline = (mark.split_once(' ').and_then(|(_, d)| d.parse().ok()))
        .unwrap_or_else(|| panic!("a mark with a deadline: {mark}"));
    (deadline, seconds * 1000 + micros / 1000)
}
