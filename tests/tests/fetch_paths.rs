//! End to end: what an independent producer may put in the log, read by tally's own fetcher and
//! by librdkafka's. Transactions: a producer's aborted transaction never counts, its committed
//! ones do, whichever path reads them; with `isolation.level=read_uncommitted` (as asked) the
//! aborted one counts too. Compression: batches compressed with every codec Kafka
//! defines (gzip, Snappy, LZ4 from librdkafka producers, Zstandard from `kcat`) count exactly
//! with tally's fetcher. Retention: a resuming partition whose position was deleted moves as
//! `auto.offset.reset` says (stays unread with `error`, goes on from the log's start by
//! default), counted and logged. Quotas: under a broker's consumer byte-rate quota, tally's
//! fetcher waits out each throttle and the catch-up runs at about the quota. Corruption: with `check.crcs=true`, a batch corrupted in the
//! broker's own segment file is never counted nor read past, and is counted and logged. Memory:
//! a fetch answer that decompresses to 250 times its size is read within tally's fetcher's
//! budget (`queued.max.messages.kbytes`).

use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use tally_kafka::records::{BATCH_HEADER_LEN, RawBatch, batches};
use tally_kafka::{FetchConfig, Fetched, Fetcher, Item, Start};
use tally_tests::{
    AggregatorSetup, RedisServer, TempDir, assert_committed_to_end, assert_delivered, brokers,
    create_topic, enqueue_raw, http_get, unique, wait_for_totals,
};

/// The counters every transaction writes to.
const COUNTERS: i64 = 40;

