//! The PostgreSQL store (with the `postgres` feature): its schema, created and migrated by tally
//! itself, the statements the aggregator's sink and the readers run, and the pool.
//!
//! Each deployment's tables live in their own schema, named by its key prefix (as its Redis keys
//! start with it). [`migrate`] brings a schema to the latest version: under an advisory lock (so
//! aggregators starting together migrate once), it applies every migration in [`MIGRATIONS`] that
//! `<schema>.tally_migrations` does not list, each in its own transaction together with its row
//! there. Migrations are only ever appended: a released one is never edited.

use std::str::FromStr;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;

use crate::reader::{ReadError, StoreFuture, StoreOfRecord};

/// Every migration, in order: `(version, what it does, SQL)`; `{schema}` stands for the quoted
/// schema name.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "counter shares and the exactly-once bookkeeping",
        include_str!("pg/0001_init.sql"),
    ),
    (
        2,
        "one like per actor: members",
        include_str!("pg/0002_members.sql"),
    ),
    (
        3,
        "fillfactor for rows updated in place",
        include_str!("pg/0003_fillfactor.sql"),
    ),
    (
        4,
        "the shard each like was counted in",
        include_str!("pg/0004_member_shards.sql"),
    ),
];

/// How long an operation waits for a pooled connection (or for a new one to be made) before it
/// fails, to be retried.
pub const POOL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Why the PostgreSQL store could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgError {
    /// The URL is not a PostgreSQL connection string.
    #[error("invalid PostgreSQL URL: {0}")]
    Url(#[source] tokio_postgres::Error),
    /// The schema name (the key prefix) cannot name a PostgreSQL schema.
    #[error("the key prefix {0:?} cannot name a PostgreSQL schema (at most 63 bytes, no NUL)")]
    SchemaName(String),
    /// The pool could not be built.
    #[error("PostgreSQL pool: {0}")]
    Pool(String),
    /// PostgreSQL refused or failed.
    #[error("PostgreSQL: {0}")]
    Db(#[from] tokio_postgres::Error),
}

/// A deployment's schema and the statements on its tables.
#[derive(Debug, Clone)]
pub struct Schema {
    name: String,
    /// The statements, with the schema's quoted name in them.
    pub sql: Statements,
}

/// The statements the store runs, written once per schema.
#[derive(Debug, Clone)]
pub struct Statements {
    /// `$1` shard, `$2` counters, `$3` deltas: adds each delta to its share.
    pub upsert_shares: String,
    /// `$1` shard, `$2` counters: deletes their shares there (a reset).
    pub reset_shares: String,
    /// `$1` shard, `$2` counters: deletes the members whose likes their shares there hold, and
    /// those from before the shard was recorded (a reset).
    pub reset_members: String,
    /// `$1` shard, `$2` counters: their shares there, locked, in counter order.
    pub lock_shares: String,
    /// `$1` field, `$2` shard: the fence and ledger, locked.
    pub lock_partition: String,
    /// `$1` field, `$2` shard: the fence and ledger.
    pub read_partition: String,
    /// `$1` field, `$2` shard: makes the row exist.
    pub ensure_partition: String,
    /// `$1` field, `$2` shard, `$3` epoch.
    pub set_fence: String,
    /// `$1` field, `$2` shard, `$3` ledger.
    pub set_ledger: String,
    /// `$1` field, `$2` watermark.
    pub set_watermark: String,
    /// `$1` field: the watermark.
    pub read_watermark: String,
    /// `$1` field, `$2` first epoch, `$3` at least: the next epoch.
    pub next_epoch: String,
    /// `$1` counters: `(counter, total)` for those with shares; fails past 64 bits.
    pub totals: String,
    /// `$1` counter: `(shard, value)` of each of its shares.
    pub shares: String,
    /// `$1` counter, `$2` actor, `$3` shard: a like; adds 1 to the share if the actor was not
    /// a member.
    pub like: String,
    /// `$1` counter, `$2` actor, `$3` shard: an unlike; takes 1 from the share if the actor was
    /// a member.
    pub unlike: String,
    /// `$1` counters, `$2` actors (pairs, each pair once), `$3` shard: [`Statements::like`] for
    /// every pair in one statement; each counter's share gains the number of new members.
    pub likes: String,
    /// The same for unlikes: each counter's share loses the number of members removed.
    pub unlikes: String,
    /// `$1` counter, `$2` actor: a row if the actor's like counts.
    pub has_liked: String,
}

impl Schema {
    /// The schema named `name` (the key prefix).
    pub fn new(name: &str) -> Result<Self, PgError> {
        if name.is_empty() || name.len() > 63 || name.contains('\0') {
            return Err(PgError::SchemaName(name.to_owned()));
        }
        let s = quote(name);
        let sql = Statements {
            upsert_shares: format!(
                "INSERT INTO {s}.shares AS t (counter, shard, value) \
                 SELECT u.c, $1, u.d FROM unnest($2::text[], $3::bigint[]) AS u(c, d) \
                 ON CONFLICT (counter, shard) DO UPDATE SET value = t.value + EXCLUDED.value"
            ),
            reset_shares: format!("DELETE FROM {s}.shares WHERE shard = $1 AND counter = ANY($2)"),
            reset_members: format!(
                "DELETE FROM {s}.members WHERE counter = ANY($2) AND (shard = $1 OR shard IS NULL)"
            ),
            lock_shares: format!(
                "SELECT counter, value FROM {s}.shares WHERE shard = $1 AND counter = ANY($2) \
                 ORDER BY counter FOR UPDATE"
            ),
            lock_partition: format!(
                "SELECT fence, ledger FROM {s}.partitions WHERE field = $1 AND shard = $2 FOR UPDATE"
            ),
            read_partition: format!(
                "SELECT fence, ledger FROM {s}.partitions WHERE field = $1 AND shard = $2"
            ),
            ensure_partition: format!(
                "INSERT INTO {s}.partitions (field, shard) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            ),
            set_fence: format!(
                "UPDATE {s}.partitions SET fence = $3 WHERE field = $1 AND shard = $2"
            ),
            set_ledger: format!(
                "UPDATE {s}.partitions SET ledger = $3 WHERE field = $1 AND shard = $2"
            ),
            set_watermark: format!(
                "INSERT INTO {s}.watermarks (field, watermark) VALUES ($1, $2) \
                 ON CONFLICT (field) DO UPDATE SET watermark = EXCLUDED.watermark"
            ),
            read_watermark: format!("SELECT watermark FROM {s}.watermarks WHERE field = $1"),
            next_epoch: format!(
                "INSERT INTO {s}.epochs AS e (field, epoch) VALUES ($1, $2) \
                 ON CONFLICT (field) DO UPDATE SET epoch = GREATEST(e.epoch + 1, $3) \
                 RETURNING epoch"
            ),
            shares: format!("SELECT shard, value FROM {s}.shares WHERE counter = $1"),
            like: format!(
                "WITH added AS (INSERT INTO {s}.members (counter, actor, shard) VALUES ($1, $2, $3) \
                 ON CONFLICT DO NOTHING RETURNING counter) \
                 INSERT INTO {s}.shares AS t (counter, shard, value) SELECT counter, $3, 1 FROM added \
                 ON CONFLICT (counter, shard) DO UPDATE SET value = t.value + 1"
            ),
            unlike: format!(
                "WITH removed AS (DELETE FROM {s}.members WHERE counter = $1 AND actor = $2 \
                 RETURNING counter) \
                 INSERT INTO {s}.shares AS t (counter, shard, value) SELECT counter, $3, -1 FROM removed \
                 ON CONFLICT (counter, shard) DO UPDATE SET value = t.value - 1"
            ),
            likes: format!(
                "WITH added AS (INSERT INTO {s}.members (counter, actor, shard) \
                 SELECT c, a, $3::int FROM unnest($1::text[], $2::text[]) AS m(c, a) \
                 ON CONFLICT DO NOTHING RETURNING counter), \
                 n AS (SELECT counter, count(*) AS k FROM added GROUP BY counter) \
                 INSERT INTO {s}.shares AS t (counter, shard, value) SELECT counter, $3, k FROM n \
                 ON CONFLICT (counter, shard) DO UPDATE SET value = t.value + EXCLUDED.value"
            ),
            unlikes: format!(
                "WITH removed AS (DELETE FROM {s}.members AS m \
                 USING unnest($1::text[], $2::text[]) AS u(c, a) \
                 WHERE m.counter = u.c AND m.actor = u.a RETURNING m.counter), \
                 n AS (SELECT counter, count(*) AS k FROM removed GROUP BY counter) \
                 INSERT INTO {s}.shares AS t (counter, shard, value) SELECT counter, $3, -k FROM n \
                 ON CONFLICT (counter, shard) DO UPDATE SET value = t.value + EXCLUDED.value"
            ),
            has_liked: format!("SELECT 1 FROM {s}.members WHERE counter = $1 AND actor = $2"),
            totals: format!(
                "SELECT counter, SUM(value)::bigint FROM {s}.shares WHERE counter = ANY($1) \
                 GROUP BY counter"
            ),
        };
        Ok(Self {
            name: name.to_owned(),
            sql,
        })
    }

    /// The schema's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// `name` as a quoted PostgreSQL identifier.
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// How a pool connects.
#[derive(Debug, Clone, Copy)]
pub struct PoolOptions<'a> {
    /// The password, if not in the URL.
    pub password: Option<&'a str>,
    /// Most connections held.
    pub size: usize,
    /// Longest one statement may run before the server cancels it (`None`: the server's).
    pub statement_timeout: Option<std::time::Duration>,
}

/// A pool of connections to the server at `url` (a `postgres://` URL or a key=value connection
/// string).
pub fn pool(url: &str, options: PoolOptions<'_>) -> Result<Pool, PgError> {
    let mut config = tokio_postgres::Config::from_str(url).map_err(PgError::Url)?;
    if let Some(password) = options.password {
        config.password(password);
    }
    if let Some(timeout) = options.statement_timeout {
        let mut startup = config.get_options().unwrap_or_default().to_owned();
        startup.push_str(&format!(" -c statement_timeout={}", timeout.as_millis()));
        config.options(startup.trim());
    }
    let size = options.size;
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .wait_timeout(Some(POOL_WAIT))
        .create_timeout(Some(POOL_WAIT))
        .build()
        .map_err(|e| PgError::Pool(e.to_string()))
}

/// Brings `schema` to the latest version; returns the versions it applied.
pub async fn migrate(pool: &Pool, schema: &Schema) -> Result<Vec<i32>, PgError> {
    let mut client = pool.get().await.map_err(|e| PgError::Pool(e.to_string()))?;
    let s = quote(&schema.name);
    // One migrator per schema at a time, across processes.
    let lock = format!(
        "SELECT pg_advisory_lock(hashtext({}))",
        literal(&schema.name)
    );
    let unlock = format!(
        "SELECT pg_advisory_unlock(hashtext({}))",
        literal(&schema.name)
    );
    client.batch_execute(&lock).await?;
    let result = async {
        client
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {s}; \
                 CREATE TABLE IF NOT EXISTS {s}.tally_migrations ( \
                     version integer PRIMARY KEY, \
                     description text NOT NULL, \
                     applied_at timestamptz NOT NULL DEFAULT now())"
            ))
            .await?;
        let applied: Vec<i32> = (client
            .query(&format!("SELECT version FROM {s}.tally_migrations"), &[])
            .await?)
            .iter()
            .map(|r| r.get(0))
            .collect();
        let mut now = Vec::new();
        for (version, description, sql) in MIGRATIONS {
            if applied.contains(version) {
                continue;
            }
            let tx = client.transaction().await?;
            tx.batch_execute(&sql.replace("{schema}", &s)).await?;
            tx.execute(
                &format!("INSERT INTO {s}.tally_migrations (version, description) VALUES ($1, $2)"),
                &[version, description],
            )
            .await?;
            tx.commit().await?;
            now.push(*version);
        }
        Ok::<_, PgError>(now)
    }
    .await;
    client.batch_execute(&unlock).await?;
    result
}

/// `text` as a SQL string literal.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The PostgreSQL store's rows as a [`StoreOfRecord`] for [`crate::Reader::with_store`].
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
    schema: Schema,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("schema", &self.schema.name)
            .finish_non_exhaustive()
    }
}

