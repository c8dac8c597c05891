//! Configuration primitives every tally program shares: where counts are stored ([`Store`]) and
//! the PostgreSQL store's settings ([`PostgresTarget`]), `key=value` flags, TOML files, and the
//! positivity check.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::error::ConfigError;

/// Where counts are stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Store {
    /// Sharded Redis keys (the store and the cache of totals are one).
    #[default]
    Redis,
    /// Share rows in PostgreSQL, the store of record (the aggregator's `pg_sink`); Redis keeps the cache of
    /// totals and the trending counters.
    Postgres,
}

/// Where the PostgreSQL store is.
#[derive(Clone)]
pub struct PostgresTarget {
    /// Its URL (`postgres://user@host:port/db`) or key=value connection string, without the
    /// password.
    pub url: String,
    /// The password, from `TALLY_POSTGRES_PASSWORD[_FILE]`.
    pub password: Option<String>,
    /// Most connections held.
    pub pool_size: usize,
    /// Longest one statement may run.
    pub statement_timeout: Duration,
}

impl std::fmt::Debug for PostgresTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTarget")
            .field("url", &crate::secrets::masked_postgres_url(&self.url))
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("pool_size", &self.pool_size)
            .field("statement_timeout", &self.statement_timeout)
            .finish()
    }
}

/// A `key=value` flag, split (for `--kafka-option`).
pub fn parse_key_value(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not key=value"))?;
    Ok((k.trim().to_owned(), v.trim().to_owned()))
}

/// Reads a TOML file of settings (the aggregator's, or another daemon's of the same conventions).
pub fn read_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source: Box::new(source),
    })
}

impl PostgresTarget {
    /// The PostgreSQL store the settings name, if `store` is PostgreSQL (which needs `url`);
    /// the password comes later, from the secrets.
    pub fn from_settings(
        store: Store,
        url: Option<String>,
        pool_size: usize,
        statement_timeout_ms: u64,
    ) -> Result<Option<Self>, ConfigError> {
        match (store, url) {
            (Store::Redis, _) => Ok(None),
            (Store::Postgres, None) => Err(ConfigError::Invalid {
                name: "postgres_url",
                why: "--store postgres needs --postgres-url (or TALLY_POSTGRES_URL)".to_owned(),
            }),
            (Store::Postgres, Some(url)) => Ok(Some(PostgresTarget {
                url,
                password: None,
                pool_size: positive("postgres_pool_size", pool_size)?,
                statement_timeout: Duration::from_millis(positive(
                    "postgres_statement_timeout_ms",
                    statement_timeout_ms,
                )?),
            })),
        }
    }
}

/// `value`, refused if zero.
pub fn positive<T: Default + PartialEq>(name: &'static str, value: T) -> Result<T, ConfigError> {
    if value == T::default() {
        Err(ConfigError::Invalid {
            name,
            why: "must be greater than 0".to_owned(),
        })
    } else {
        Ok(value)
    }
}