fn json(counter: &str, delta: i64) -> String {
    format!(r#"{{"counter":"{counter}","delta":{delta}}}"#)
}

/// One transaction of `events` events over [`COUNTERS`] counters, committed or aborted; adds
/// what it sends to `sent` if it is to be counted.
async fn transaction(
    producer: &FutureProducer,
    topic: &str,
    events: i64,
    delta: i64,
    commit: bool,
    counted: bool,
    sent: &mut HashMap<String, i64>,
) {
    producer.begin_transaction().expect("begin");
    let mut deliveries = Vec::new();
    for i in 0..events {
        let counter = format!("orders:shop:{}", i % COUNTERS);
        let payload = json(&counter, delta);
        deliveries.push(enqueue_raw(
            producer,
            FutureRecord::to(topic).key(&counter).payload(&payload),
        ));
        if counted {
            *sent.entry(counter).or_default() += delta;
        }
    }
    // Every event is in the log (acknowledged) before the transaction ends, aborted or not.
    assert_delivered(deliveries).await;
    if commit {
        producer
            .commit_transaction(Duration::from_secs(30))
            .expect("commit");
    } else {
        producer
            .abort_transaction(Duration::from_secs(30))
            .expect("abort");
    }
}

/// Transactions read with `fetch`: with read_committed (the default) the aborted one never
/// counts, with `read_uncommitted` it does.
async fn transactions_count_as_the_isolation_level_says(fetch: &str, read_uncommitted: bool) {
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create(&format!("txn-{fetch}"), &redis.url(), 4).await;
    let mut flags = vec!["--fetch", fetch];
    if read_uncommitted {
        flags.extend(["--kafka-option", "isolation.level=read_uncommitted"]);
    }
    let mut aggregator = setup.spawn(dir.path(), &flags);
    let transactional: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("transactional.id", unique("tally-txn"))
        .create()
        .expect("transactional producer");
    transactional
        .init_transactions(Duration::from_secs(30))
        .expect("init transactions");
    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("plain producer");

    // Committed, aborted, committed, over the same counters: each counter's aborted events lie
    // between its committed ones in its partition, so a total that adds up to the committed
    // events alone was read past the aborted ones without counting them. Plain events between
    // the transactions count too.
    let mut sent = HashMap::new();
    transaction(
        &transactional,
        &setup.topic,
        2_000,
        1,
        true,
        true,
        &mut sent,
    )
    .await;
    let mut deliveries = Vec::new();
    for i in 0..COUNTERS {
        let counter = format!("orders:shop:{i}");
        let payload = json(&counter, 100);
        deliveries.push(enqueue_raw(
            &plain,
            FutureRecord::to(&setup.topic)
                .key(&counter)
                .payload(&payload),
        ));
        *sent.entry(counter).or_default() += 100;
    }
    assert_delivered(deliveries).await;
    let (events, delta) = (3_000, 1_000);
    transaction(
        &transactional,
        &setup.topic,
        events,
        delta,
        false,
        read_uncommitted,
        &mut sent,
    )
    .await;
    transaction(
        &transactional,
        &setup.topic,
        1_000,
        3,
        true,
        true,
        &mut sent,
    )
    .await;

    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent, Duration::from_secs(60)).await;
    // The committed and plain events were all that was read (read_committed), or those and the
    // aborted ones (read_uncommitted): the transactions' markers are not events.
    let read = if read_uncommitted { 6_040.0 } else { 3_040.0 };
    assert_eq!(
        aggregator.metric("tally_events_consumed_total").await,
        Some(read)
    );
    let metrics = http_get(aggregator.metrics_port(), "/metrics")
        .await
        .expect("metrics");
    let info = metrics.lines().find(|l| l.starts_with("tally_build_info{"));
    assert!(
        info.is_some_and(|l| l.contains(&format!(r#"fetch="{fetch}""#))),
        "the aggregator reads with {fetch}: {info:?}"
    );
    aggregator.stop_gracefully().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_transactions_never_count_with_tallys_fetcher() {
    transactions_count_as_the_isolation_level_says("direct", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_transactions_never_count_with_librdkafka() {
    transactions_count_as_the_isolation_level_says("librdkafka", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_uncommitted_counts_aborted_transactions_with_tallys_fetcher() {
    transactions_count_as_the_isolation_level_says("direct", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_every_codec_count_exactly() {
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("codecs", &redis.url(), 4).await;
    let mut aggregator = setup.spawn(dir.path(), &["--fetch", "direct"]);
    let mut sent: HashMap<String, i64> = HashMap::new();
    let events_per_codec = 5_000i64;
    for (n, codec) in ["gzip", "snappy", "lz4", "none"].into_iter().enumerate() {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("compression.type", codec)
            .set("linger.ms", "50")
            .create()
            .expect("producer");
        let mut deliveries = Vec::new();
        for i in 0..events_per_codec {
            let counter = format!("views:{codec}:{}", i % 25);
            let delta = n as i64 + 1;
            let payload = json(&counter, delta);
            deliveries.push(enqueue_raw(
                &producer,
                FutureRecord::to(&setup.topic)
                    .key(&counter)
                    .payload(&payload),
            ));
            *sent.entry(counter).or_default() += delta;
        }
        assert_delivered(deliveries).await;
    }
    // Zstandard: this build's librdkafka has none, Debian's kcat does. Keyed lines, lingering
    // so that batches are large enough to be compressed.
    let mut lines = String::new();
    for i in 0..events_per_codec {
        let counter = format!("views:zstd:{}", i % 25);
        lines.push_str(&format!("{counter}\t{}\n", json(&counter, 7)));
        *sent.entry(counter).or_default() += 7;
    }
    // Without cargo's library path, which holds this build's librdkafka (no zstd).
    let mut kcat = Command::new("kcat")
        .env_remove("LD_LIBRARY_PATH")
        .args([
            "-P",
            "-b",
            &brokers(),
            "-t",
            &setup.topic,
            "-K",
            "\t",
            "-z",
            "zstd",
        ])
        .args(["-X", "linger.ms=200"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("kcat (deploy/local/start.sh installs it)");
    kcat.stdin
        .take()
        .expect("stdin")
        .write_all(lines.as_bytes())
        .expect("kcat's input");
    assert!(
        kcat.wait().expect("kcat ran").success(),
        "kcat -P -z zstd failed"
    );

    let reader = redis.reader(setup.keyspace()).await;
    wait_for_totals(&reader, &sent, Duration::from_secs(60)).await;
    assert_eq!(
        aggregator.metric("tally_events_consumed_total").await,
        Some((5 * events_per_codec) as f64),
        "every event read once"
    );
    assert_eq!(
        aggregator
            .series(
                "tally_events_dead_lettered_total",
                r#"reason="undecodable""#
            )
            .await,
        Some(0.0),
        "no batch was left unread"
    );
    aggregator.stop_gracefully().await;
    assert_committed_to_end(&setup.group, &setup.topic, 4);
}

/// Records whose values LZ4 compresses 250 to 1 (a hostile producer can do far better with
/// zstd): one fetch answer of about 1 MiB holds 270 MB once decompressed. Tally's fetcher,
/// with a budget of 8 MiB, hands them out in chunks as the reader frees room, so what it holds
/// stays within the budget and a chunk; it used to decompress the whole answer into one chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_answer_that_decompresses_to_far_more_than_the_budget_is_held_within_it() {
    const RECORDS: i64 = 300;
    const SIZE: usize = 900_000;
    const BUDGET: usize = 8 << 20;
    let topic = unique("compressible");
    create_topic(&topic, 1).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("compression.type", "lz4")
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    let value = vec![b'x'; SIZE];
    // A few at a time, so that the producer's own queue stays small.
    for _ in 0..RECORDS / 50 {
        let deliveries: Vec<_> = (0..50)
            .map(|_| {
                let record = FutureRecord::<(), _>::to(&topic).partition(0);
                enqueue_raw(&producer, record.payload(&value[..]))
            })
            .collect();
        assert_delivered(deliveries).await;
    }

    let budget_kb = (BUDGET / 1024).to_string();
    let options = [
        ("bootstrap.servers", brokers()),
        ("queued.max.messages.kbytes", budget_kb),
    ];
    let config = FetchConfig::from_options(&topic, options.iter().map(|(k, v)| (*k, v.as_str())))
        .expect("a valid configuration");
    let (fetcher, mut rx) = Fetcher::start(config);
    let epoch = fetcher.seek(0, Start::At(0), false);
    let (mut next, mut chunks, mut peak) = (0, 0, 0);
    while next < RECORDS {
        let fetched = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("records keep coming")
            .expect("the fetcher runs");
        let Fetched::Chunk(chunk) = fetched else {
            continue;
        };
        peak = peak.max(fetcher.buffered_bytes());
        assert_eq!((chunk.partition, chunk.epoch), (0, epoch));
        chunks += 1;
        for item in chunk.items() {
            let Item::Record(record) = item else {
                panic!("every batch reads: {item:?}");
            };
            assert_eq!(record.offset, next, "each record once, in order");
            assert!(record.value == Some(&value[..]), "offset {next} read whole");
            next += 1;
        }
    }
    // A chunk stops at a quarter of the budget, its buffer at most twice what it holds.
    assert!(
        peak <= BUDGET + 8 * SIZE,
        "{peak} bytes held at most, against a budget of {BUDGET}"
    );
    assert!(chunks >= RECORDS / 3, "{chunks} chunks");
}

/// Appends `events` events of delta 1 to `counter` in partition 0 of `topic`.
async fn append(topic: &str, counter: &str, events: usize) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("linger.ms", "5")
        .create()
        .expect("producer");
    let payload = json(counter, 1);
    let deliveries: Vec<_> = (0..events)
        .map(|_| {
            enqueue_raw(
                &producer,
                FutureRecord::<(), _>::to(topic)
                    .partition(0)
                    .payload(&payload),
            )
        })
        .collect();
    assert_delivered(deliveries).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_position_deleted_by_retention_moves_as_auto_offset_reset_says() {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::{Offset, TopicPartitionList};

    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("retention", &redis.url(), 1).await;
    let reader = redis.reader(setup.keyspace()).await;

    // 1,000 events counted and durable, then the aggregator stops at offset 1,000.
    let mut first = setup.spawn(dir.path(), &["--fetch", "direct"]);
    append(&setup.topic, "views:early", 1_000).await;
    wait_for_totals(
        &reader,
        &[("views:early".to_owned(), 1_000)].into(),
        Duration::from_secs(60),
    )
    .await;
    first.stop_gracefully().await;

    // 1,000 more while it is down; retention then deletes everything before offset 1,500,
    // under the position the next owner resumes from.
    append(&setup.topic, "views:late", 1_000).await;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin client");
    let mut up_to = TopicPartitionList::new();
    up_to
        .add_partition_offset(&setup.topic, 0, Offset::Offset(1_500))
        .expect("offset");
    admin
        .delete_records(&up_to, &AdminOptions::new())
        .await
        .expect("records deleted");

    // auto.offset.reset = error: the partition is said to be out of range and not read.
    let stuck = setup.spawn(
        dir.path(),
        &[
            "--fetch",
            "direct",
            "--kafka-option",
            "auto.offset.reset=error",
        ],
    );
    stuck
        .wait_metric("tally_offset_resets_total", 1.0, Duration::from_secs(30))
        .await;
    assert_eq!(stuck.metric("tally_events_consumed_total").await, Some(0.0));
    let mut stuck = stuck;
    stuck.stop_gracefully().await;

    // The default (earliest): reading goes on from the log's start, offset 1,500; the 500
    // deleted events were never counted, the 500 retained ones are, exactly.
    let mut next = setup.spawn(dir.path(), &["--fetch", "direct"]);
    let expected = [
        ("views:early".to_owned(), 1_000),
        ("views:late".to_owned(), 500),
    ]
    .into();
    wait_for_totals(&reader, &expected, Duration::from_secs(60)).await;
    assert_eq!(next.metric("tally_offset_resets_total").await, Some(1.0));
    assert!(
        next.log().contains("no longer in its log"),
        "the reset is logged"
    );
    next.stop_gracefully().await;
    assert_committed_to_end(&setup.group, &setup.topic, 1);
}

/// The local stack's state directory (`deploy/local/start.sh`): the broker's data, whose
/// segment files the corruption test edits.
fn local_state() -> std::path::PathBuf {
    std::env::var_os("TALLY_LOCAL_DIR").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.local"),
        std::path::PathBuf::from,
    )
}

/// The first segment file of partition 0 of `topic` on the local broker.
fn first_segment(topic: &str) -> std::path::PathBuf {
    (local_state().join("kafka-data"))
        .join(format!("{topic}-0"))
        .join("00000000000000000000.log")
}

/// The fewest fetches of at most `limit` bytes that read the log `segment`: a broker answers with
/// whole batches up to the limit, or with one batch larger than it (the producer's batches can
/// be, depending on how fast it was sending).
fn fetches_needed(segment: &std::path::Path, limit: usize) -> usize {
    let log = std::fs::read(segment).expect("the segment");
    let (mut fetches, mut filled) = (0, 0);
    for batch in batches(&log) {
        let len = match batch.expect("a batch the broker wrote") {
            RawBatch::V2 { records, .. } => BATCH_HEADER_LEN + records.len(),
            RawBatch::Legacy { bytes, .. } => bytes.len(),
        };
        if fetches == 0 || filled + len > limit {
            fetches += 1;
            filled = 0;
        }
        filled += len;
    }
    fetches
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_quota_is_waited_out_and_the_catch_up_runs_at_about_it() {
    const QUOTA: u64 = 256 << 10;
    // The broker measures a client's rate over up to 11 one-second samples (its
    // quota.window.num and quota.window.size.seconds defaults): the bounds below grant the
    // client that much unthrottled, though in the runs here throttling began at once.
    const BURST: u64 = 11 * QUOTA;
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("quota", &redis.url(), 1).await;
    append(
        &setup.topic,
        "quota:views:with-a-longer-name-for-bytes",
        75_000,
    )
    .await;
    let segment = first_segment(&setup.topic);
    let bytes = std::fs::metadata(&segment)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run against deploy/local/start.sh's Kafka)",
                segment.display()
            )
        })
        .len();

    assert!(
        bytes > BURST * 3 / 2,
        "{bytes} bytes: more than the quota lets through at once"
    );

    // A consumer byte-rate quota of 256 KiB/s on the aggregator's client id, set with Kafka's
    // own tool.
    let client = unique("tally-quota");
    let status = Command::new(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local/kafka-tool.sh"),
    )
    .arg("ConfigCommand")
    .args(["--bootstrap-server", &brokers(), "--alter"])
    .args(["--add-config", &format!("consumer_byte_rate={QUOTA}")])
    .args(["--entity-type", "clients", "--entity-name", &client])
    .stdout(Stdio::null())
    .status()
    .expect("deploy/local/kafka-tool.sh runs Kafka's ConfigCommand");
    assert!(status.success(), "the quota is set");

    let started = std::time::Instant::now();
    let client_id = format!("client.id={client}");
    let mut aggregator = setup.spawn(
        dir.path(),
        &[
            "--fetch",
            "direct",
            "--kafka-option",
            &client_id,
            // Fetches of 256 KiB, so that the quota is met many times over.
            "--kafka-option",
            "max.partition.fetch.bytes=262144",
        ],
    );
    let reader = redis.reader(setup.keyspace()).await;
    let expected = [(
        "quota:views:with-a-longer-name-for-bytes".to_owned(),
        75_000,
    )]
    .into();
    wait_for_totals(&reader, &expected, Duration::from_secs(120)).await;
    let took = started.elapsed();
    let at_quota = Duration::from_secs_f64((bytes - BURST) as f64 / QUOTA as f64);
    let throttled = aggregator
        .metric("tally_fetch_throttled_seconds_total")
        .await
        .unwrap_or(0.0);
    let requests = aggregator
        .metric("tally_fetch_requests_total")
        .await
        .unwrap_or(0.0);
    // Each fetch brings at most 256 KiB; the rest are the broker's empty answers to fetches it
    // throttled (a throttle lasts about a second or more, and a fetcher that honours it sends
    // one fetch after each, so at most about one per second of the run: 55 requests for 22
    // fetches' worth were seen in a 24.6 s run on a loaded machine) and the long polls once
    // caught up (one per `fetch.wait.max.ms`, 100 ms) before the totals were seen. What this run cannot show is
    // that no fetch goes out during a throttle: the broker mutes the connection for it anyway,
    // so a fetcher built to ignore throttles was measured at 14.2 s and 32 requests here,
    // inside the spread of honouring runs (15.2-23.5 s, 33-38 requests). That is shown by the
    // fetcher core's unit test `a_throttle_quiets_the_broker_until_it_is_over`.
    let needed = fetches_needed(&segment, 262_144) as f64;
    eprintln!(
        "{bytes} bytes read in {took:?} ({:.0} KiB/s; the quota is 256 KiB/s, {at_quota:?} past the first window's), throttled {throttled:.1} s, {requests} fetch requests for the {needed} of at most 256 KiB (or one batch) its batches need",
        bytes as f64 / took.as_secs_f64() / 1024.0
    );
    assert!(
        requests >= needed && requests <= needed * 1.5 + 20.0 + took.as_secs_f64(),
        "{requests} fetch requests for {needed} fetches' worth of bytes"
    );
    assert!(
        took >= at_quota.mul_f64(0.6),
        "{bytes} bytes in {took:?}: faster than the quota allows"
    );
    assert!(
        throttled >= at_quota.as_secs_f64() * 0.5,
        "the throttles were waited out: {throttled} s"
    );
    aggregator.stop_gracefully().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_check_crcs_a_batch_corrupted_on_the_brokers_disk_is_never_read_past() {
    let dir = TempDir::new("tally-e2e");
    let redis = RedisServer::start().await;
    let setup = AggregatorSetup::create("corrupt", &redis.url(), 1).await;
    let reader = redis.reader(setup.keyspace()).await;
    // Three producers one after the other: their batches hold one counter each.
    append(&setup.topic, "crc:before", 500).await;
    append(&setup.topic, "crc:corrupt", 500).await;
    append(&setup.topic, "crc:after", 500).await;

    // One byte of the first batch holding `crc:corrupt` changed in the segment file the broker
    // serves from: `crc:corrupt` becomes `Crc:corrupt`, still a valid event, which only the
    // batch's CRC can tell from the one written.
    let segment = first_segment(&setup.topic);
    let mut bytes = std::fs::read(&segment).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (this test corrupts the local broker's segment: run it against deploy/local/start.sh's Kafka)",
            segment.display()
        )
    });
    let at = (bytes.windows(11))
        .position(|w| w == b"crc:corrupt")
        .expect("the event in the segment");
    bytes[at] = b'C';
    {
        use std::io::{Seek, SeekFrom};
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&segment)
            .expect("segment");
        file.seek(SeekFrom::Start(at as u64)).expect("seek");
        file.write_all(&bytes[at..=at]).expect("one byte written");
    }

    let aggregator = setup.spawn(
        dir.path(),
        &["--fetch", "direct", "--kafka-option", "check.crcs=true"],
    );
    aggregator
        .wait_metric("tally_corrupt_batches_total", 1.0, Duration::from_secs(30))
        .await;
    wait_for_totals(
        &reader,
        &[("crc:before".to_owned(), 500)].into(),
        Duration::from_secs(30),
    )
    .await;
    // Another fetch of the same batch (5 s later) fails the same way: still nothing past it.
    aggregator
        .wait_metric("tally_corrupt_batches_total", 2.0, Duration::from_secs(30))
        .await;
    for counter in ["crc:corrupt", "Crc:corrupt", "crc:after"] {
        assert_eq!(reader.get(counter).await.expect("read"), 0, "{counter}");
    }
    assert_eq!(
        aggregator
            .series("tally_durable_offset", "partition=\"0\"")
            .await,
        Some(500.0),
        "durable up to the corrupt batch, never past it"
    );
    assert!(
        aggregator.log().contains("does not match its CRC-32C"),
        "the corruption is logged: {}",
        aggregator.log_tail(10)
    );
    let mut aggregator = aggregator;
    aggregator.stop_gracefully().await;
}
