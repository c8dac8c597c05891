//! The server's configuration, with the aggregator's conventions: defaults, an optional TOML file
//! (`--config`), `TALLY_*` variables and flags, in rising order of precedence; librdkafka
//! options from the file's `[kafka]` table or `--kafka-option key=value`. Credentials come from
//! the environment or the files it names, never flags (the aggregator's
//! [`tally_ops::secrets`]: `TALLY_REDIS_PASSWORD[_FILE]`, `TALLY_KAFKA_SASL_PASSWORD[_FILE]`
//! and the rest); a Redis URL holding a password given as a flag is refused.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tally_common::{RedisTarget, defaults};
use tally_ops::ConfigError;
use tally_ops::config::{PostgresTarget, Store};
use tally_ops::secrets::Secrets;
use tally_ops::settings::{FileAndKafka, with_defaults_in_help};

/// The defaults of the settings below.
pub mod default {
    /// Where the API listens: loopback only.
    pub const LISTEN: &str = "127.0.0.1:8080";
    /// Longest `POST /v1/events` waits for Kafka's acknowledgements, in ms.
    pub const PRODUCE_TIMEOUT_MS: u64 = 5_000;
    /// Connections to the PostgreSQL store.
    pub const POSTGRES_POOL_SIZE: usize = 8;
    /// Longest one read of the PostgreSQL store may run, in ms.
    pub const POSTGRES_STATEMENT_TIMEOUT_MS: u64 = 5_000;
}

tally_ops::settings! {
    defaulted {
        /// Address to listen on; anything but loopback needs a token file
        listen: SocketAddr = default::LISTEN.parse().expect("a valid address"), "TALLY_LISTEN", [];
        /// Redis URL (a password only through TALLY_REDIS_URL, TALLY_REDIS_PASSWORD or the file)
        redis_url: String = defaults::REDIS_URL.to_owned(), "TALLY_REDIS_URL", [hide_env_values = true];
        /// Prefix of every Redis key, as given to the aggregator
        key_prefix: String = defaults::KEY_PREFIX.to_owned(), "TALLY_KEY_PREFIX", [];
        /// Shard groups, as given to the aggregator
        shard_groups: u32 = defaults::SHARD_GROUPS, "TALLY_SHARD_GROUPS", [];
        /// Kafka bootstrap servers
        brokers: String = defaults::BROKERS.to_owned(), "TALLY_BROKERS", [];
        /// Topic events are appended to
        topic: String = defaults::TOPIC.to_owned(), "TALLY_TOPIC", [];
        /// The aggregators' consumer group, for the pipeline's committed offsets
        group: String = defaults::GROUP.to_owned(), "TALLY_GROUP", [];
        /// Longest POST /v1/events waits for Kafka to acknowledge its events, in ms
        produce_timeout_ms: u64 = default::PRODUCE_TIMEOUT_MS, "TALLY_PRODUCE_TIMEOUT_MS", [];
        /// Where the aggregator stores counts: redis, or postgres (the share rows, read on a cache miss; Redis keeps the cache of totals)
        store: Store = Store::default(), "TALLY_STORE", [value_enum];
    }
    optional {
        /// TOML file of API tokens (their SHA-256) and scopes; without one, only loopback [default: none]
        tokens: PathBuf, "TALLY_TOKENS", [];
        /// PEM certificate chain: serve HTTPS (with --tls-key) [default: none, plain HTTP]
        tls_cert: PathBuf, "TALLY_TLS_CERT", [requires = "tls_key"];
        /// PEM private key (PKCS#8) of --tls-cert [default: none]
        tls_key: PathBuf, "TALLY_TLS_KEY", [requires = "tls_cert"];
        /// Namespace policies file, as given to the aggregator [default: none]
        namespaces: PathBuf, "TALLY_NAMESPACES", [];
        /// PostgreSQL, with --store postgres (a password only through TALLY_POSTGRES_PASSWORD, TALLY_POSTGRES_URL or the file) [default: none]
        postgres_url: String, "TALLY_POSTGRES_URL", [hide_env_values = true];
    }
}

