//! `tally-server`: the tally HTTP API (see the library's documentation for the routes).
//!
//! Configured like the aggregator: flags, or `TALLY_*` variables. A Redis URL holding a password
//! is refused on the command line (command lines are visible to every local user): give it in
//! `TALLY_REDIS_URL`. There are no API tokens yet: the server listens on loopback by default and
//! says so at start; put it behind something that authenticates before listening elsewhere.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{CommandFactory, FromArgMatches, Parser};
use tally_common::{CachedReader, Keyspace, Namespaces, Reader, RedisConn, RedisTarget, defaults};
use tally_server::{AppState, router};

/// The default listen address: loopback only.
const LISTEN: &str = "127.0.0.1:8080";

#[derive(Debug, Parser)]
#[command(
    name = "tally-server",
    version,
    about = "Serve tally counter totals over HTTP"
)]
struct Args {
    /// Address to listen on
    #[arg(long, env = "TALLY_LISTEN", default_value = LISTEN)]
    listen: SocketAddr,
    /// Redis URL (a password only through the variable)
    #[arg(long, env = "TALLY_REDIS_URL", hide_env_values = true, default_value = defaults::REDIS_URL)]
    redis_url: String,
    /// Prefix of every Redis key
    #[arg(long, env = "TALLY_KEY_PREFIX", default_value = defaults::KEY_PREFIX)]
    key_prefix: String,
    /// Shard groups, as given to the aggregator
    #[arg(long, env = "TALLY_SHARD_GROUPS", default_value_t = defaults::SHARD_GROUPS)]
    shard_groups: u32,
    /// Namespace policies (cache TTL), as given to the aggregator
    #[arg(long, env = "TALLY_NAMESPACES")]
    namespaces: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let matches = Args::command().get_matches();
    let args = Args::from_arg_matches(&matches)?;
    let target = RedisTarget::parse(&args.redis_url)?;
    if target.has_password()
        && matches.value_source("redis_url") == Some(clap::parser::ValueSource::CommandLine)
    {
        bail!(
            "the Redis URL holds a password and command lines are visible to every local user: give it in TALLY_REDIS_URL"
        );
    }
    let conn = RedisConn::connect_to(&target)
        .await
        .with_context(|| format!("connecting to {target}"))?;
    let namespaces = match &args.namespaces {
        Some(path) => Namespaces::from_file(path)?,
        None => Namespaces::default(),
    };
    let keyspace = Keyspace::new(args.key_prefix, args.shard_groups)?;
    let reader = CachedReader::new(Reader::new(conn.clone(), keyspace), Arc::new(namespaces));
    let app = router(Arc::new(AppState { reader, conn }));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let addr = listener.local_addr()?;
    if addr.ip().is_loopback() {
        tracing::info!(%addr, redis = %target, "serving the tally API on loopback only (no API tokens yet)");
    } else {
        tracing::warn!(%addr, redis = %target, "serving the tally API beyond loopback without API tokens: put it behind something that authenticates");
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        })
        .await?;
    Ok(())
}
