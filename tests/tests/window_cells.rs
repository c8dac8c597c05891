//! The window cells' upkeep against a real `redis-server`, through the `tally` binary: `tally
//! windows migrate` folds the keys of the layout before cells (a key per bucket) into the cells
//! exactly once, keeping what the cells already held and leaving keys that are not integers;
//! `tally windows sweep` drops expired buckets, and the fields left empty, by the windows the
//! namespace file gives. Both work in a deployment that kept its cells before their number of
//! stripes was recorded, and in one that records it; an aggregator keeps each deployment's
//! cells in the stripes it began with.

use std::process::Command;
use std::time::Duration;

use redis::AsyncCommands;
use tally_common::layout::record_cells_stripes;
use tally_common::window::Window;
use tally_common::window::cells::{Cells, DEFAULT_STRIPES, LEGACY_STRIPES};
use tally_common::{Keyspace, RedisConn};
use tally_producer::{Producer, ProducerConfig};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, binary, brokers, connect, eventually, unique,
};

const MINUTE: i64 = 60_000;
const HOUR: i64 = 60 * MINUTE;

async fn redis_conn(redis: &RedisServer) -> RedisConn {
    RedisConn::connect(&redis.url()).await.expect("redis")
}

/// Runs `tally windows <what>` against the Redis at `url` under `keyspace`; its output.
fn tally_windows(what: &str, url: &str, keyspace: &Keyspace, extra: &[&str]) -> String {
    let out = Command::new(binary("tally"))
        .args(["windows", what])
        .args(["--redis-url", url])
        .args(["--key-prefix", keyspace.prefix()])
        .args(["--shard-groups", &keyspace.groups().to_string()])
        .args(extra)
        .output()
        .expect("tally runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "tally windows {what}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_bucket_keys_are_folded_into_cells_once() {
    let redis = RedisServer::start().await;
    // Into the stripes of a deployment that kept cells before their number was recorded, and
    // into those a newer one records.
    for legacy in [true, false] {
        fold_old_bucket_keys(&redis.url(), legacy).await;
    }
}

/// The same on a 3-master Redis Cluster, the old keys of 4 groups spread over its nodes: each
/// node is walked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_bucket_keys_are_folded_into_cells_once_on_a_cluster() {
    let cluster = tally_tests::RedisCluster::start().await;
    for legacy in [true, false] {
        fold_old_bucket_keys(&cluster.url(), legacy).await;
    }
}

async fn fold_old_bucket_keys(url: &str, legacy: bool) {
    let keyspace = Keyspace::new(unique("migrate"), 4).expect("keyspace");
    let mut conn = RedisConn::connect(url).await.expect("redis");
    let layout = if legacy {
        keyspace.clone().with_cells_stripes(LEGACY_STRIPES)
    } else {
        // As the first aggregator records it.
        let recorded = record_cells_stripes(&conn, &keyspace).await;
        recorded.expect("recorded")
    };
    assert_eq!(
        layout.cells_stripes(),
        if legacy { 64 } else { DEFAULT_STRIPES }
    );
    let now = tally_common::event::now_ms();
    let (minute, hour) = (now - now % MINUTE, now - now % HOUR);
    let expires = now + 48 * HOUR;
    // views:a has buckets in groups 0 and 2; in group 0 its cells already hold 4 this minute
    // (written after the upgrade).
    let old = [
        (0, "views:a", MINUTE, minute, 5),
        (0, "views:a", MINUTE, minute - MINUTE, 7),
        (0, "views:a", HOUR, hour, 12),
        (2, "views:a", MINUTE, minute, 1),
        (1, "views:b", HOUR, hour, 3),
    ];
    for (group, counter, width, start, value) in old {
        let key = keyspace.window_key(group, counter, width, start);
        let _: () = conn.set(&key, value).await.expect("SET");
        let _: bool = conn.pexpire_at(&key, expires).await.expect("PEXPIREAT");
    }
    let junk = keyspace.window_key(3, "views:c", MINUTE, minute);
    let _: () = conn.set(&junk, "abc").await.expect("SET");
    let mut held = Cells::default();
    held.add(MINUTE, minute, 4).expect("no overflow");
    let _: () = conn
        .hset(layout.cells_key(0, "views:a"), "views:a", held.to_string())
        .await
        .expect("HSET");

    let out = tally_windows("migrate", url, &keyspace, &[]);
    assert!(
        out.contains("bucket keys folded: 5, fields written: 3, keys left (not integers): 1"),
        "{out}"
    );
    let reader = tally_tests::reader(url, keyspace.clone()).await;
    let minutes = Window {
        width_ms: MINUTE,
        retention_ms: 48 * MINUTE,
    };
    let hours = Window {
        width_ms: HOUR,
        retention_ms: 48 * HOUR,
    };
    let counters = ["views:a", "views:b", "views:c"];
    let read = |window, n| {
        let (reader, counters) = (&reader, &counters);
        async move {
            (reader.window_sums(counters, window, n, now))
                .await
                .expect("window read")
        }
    };
    assert_eq!(read(minutes, 1).await, [10, 0, 0]);
    assert_eq!(read(minutes, 2).await, [17, 0, 0]);
    assert_eq!(read(hours, 1).await, [12, 3, 0]);
    // Every folded key is gone; the one that is not an integer stays; the hashes expire.
    for (group, counter, width, start, _) in old {
        let key = keyspace.window_key(group, counter, width, start);
        let exists: bool = conn.exists(&key).await.expect("EXISTS");
        assert!(!exists, "{key} folded and deleted");
        let ttl: i64 = conn
            .pttl(layout.cells_key(group, counter))
            .await
            .expect("PTTL");
        assert!(
            ttl > 47 * HOUR,
            "{counter}'s cells expire with its buckets: {ttl}"
        );
    }
    let kept: Option<String> = conn.get(&junk).await.expect("GET");
    assert_eq!(kept.as_deref(), Some("abc"));

    // Run again: nothing left to fold, nothing counted twice.
    let again = tally_windows("migrate", url, &keyspace, &[]);
    assert!(
        again.contains("bucket keys folded: 0, fields written: 0"),
        "{again}"
    );
    assert_eq!(read(minutes, 2).await, [17, 0, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_drops_expired_buckets_by_the_configured_windows() {
    let redis = RedisServer::start().await;
    // In a deployment with no record of its stripes (cells kept before there was one), and in
    // one that records them.
    for legacy in [true, false] {
        sweep_case(&redis, legacy).await;
    }
}

async fn sweep_case(redis: &RedisServer, legacy: bool) {
    let dir = TempDir::new("tally-sweep");
    let namespaces = dir.path().join("namespaces.toml");
    std::fs::write(
        &namespaces,
        "[namespaces.views]\nwindows = [{ width = \"1m\", retention = \"2m\" }, \"1h\"]\n",
    )
    .expect("namespace file");
    let keyspace = Keyspace::new(unique("sweep"), 2).expect("keyspace");
    let mut conn = connect(&redis.url()).await;
    let layout = if legacy {
        keyspace.clone().with_cells_stripes(LEGACY_STRIPES)
    } else {
        let recorded = record_cells_stripes(&redis_conn(redis).await, &keyspace).await;
        recorded.expect("recorded")
    };
    let now = tally_common::event::now_ms();
    let (minute, hour) = (now - now % MINUTE, now - now % HOUR);
    let cells = |buckets: &[(i64, i64, i64)]| {
        let mut cells = Cells::default();
        for (width, start, count) in buckets {
            cells.add(*width, *start, *count).expect("no overflow");
        }
        cells.to_string()
    };
    let fields = [
        // An old minute (ended 5 minutes ago) goes; this minute and the hour stay.
        (
            "views:trimmed",
            cells(&[
                (MINUTE, minute - 6 * MINUTE, 2),
                (MINUTE, minute, 1),
                (HOUR, hour, 3),
            ]),
        ),
        // Only old minutes: the field goes.
        ("views:dead", cells(&[(MINUTE, minute - 10 * MINUTE, 4)])),
        // A namespace that keeps no window (any more): the field goes.
        ("plain:gone", cells(&[(HOUR, hour, 1)])),
        // Live: untouched.
        ("views:live", cells(&[(MINUTE, minute, 9)])),
        // Not cells: left alone.
        ("views:junk", "junk".to_owned()),
    ];
    for (counter, value) in &fields {
        let _: () = conn
            .hset(layout.cells_key(1, counter), counter, value)
            .await
            .expect("HSET");
    }
    let ns = namespaces.to_str().expect("utf-8 path");
    let out = tally_windows("sweep", &redis.url(), &keyspace, &["--namespaces", ns]);
    assert!(
        out.contains("fields read: 5, trimmed: 1, deleted: 2, not cells (left alone): 1"),
        "{out}"
    );
    let field = |counter: &str| {
        let key = layout.cells_key(1, counter);
        let counter = counter.to_owned();
        let mut conn = conn.clone();
        async move {
            let value: Option<String> = conn.hget(key, counter).await.expect("HGET");
            value
        }
    };
    assert_eq!(
        field("views:trimmed").await,
        Some(cells(&[(MINUTE, minute, 1), (HOUR, hour, 3)]))
    );
    assert_eq!(field("views:dead").await, None);
    assert_eq!(field("plain:gone").await, None);
    assert_eq!(field("views:live").await, Some(fields[3].1.clone()));
    assert_eq!(field("views:junk").await, Some("junk".to_owned()));
}

/// Cells stay in the stripes their deployment began with. In one that kept cells before their
/// number was recorded (64 hashes per group), a new aggregator finds them, records 64 and adds
/// to the same fields; in a new deployment it records 512 and spreads the fields over them.
/// Readers go by the record either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cells_stay_in_the_stripes_their_deployment_began_with() {
    let redis = RedisServer::start().await;
    let dir = TempDir::new("tally-stripes");
    let namespaces = dir.path().join("namespaces.toml");
    std::fs::write(&namespaces, "[namespaces.views]\nwindows = [\"1h\"]\n").expect("written");
    let ns = namespaces.to_str().expect("utf-8 path");
    let counters: Vec<String> = (0..200).map(|i| format!("views:video:{i}")).collect();
    let hours = Window {
        width_ms: HOUR,
        retention_ms: 48 * HOUR,
    };
    let mut conn = connect(&redis.url()).await;
    for legacy in [true, false] {
        let setup = AggregatorSetup::create("stripes", &redis.url(), 2).await;
        let keyspace = setup.keyspace();
        let before = if legacy {
            // What an aggregator wrote before the record: 3 in each counter's hour, in its
            // legacy stripe of group 0.
            let old = keyspace.clone().with_cells_stripes(LEGACY_STRIPES);
            let now = tally_common::event::now_ms();
            let mut held = Cells::default();
            held.add(HOUR, now - now % HOUR, 3).expect("no overflow");
            for counter in &counters {
                let _: () = conn
                    .hset(old.cells_key(0, counter), counter, held.to_string())
                    .await
                    .expect("HSET");
            }
            3
        } else {
            0
        };
        let mut aggregator = setup.spawn(dir.path(), &["--namespaces", ns]);
        let producer =
            Producer::new(&ProducerConfig::new(brokers(), &setup.topic)).expect("producer");
        for counter in counters.iter().chain(&counters) {
            producer.add(counter, 1).await.expect("sent");
        }
        let reader = redis.reader(keyspace.clone()).await;
        let expected = vec![before + 2; counters.len()];
        eventually(Duration::from_secs(60), "the window sums", || async {
            let now = tally_common::event::now_ms();
            // The last two hours: the buckets written before and the events' own.
            let sums = reader.window_sums(&counters, hours, 2, now).await.ok()?;
            (sums == expected).then_some(())
        })
        .await;
        let recorded: Option<String> = conn
            .hget(keyspace.layout_key(), "cells_stripes")
            .await
            .expect("HGET");
        let stripes = if legacy {
            LEGACY_STRIPES
        } else {
            DEFAULT_STRIPES
        };
        assert_eq!(recorded, Some(stripes.to_string()));
        // Every cells hash is one of the recorded count's; a new deployment uses more than 64.
        let pattern = format!("{}:{{g*}}:W:*", keyspace.prefix());
        let keys: Vec<String> = conn.keys(&pattern).await.expect("KEYS");
        let highest = (keys.iter())
            .filter_map(|key| key.rsplit(':').next()?.parse::<u64>().ok())
            .max()
            .expect("cells hashes");
        assert!(highest < stripes, "{highest} in {stripes} stripes");
        assert!(legacy || highest >= LEGACY_STRIPES, "{highest}");
        aggregator.kill();
    }
}