/// The command line of `tally-server`.
#[derive(Debug, clap::Parser)]
#[command(
    name = "tally-server",
    version,
    about = "Serve tally's counts over HTTP: totals, events, likes, the top counters, and an operator console"
)]
pub struct Cli {
    /// `--config` and `--kafka-option` (for the producer and the pipeline's reader), as every
    /// tally daemon takes them.
    #[command(flatten)]
    pub given: FileAndKafka,
    /// Every other setting.
    #[command(flatten)]
    pub settings: Settings,
}

/// The resolved configuration.
#[derive(Clone)]
pub struct Config {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The token file, if any.
    pub tokens: Option<PathBuf>,
    /// HTTPS: the certificate chain's file and its key's, if any.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Redis, credentials included.
    pub redis: RedisTarget,
    /// The key prefix.
    pub key_prefix: String,
    /// The shard groups.
    pub shard_groups: u32,
    /// The namespace policies file, if any.
    pub namespaces: Option<PathBuf>,
    /// Kafka's brokers.
    pub brokers: String,
    /// tally's topic.
    pub topic: String,
    /// The aggregators' group.
    pub group: String,
    /// How long events may wait for Kafka.
    pub produce_timeout: Duration,
    /// Raw librdkafka options, secrets included.
    pub kafka: BTreeMap<String, String>,
    /// The PostgreSQL store of record, with `--store postgres`.
    pub postgres: Option<PostgresTarget>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("listen", &self.listen)
            .field("tokens", &self.tokens)
            .field("tls", &self.tls)
            .field("redis", &self.redis)
            .field("key_prefix", &self.key_prefix)
            .field("shard_groups", &self.shard_groups)
            .field("namespaces", &self.namespaces)
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("produce_timeout", &self.produce_timeout)
            .field("kafka_options", &self.kafka.keys().collect::<Vec<_>>())
            .field("postgres", &self.postgres)
            .finish()
    }
}

impl Settings {
    /// Fills in defaults and checks the values.
    pub fn resolve(self) -> Result<Config, ConfigError> {
        let v = self.values();
        let redis = RedisTarget::parse(&v.redis_url).map_err(|e| ConfigError::Invalid {
            name: "redis_url",
            why: e.to_string(),
        })?;
        if v.produce_timeout_ms == 0 {
            return Err(ConfigError::Invalid {
                name: "produce_timeout_ms",
                why: "must be above 0".to_owned(),
            });
        }
        let postgres = PostgresTarget::from_settings(
            v.store,
            v.postgres_url,
            default::POSTGRES_POOL_SIZE,
            default::POSTGRES_STATEMENT_TIMEOUT_MS,
        )?;
        let tls = match (v.tls_cert, v.tls_key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            (Some(_), None) | (None, Some(_)) => {
                return Err(ConfigError::Invalid {
                    name: "tls_cert",
                    why: "HTTPS needs both tls_cert and tls_key".to_owned(),
                });
            }
        };
        Ok(Config {
            postgres,
            tls,
            listen: v.listen,
            tokens: v.tokens,
            redis,
            key_prefix: v.key_prefix,
            shard_groups: v.shard_groups,
            namespaces: v.namespaces,
            brokers: v.brokers,
            topic: v.topic,
            group: v.group,
            produce_timeout: Duration::from_millis(v.produce_timeout_ms),
            kafka: v.kafka,
        })
    }
}

impl Cli {
    /// The command line's grammar, with each setting's default in its help.
    pub fn command() -> clap::Command {
        with_defaults_in_help(
            <Self as clap::CommandFactory>::command(),
            &Settings::defaults(),
        )
    }

