//! One fence decision, three implementations, cross-checked: the same table of cases (a fence
//! older, newer or absent, a ledger behind, at or past the batch, a share that would pass 64
//! bits) runs through `scripts/flush.lua` on a real redis-server, the `WATCH`/`MULTI`/`EXEC`
//! transactions path on the same server, and the PostgreSQL store on a real PostgreSQL. Each
//! must give the verdict the table states, write exactly when it says `Written`, and so agree
//! with the others. (`machine::verdict::flush_verdict` is what the transactions path, the
//! PostgreSQL store and the in-memory sink share; the script is the one written apart.) The
//! ledger rewind after a truncated log is cross-checked the same way.

use tally_aggregator::RedisSink;
use tally_aggregator::machine::likes::Likes;
use tally_aggregator::operator::config::Atomicity;
use tally_aggregator::pg_schema::{self, Schema};
use tally_aggregator::store::pg_sink::PgSink;
use tally_aggregator::store::sink::{Applied, GroupWrite, Refused, Rejection, Sink};
use tally_common::{DeadLetterReason, Keyspace, RedisConn, RedisTarget};
use tally_tests::postgres::PgServer;
use tally_tests::{RedisServer, serial, unique};

/// The writer's epoch in every case.
const EPOCH: u64 = 5;
/// The group every case writes to.
const GROUP: u32 = 3;

/// One case: what the group holds before the write, what the write says, and the verdict.
struct Case {
    name: &'static str,
    fence: Option<u64>,
    ledger: Option<i64>,
    share: Option<i64>,
    expected_ledger: i64,
    next_offset: i64,
    delta: i64,
    verdict: Applied,
}

fn overflow() -> Applied {
    Applied::Rejected(vec![Rejection {
        refused: Refused::Delta(0),
        reason: DeadLetterReason::Overflow,
    }])
}

fn cases() -> Vec<Case> {
    let case = |name, fence, ledger, expected_ledger, next_offset, verdict| Case {
        name,
        fence,
        ledger,
        share: Some(100),
        expected_ledger,
        next_offset,
        delta: 7,
        verdict,
    };
    vec![
        case("no fence", None, None, -1, 10, Applied::RolledBack),
        case(
            "an older fence",
            Some(4),
            Some(5),
            5,
            10,
            Applied::RolledBack,
        ),
        case("a newer fence", Some(6), Some(5), 5, 10, Applied::Fenced),
        case(
            "a newer fence and a ledger past",
            Some(6),
            Some(12),
            5,
            10,
            Applied::Fenced,
        ),
        case("first write", Some(EPOCH), None, -1, 10, Applied::Written),
        case(
            "the ledger as seen",
            Some(EPOCH),
            Some(5),
            5,
            10,
            Applied::Written,
        ),
        case(
            "the ledger past what was seen",
            Some(EPOCH),
            Some(7),
            5,
            10,
            Applied::Written,
        ),
        case(
            "the ledger at the batch's end",
            Some(EPOCH),
            Some(10),
            5,
            10,
            Applied::AlreadyApplied,
        ),
        case(
            "the ledger past the batch",
            Some(EPOCH),
            Some(12),
            5,
            10,
            Applied::AlreadyApplied,
        ),
        case(
            "the ledger behind what was seen",
            Some(EPOCH),
            Some(3),
            5,
            10,
            Applied::RolledBack,
        ),
        case(
            "no ledger where one was seen",
            Some(EPOCH),
            None,
            4,
            10,
            Applied::RolledBack,
        ),
        Case {
            share: Some(i64::MAX - 3),
            ..case("a share past 2^63", Some(EPOCH), Some(5), 5, 10, overflow())
        },
        Case {
            share: Some(i64::MIN + 3),
            delta: -7,
            ..case(
                "a share below -2^63",
                Some(EPOCH),
                Some(5),
                5,
                10,
                overflow(),
            )
        },
        Case {
            share: None,
            delta: i64::MAX,
            ..case(
                "no share, the largest delta",
                Some(EPOCH),
                Some(5),
                5,
                10,
                Applied::Written,
            )
        },
        Case {
            share: Some(i64::MAX - 7),
            ..case(
                "a share to exactly 2^63 - 1",
                Some(EPOCH),
                Some(5),
                5,
                10,
                Applied::Written,
            )
        },
    ]
}

/// What a store holds for a case after the write: (the share, the ledger).
type After = (Option<i64>, Option<i64>);

/// The Redis side: both atomicity modes on one server, each case under its own field.
struct Redis {
    conn: RedisConn,
    keyspace: Keyspace,
}

