//! [`ConfigError`]: why a configuration is unusable, shared by the settings (each program's `config`) and
//! the credentials (`crate::secrets`), which both report into it.

use std::path::PathBuf;

use tally_common::keyspace::KeyspaceError;
use tally_common::namespace::NamespaceError;

/// Why the configuration is unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML for these settings.
    #[error("invalid config file {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        source: Box<toml::de::Error>,
    },
    /// A setting has a value it cannot take.
    #[error("invalid setting {name}: {why}")]
    Invalid {
        /// The setting.
        name: &'static str,
        /// Why.
        why: String,
    },
    /// The key prefix or shard group count is invalid.
    #[error(transparent)]
    Keyspace(#[from] KeyspaceError),
    /// The namespace file is unusable.
    #[error(transparent)]
    Namespaces(#[from] NamespaceError),
}