    /// Builds the command line from parsed `matches`, refusing secrets given as flags.
    pub fn from_matches(matches: &clap::ArgMatches) -> Result<Self, ConfigError> {
        let cli =
            <Self as clap::FromArgMatches>::from_arg_matches(matches).unwrap_or_else(|e| e.exit());
        cli.given.refuse_secret_flags(
            cli.settings.redis_url.as_deref(),
            cli.settings.postgres_url.as_deref(),
            matches,
        )?;
        Ok(cli)
    }

    /// Resolves the command line (with the file it names, if any) and `secrets` into a
    /// [`Config`]. Secrets override the same options from the file or flags.
    pub fn into_config_with(self, secrets: Secrets) -> Result<Config, ConfigError> {
        let mut config =
            Settings::layered(&self.given, self.settings, &secrets.kafka)?.resolve()?;
        config.redis = secrets.redis_target(config.redis)?;
        if let Some(postgres) = &mut config.postgres {
            postgres.password = secrets.postgres_password.clone();
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use clap::FromArgMatches;

    use super::*;

    fn cli(args: &[&str]) -> Result<Cli, ConfigError> {
        let matches = Cli::command()
            .try_get_matches_from(std::iter::once("tally-server").chain(args.iter().copied()))
            .expect("parses");
        Cli::from_matches(&matches)
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("tally-server-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("server.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:9000\"\ntopic = \"from.file\"\nshard_groups = 4\n[kafka]\n\"linger.ms\" = \"2\"\n",
        )
        .expect("written");
        let config = cli(&[
            "--config",
            path.to_str().expect("utf-8"),
            "--topic",
            "from.flag",
        ])
        .expect("valid")
        .into_config_with(Secrets::default())
        .expect("resolves");
        assert_eq!(config.listen.port(), 9000);
        assert_eq!(config.topic, "from.flag");
        assert_eq!(config.shard_groups, 4);
        assert_eq!(config.kafka.get("linger.ms").map(String::as_str), Some("2"));
        assert_eq!(config.brokers, defaults::BROKERS);
        assert_eq!(
            config.produce_timeout,
            Duration::from_millis(default::PRODUCE_TIMEOUT_MS)
        );
        assert!(toml::from_str::<Settings>("lisen = \"x\"").is_err());
    }

    #[test]
    fn the_example_file_follows_the_declaration() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/server.example.toml");
        let text = std::fs::read_to_string(&path).expect("the example file");
        let wrong = tally_ops::settings::example_mismatches(
            &text,
            &Settings::names(),
            &Settings::defaults(),
        );
        assert!(wrong.is_empty(), "deploy/server.example.toml: {wrong:?}");
        Settings::from_file(&path)
            .and_then(Settings::resolve)
            .expect("the example file resolves");
    }

    #[test]
    fn secrets_as_flags_are_refused_and_hidden_once_resolved() {
        assert!(cli(&["--redis-url", "redis://:pw@127.0.0.1:6379"]).is_err());
        assert!(cli(&["--kafka-option", "sasl.password=pw"]).is_err());
        let secrets = Secrets::from_lookup(|name| {
            (name == "TALLY_KAFKA_SASL_PASSWORD").then(|| "hunter2".to_owned())
        })
        .expect("secrets");
        let config = cli(&[])
            .expect("valid")
            .into_config_with(secrets)
            .expect("resolves");
        assert_eq!(
            config.kafka.get("sasl.password").map(String::as_str),
            Some("hunter2")
        );
        assert!(!format!("{config:?}").contains("hunter2"));
    }

    #[test]
    fn the_help_documents_the_defaults_applied() {
        let help = Cli::command().render_help().to_string();
        for shown in [
            format!("[default: {}]", default::LISTEN),
            format!("[default: {}]", default::PRODUCE_TIMEOUT_MS),
            format!("[default: {}]", defaults::TOPIC),
            format!("[default: {}]", defaults::SHARD_GROUPS),
        ] {
            assert!(help.contains(&shown), "{shown} missing from --help");
        }
        let _ = Cli::from_arg_matches;
    }
}