impl Redis {
    async fn set_up(&self, field: &str, case: &Case) {
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        if let Some(fence) = case.fence {
            pipe.hset(self.keyspace.fence_key(GROUP), field, fence);
        }
        if let Some(ledger) = case.ledger {
            pipe.hset(self.keyspace.ledger_key(GROUP), field, ledger);
        }
        if let Some(share) = case.share {
            pipe.set(self.keyspace.counter_key(GROUP, &counter(field)), share);
        }
        let () = pipe.query_async(&mut conn).await.expect("state set");
    }

    async fn after(&self, field: &str) -> After {
        let mut conn = self.conn.clone();
        let share: Option<i64> = redis::cmd("GET")
            .arg(self.keyspace.counter_key(GROUP, &counter(field)))
            .query_async(&mut conn)
            .await
            .expect("share");
        let ledger: Option<i64> = redis::cmd("HGET")
            .arg(self.keyspace.ledger_key(GROUP))
            .arg(field)
            .query_async(&mut conn)
            .await
            .expect("ledger");
        (share, ledger)
    }
}

/// The PostgreSQL side.
struct Postgres {
    client: tokio_postgres::Client,
    schema: String,
}

impl Postgres {
    async fn set_up(&self, field: &str, case: &Case) {
        let s = &self.schema;
        let shard = GROUP as i32;
        if case.fence.is_some() || case.ledger.is_some() {
            let fence = case.fence.map(|f| f as i64);
            self.client
                .execute(
                    &format!(
                        "INSERT INTO \"{s}\".partitions (field, shard, fence, ledger) \
                         VALUES ($1, $2, $3, $4)"
                    ),
                    &[&field, &shard, &fence, &case.ledger],
                )
                .await
                .expect("partition row");
        }
        if let Some(share) = case.share {
            self.client
                .execute(
                    &format!(
                        "INSERT INTO \"{s}\".shares (counter, shard, value) VALUES ($1, $2, $3)"
                    ),
                    &[&counter(field), &shard, &share],
                )
                .await
                .expect("share row");
        }
    }

    async fn after(&self, field: &str) -> After {
        let s = &self.schema;
        let shard = GROUP as i32;
        let share = self
            .client
            .query_opt(
                &format!("SELECT value FROM \"{s}\".shares WHERE counter = $1 AND shard = $2"),
                &[&counter(field), &shard],
            )
            .await
            .expect("share")
            .map(|r| r.get::<_, i64>(0));
        let ledger = self
            .client
            .query_opt(
                &format!("SELECT ledger FROM \"{s}\".partitions WHERE field = $1 AND shard = $2"),
                &[&field, &shard],
            )
            .await
            .expect("ledger")
            .and_then(|r| r.get::<_, Option<i64>>(0));
        (share, ledger)
    }
}

fn counter(field: &str) -> String {
    format!("views:{}", field.replace('/', "-"))
}

async fn apply(sink: &impl Sink, field: &str, case: &Case) -> Applied {
    let deltas = [(counter(field), case.delta)];
    let write = GroupWrite {
        group: GROUP,
        field,
        epoch: EPOCH,
        expected_ledger: case.expected_ledger,
        next_offset: case.next_offset,
        deltas: &deltas,
        windows: &[],
        resets: &[],
        members: Likes::NONE,
        watermark: None,
    };
    sink.apply_fenced(write).await.expect("the store answers")
}

/// What the write should leave: written, the share moved by the delta and the ledger at the
/// batch's end; otherwise both as they were.
fn expected_after(case: &Case) -> After {
    match case.verdict {
        Applied::Written => (
            Some(case.share.unwrap_or(0) + case.delta),
            Some(case.next_offset),
        ),
        _ => (case.share, case.ledger),
    }
}

/// Every store under test: the scripts and the transactions on one redis-server, and the
/// PostgreSQL store, with the servers they run on.
struct Stores {
    _redis_server: RedisServer,
    _pg_server: PgServer,
    scripts: RedisSink,
    transactions: RedisSink,
    redis: Redis,
    pg_sink: PgSink,
    postgres: Postgres,
}