impl PgStore {
    /// The rows of `schema`, read through `pool`.
    pub fn new(pool: Pool, schema: Schema) -> Self {
        Self { pool, schema }
    }

    /// The rows of the deployment whose key prefix is `prefix`, in the server at `url`, through
    /// a pool made with `options` (connections are made when first used).
    pub fn connect(url: &str, options: PoolOptions<'_>, prefix: &str) -> Result<Self, PgError> {
        Ok(Self::new(pool(url, options)?, Schema::new(prefix)?))
    }

    /// A direct write: adds `delta` to `counter`'s row for `shard` (one upsert).
    pub async fn add(&self, counter: &str, shard: u32, delta: i64) -> Result<(), PgError> {
        let client = self
            .pool
            .get()
            .await
            .map_err(|e| PgError::Pool(e.to_string()))?;
        let statement = client
            .prepare_cached(&self.schema.sql.upsert_shares)
            .await?;
        client
            .execute(
                &statement,
                &[&(shard as i32), &[counter].as_slice(), &[delta].as_slice()],
            )
            .await?;
        Ok(())
    }

    /// A direct like (`like`) or unlike of `counter` by `actor`, counted in `shard`: changes
    /// `members` and the share in one statement; whether the membership changed.
    pub async fn member(
        &self,
        counter: &str,
        actor: &str,
        shard: u32,
        like: bool,
    ) -> Result<bool, PgError> {
        let client = self
            .pool
            .get()
            .await
            .map_err(|e| PgError::Pool(e.to_string()))?;
        let sql = if like {
            &self.schema.sql.like
        } else {
            &self.schema.sql.unlike
        };
        let statement = client.prepare_cached(sql).await?;
        let changed = client
            .execute(&statement, &[&counter, &actor, &(shard as i32)])
            .await?;
        Ok(changed == 1)
    }
}

