//! What tally's programs share as programs, below the daemon: the aggregator, `tally-server` and
//! the `tally` command line each read settings, take credentials, stop on signals and read a
//! topic's ends, the same way.
//!
//! - [`config`]: where counts are stored, the PostgreSQL store's settings, `key=value` flags,
//!   TOML files.
//! - [`error`]: [`ConfigError`], what a configuration and its credentials report.
//! - [`http`]: the one HTTP server, every resource a client can make it hold bounded.
//! - [`secrets`]: where credentials come from (environment, files) and where they are refused
//!   (flags).
//! - [`settings`](mod@settings): a daemon's settings, each declared once (`settings!`), and the settings
//!   file and Kafka options every daemon takes.
//! - [`shutdown`]: signals into a cancellation token.
//! - [`topic`]: a topic's partitions, their ends, and reading offset ranges back.

pub mod config;
pub mod error;
pub mod http;
pub mod secrets;
pub mod settings;
pub mod shutdown;
pub mod topic;

pub use error::ConfigError;
