//! `tally-server`: the tally HTTP API and operator console (see the library's documentation for
//! the routes, and `tally_server::config` for the settings).
//!
//! Without a token file the server answers every request, so it refuses to listen anywhere but
//! loopback, and says so at start; with one, every `/v1/` route needs a bearer token with the
//! route's scope.

use std::sync::Arc;

use anyhow::{Context, bail};
use rdkafka::ClientConfig;
use tally_common::{CachedReader, Keyspace, Namespaces, Reader, RedisConn, pg};
use tally_ops::secrets::Secrets;
use tally_producer::{Counts, DirectWriter, Producer, ProducerConfig};
use tally_server::auth::Tokens;
use tally_server::config::Cli;
use tally_server::metrics::Metrics;
use tally_server::pipeline::Pipeline;
use tally_server::{AppState, router};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let cli = Cli::from_matches(&Cli::command().get_matches())?;
    let config = cli.into_config_with(Secrets::from_env()?)?;
    let tokens = match &config.tokens {
        Some(path) => Some(Arc::new(Tokens::from_file(path)?)),
        None => None,
    };
    if tokens.is_none() && !config.listen.ip().is_loopback() {
        bail!(
            "refusing to listen on {} without a token file: anyone who reaches it could send events; give --tokens (TALLY_TOKENS), or listen on loopback",
            config.listen
        );
    }
    let conn = RedisConn::connect_to(&config.redis)
        .await
        .with_context(|| format!("connecting to {}", config.redis))?;
    let namespaces = Arc::new(match &config.namespaces {
        Some(path) => Namespaces::from_file(path)?,
        None => Namespaces::default(),
    });
    let keyspace = Keyspace::new(config.key_prefix.clone(), config.shard_groups)?;
    let mut reader = Reader::new(conn.clone(), keyspace.clone());
    let mut direct = DirectWriter::new(conn.clone(), keyspace.clone(), namespaces.clone());
    if let Some(postgres) = &config.postgres {
        // The counts live in PostgreSQL: read the rows on a cache miss, cache totals in Redis.
        let store = pg::PgStore::connect(
            &postgres.url,
            pg::PoolOptions {
                password: postgres.password.as_deref(),
                size: postgres.pool_size,
                statement_timeout: Some(postgres.statement_timeout),
            },
            &config.key_prefix,
        )?;
        reader = reader.with_store(Arc::new(store.clone()));
        // Direct namespaces' writes go to the rows too.
        direct = direct.with_store(store);
    }
    let reader = CachedReader::new(reader, namespaces.clone());

    let mut producer_config = ProducerConfig::new(config.brokers.clone(), config.topic.clone())
        .option(
            "message.timeout.ms",
            config.produce_timeout.as_millis().to_string(),
        )
        // An API answers per request: send at once rather than batch for throughput.
        .option("linger.ms", "1");
    let mut kafka = ClientConfig::new();
    kafka.set("bootstrap.servers", &config.brokers);
    for (key, value) in &config.kafka {
        producer_config = producer_config.option(key.clone(), value.clone());
        kafka.set(key, value);
    }
    let producer = Producer::new(&producer_config)?;
    let counts = Counts::new(namespaces, Some(producer.clone()), Some(direct), reader);
    let pipeline = Pipeline::new(&kafka, &config.topic, &config.group)?;
    let state = Arc::new(AppState {
        counts,
        producer: producer.clone(),
        conn,
        pipeline,
        metrics: Metrics::new(),
    });
    let app = router(state, tokens.clone());
    let tls = match &config.tls {
        None => None,
        Some((cert, key)) => {
            let read = |path: &std::path::PathBuf| {
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))
            };
            let identity = tally_ops::http::tls_identity(&read(cert)?, &read(key)?)
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("HTTPS with {} and {}", cert.display(), key.display()))?;
            Some(identity)
        }
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listening on {}", config.listen))?;
    let addr = listener.local_addr()?;
    match &tokens {
        Some(tokens) => {
            tracing::info!(%addr, scheme, redis = %config.redis, brokers = %config.brokers, topic = %config.topic, tokens = tokens.len(), "serving the tally API: every /v1/ route needs a bearer token")
        }
        None => {
            tracing::warn!(%addr, scheme, redis = %config.redis, brokers = %config.brokers, topic = %config.topic, "serving the tally API on loopback only, without tokens: every local process may read and write counts")
        }
    }
    let shutdown = tally_ops::shutdown::on_signals()?;
    tally_ops::http::serve(
        listener,
        app,
        tally_ops::http::Limits::default(),
        tls,
        shutdown,
    )
    .await;
    // Events handed to librdkafka by requests cut short by the shutdown still get their chance.
    producer.flush().await?;
    Ok(())
}