fn store_error(error: impl std::error::Error + Send + Sync + 'static) -> ReadError {
    ReadError::Store(Box::new(error))
}

impl StoreOfRecord for PgStore {
    fn totals<'a>(&'a self, counters: &'a [&'a str]) -> StoreFuture<'a, Vec<i64>> {
        Box::pin(async move {
            totals(&self.pool, &self.schema, counters)
                .await
                .map_err(store_error)
        })
    }

    fn has_liked<'a>(&'a self, counter: &'a str, actor: &'a str) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let client = self.pool.get().await.map_err(store_error)?;
            let row = (client
                .query_opt(&self.schema.sql.has_liked, &[&counter, &actor])
                .await)
                .map_err(store_error)?;
            Ok(row.is_some())
        })
    }

    fn shares<'a>(&'a self, counter: &'a str, groups: u32) -> StoreFuture<'a, Vec<Option<i64>>> {
        Box::pin(async move {
            let client = self.pool.get().await.map_err(store_error)?;
            let rows =
                (client.query(&self.schema.sql.shares, &[&counter]).await).map_err(store_error)?;
            let mut shares = vec![None; groups as usize];
            for row in rows {
                let shard: i32 = row.get(0);
                if let Some(slot) = shares.get_mut(shard as usize) {
                    *slot = Some(row.get(1));
                }
            }
            Ok(shares)
        })
    }
}