async fn stores() -> Stores {
    let redis_server = RedisServer::start().await;
    let pg_server = PgServer::start().await;
    let url = redis_server.url();
    let target = RedisTarget::parse(&url).expect("target");
    let conn = RedisConn::connect(&url).await.expect("redis");
    let keyspace = Keyspace::new(unique("fence"), 16).expect("keyspace");
    let scripts = RedisSink::new(conn.clone(), &target, keyspace.clone(), Atomicity::Scripts)
        .expect("scripts sink");
    let transactions = RedisSink::new(
        conn.clone(),
        &target,
        keyspace.clone(),
        Atomicity::Transactions,
    )
    .expect("transactions sink");
    let redis = Redis { conn, keyspace };

    let prefix = unique("fence-pg");
    let options = pg_schema::PoolOptions {
        password: None,
        size: 2,
        statement_timeout: None,
    };
    let pool = pg_schema::pool(&pg_server.url(), options).expect("pool");
    let schema = Schema::new(&prefix).expect("schema");
    pg_schema::migrate(&pool, &schema).await.expect("migrated");
    let pg_sink = PgSink::new(pool, schema);
    let (client, connection) = tokio_postgres::connect(&pg_server.url(), tokio_postgres::NoTls)
        .await
        .expect("connects");
    tokio::spawn(connection);
    let postgres = Postgres {
        client,
        schema: prefix,
    };
    Stores {
        _redis_server: redis_server,
        _pg_server: pg_server,
        scripts,
        transactions,
        redis,
        pg_sink,
        postgres,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_the_transactions_and_postgres_decide_alike() {
    let _serial = serial().await;
    // The servers bound, so that they outlive the cases.
    let Stores {
        _redis_server: _redis,
        _pg_server: _pg,
        scripts,
        transactions,
        redis,
        pg_sink,
        postgres,
    } = stores().await;

    let mut disagreements = Vec::new();
    for (i, case) in cases().iter().enumerate() {
        let want = (case.verdict.clone(), expected_after(case));
        let field = format!("script/{i}");
        redis.set_up(&field, case).await;
        let script = (
            apply(&scripts, &field, case).await,
            redis.after(&field).await,
        );
        let field = format!("transactions/{i}");
        redis.set_up(&field, case).await;
        let multi = (
            apply(&transactions, &field, case).await,
            redis.after(&field).await,
        );
        let field = format!("postgres/{i}");
        postgres.set_up(&field, case).await;
        let pg = (
            apply(&pg_sink, &field, case).await,
            postgres.after(&field).await,
        );
        for (path, got) in [
            ("flush.lua", script),
            ("transactions", multi),
            ("postgres", pg),
        ] {
            if got != want {
                disagreements.push(format!("{}: {path} gave {got:?}, not {want:?}", case.name));
            }
        }
    }
    assert!(
        disagreements.is_empty(),
        "the fence decision differs:\n{}",
        disagreements.join("\n")
    );
}

/// Moving a ledger back to a truncation point (`scripts/rewind.lua`, its transaction, the
/// PostgreSQL row): only the fence's holder moves it, and only a ledger past the point.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_rewind_is_fenced_and_moves_only_back_alike_everywhere() {
    let _serial = serial().await;
    let stores = stores().await;
    // (what it is, the fence, the ledger, the ledger after; the point is offset 300).
    type RewindCase = (&'static str, Option<u64>, Option<i64>, Option<i64>);
    let cases: [RewindCase; 5] = [
        ("a ledger past the point", Some(EPOCH), Some(500), Some(300)),
        ("a ledger before it", Some(EPOCH), Some(200), Some(200)),
        ("no ledger", Some(EPOCH), None, None),
        ("a newer fence", Some(EPOCH + 1), Some(500), Some(500)),
        ("no fence", None, Some(500), Some(500)),
    ];
    let mut disagreements = Vec::new();
    for (i, &(name, fence, ledger, after)) in cases.iter().enumerate() {
        let verdict = match fence {
            Some(EPOCH) => Applied::Written,
            other => Applied::from_fence(other, EPOCH),
        };
        let case = Case {
            name,
            fence,
            ledger,
            share: None,
            expected_ledger: 0,
            next_offset: 0,
            delta: 0,
            verdict: verdict.clone(),
        };
        let want = (verdict, (None, after));
        for path in ["rewind.lua", "transactions", "postgres"] {
            let field = format!("rewind-{path}/{i}");
            let got = match path {
                "postgres" => {
                    stores.postgres.set_up(&field, &case).await;
                    let applied = stores.pg_sink.rewind_ledger(GROUP, &field, EPOCH, 300);
                    let applied = applied.await.expect("the store answers");
                    (applied, stores.postgres.after(&field).await)
                }
                _ => {
                    let sink = match path {
                        "rewind.lua" => &stores.scripts,
                        _ => &stores.transactions,
                    };
                    stores.redis.set_up(&field, &case).await;
                    let applied = sink.rewind_ledger(GROUP, &field, EPOCH, 300);
                    let applied = applied.await.expect("the store answers");
                    (applied, stores.redis.after(&field).await)
                }
            };
            if got != want {
                disagreements.push(format!("{name}: {path} gave {got:?}, not {want:?}"));
            }
        }
    }
    assert!(
        disagreements.is_empty(),
        "the rewind differs:\n{}",
        disagreements.join("\n")
    );
}
