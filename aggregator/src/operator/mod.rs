//! The operator's surface: how the daemon is configured and how it is watched.
//!
//! - [`config`]: the typed [`config::Config`], one declaration per setting, and the command line
//!   that builds it. Its errors, the credentials, shutdown on signals and reading a topic are
//!   `tally_ops`'s, shared with `tally-server` and the `tally` command line.
//! - [`metrics`]: the Prometheus metrics.
//! - [`http`]: `/metrics`, `/healthz` and `/readyz`.
//! - [`pauses`]: how long partitions went without a durable flush, from samples of the
//!   metrics (what the bench and the failover tests measure a rebalance by).

pub mod config;
pub mod http;
pub mod metrics;
pub mod pauses;