/// The totals of `counters` in the store, in order (0 for a counter without shares).
pub async fn totals(pool: &Pool, schema: &Schema, counters: &[&str]) -> Result<Vec<i64>, PgError> {
    let client = pool.get().await.map_err(|e| PgError::Pool(e.to_string()))?;
    let rows = client.query(&schema.sql.totals, &[&counters]).await?;
    let found: std::collections::HashMap<String, i64> =
        rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    Ok(counters
        .iter()
        .map(|c| found.get(*c).copied().unwrap_or(0))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_quoted_and_checked() {
        assert_eq!(quote("tally"), "\"tally\"");
        assert_eq!(quote("a\"b"), "\"a\"\"b\"");
        assert_eq!(literal("it's"), "'it''s'");
        assert!(Schema::new(&"x".repeat(64)).is_err());
        assert!(Schema::new("").is_err());
        let schema = Schema::new("tally-test").expect("valid");
        assert!(schema.sql.upsert_shares.contains("\"tally-test\".shares"));
    }

    #[test]
    fn migrations_are_numbered_in_order_from_one() {
        for (i, (version, _, sql)) in MIGRATIONS.iter().enumerate() {
            assert_eq!(*version, i as i32 + 1);
            assert!(sql.contains("{schema}"));
        }
    }
}
