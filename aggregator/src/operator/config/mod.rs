//! The aggregator's configuration: one typed [`Config`], resolved from defaults, an optional TOML
//! file (`--config`), `TALLY_*` environment variables and flags, in rising order of precedence.
//!
//! Every setting is a flag with an environment variable (`--flush-interval-ms` /
//! `TALLY_FLUSH_INTERVAL_MS`) and a key of the same name in the file (`flush_interval_ms = 500`).
//! Raw librdkafka options pass through from the file's `[kafka]` table or repeated
//! `--kafka-option key=value` flags (`TALLY_KAFKA_OPTIONS=k=v,k=v`), applied over tally's own
//! consumer settings. Cross-field checks run in [`Settings::resolve`]. Credentials come from the
//! environment or files, never flags: see [`tally_ops::secrets`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tally_common::{GroupingRule, Keyspace, Namespaces, Policy, RedisTarget};

use crate::machine::pace::{Limits, MEMBERSHIPS_PER_ENTRY, Size};
pub use tally_ops::ConfigError;
use tally_ops::config::positive;
pub use tally_ops::config::{PostgresTarget, Store};
use tally_ops::secrets::Secrets;

mod choices;
mod settings;

pub use choices::{Atomicity, Delivery, Fetch, LogFormat};
pub use settings::{Settings, Values, with_defaults_in_help};
pub use tally_ops::settings::{FileAndKafka, Shown};

/// The command line of `tally-aggregator`.
#[derive(Debug, clap::Parser)]
#[command(
    name = "tally-aggregator",
    version,
    about = "Sums counter events from Kafka in micro-batches and flushes them to sharded Redis keys"
)]
pub struct Cli {
    /// `--config` and `--kafka-option`, as every tally daemon takes them.
    #[command(flatten)]
    pub given: FileAndKafka,
    /// Every other setting.
    #[command(flatten)]
    pub settings: Settings,
}

/// The resolved configuration.
#[derive(Clone)]
pub struct Config {
    /// Kafka bootstrap servers.
    pub brokers: String,
    /// Topic holding counter events.
    pub topic: String,
    /// Consumer group.
    pub group: String,
    /// Where Redis is.
    pub redis: RedisTarget,
    /// Flush triggers per partition.
    pub limits: Limits,
    /// Where /metrics and /healthz are served.
    pub metrics_addr: SocketAddr,
    /// Topic for malformed messages.
    pub dead_letter_topic: String,
    /// The Redis key layout.
    pub keyspace: Keyspace,
    /// Largest message accepted.
    pub max_message_bytes: usize,
    /// Longest graceful shutdown flush.
    pub shutdown_timeout: Duration,
    /// Longest flush of revoked partitions during a rebalance.
    pub revoke_timeout: Duration,
    /// Longest wait between flush retries.
    pub retry_max_backoff: Duration,
    /// How often an idle owned partition checks its standing in Redis.
    pub check_idle_interval: Duration,
    /// Delivery guarantee.
    pub delivery: Delivery,
    /// Which group an event's delta goes to, for namespaces that do not say.
    pub grouping: GroupingRule,
    /// How many groups one partition's counters spread over, grouped by partition
    /// (`tally_common::keyspace::Spread`).
    pub partition_spread: u32,
    /// Every namespace's policy (grouping, dedup).
    pub namespaces: Arc<Namespaces>,
    /// Writes per second per shard above which the shard monitor raises a shard count (0: off).
    pub shard_threshold: u64,
    /// How often trending counters are published (zero: off).
    pub trending_interval: Duration,
    /// How exactly-once writes are made atomic.
    pub redis_atomicity: Atomicity,
    /// Where counts are stored.
    pub store: Store,
    /// The PostgreSQL store, with `--store postgres`.
    pub postgres: Option<PostgresTarget>,
    /// Log format.
    pub log_format: LogFormat,
    /// How partitions are read.
    pub fetch: Fetch,
    /// Raw librdkafka options, applied last.
    pub kafka: BTreeMap<String, String>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Raw Kafka options may hold credentials: show only their names.
        f.debug_struct("Config")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("redis", &self.redis)
            .field("limits", &self.limits)
            .field("metrics_addr", &self.metrics_addr)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("keyspace", &self.keyspace)
            .field("delivery", &self.delivery)
            .field("grouping", &self.grouping)
            .field("partition_spread", &self.partition_spread)
            .field("namespaces", &self.namespaces)
            .field("shard_threshold", &self.shard_threshold)
            .field("trending_interval", &self.trending_interval)
            .field("redis_atomicity", &self.redis_atomicity)
            .field("store", &self.store)
            .field("fetch", &self.fetch)
            .field("postgres", &self.postgres)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("revoke_timeout", &self.revoke_timeout)
            .field("kafka_options", &self.kafka.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Settings {
    /// Fills in defaults and checks the values.
    pub fn resolve(self) -> Result<Config, ConfigError> {
        let v = self.values();
        let limits = limits(&v)?;
        if v.topic == v.dead_letter_topic {
            return Err(ConfigError::Invalid {
                name: "dead_letter_topic",
                why: "must differ from the events topic".to_owned(),
            });
        }
        let grouping = v.grouping;
        let namespaces = match &v.namespaces {
            Some(path) => {
                Namespaces::from_toml_with_grouping(&Namespaces::read(path)?, Some(grouping))?
            }
            None => Namespaces::uniform(Policy {
                grouping,
                ..Policy::default()
            }),
        };
        let delivery = v.delivery;
        if delivery == Delivery::AtLeastOnce && namespaces.any_dedup() {
            return Err(ConfigError::Invalid {
                name: "delivery",
                why: "namespaces that deduplicate need exactly-once delivery".to_owned(),
            });
        }
        if delivery == Delivery::AtLeastOnce && namespaces.widest_idempotency_window_ms().is_some()
        {
            return Err(ConfigError::Invalid {
                name: "delivery",
                why: "namespaces with an idempotency window need exactly-once delivery".to_owned(),
            });
        }
        if delivery == Delivery::AtLeastOnce && namespaces.shortest_expiry_ms().is_some() {
            return Err(ConfigError::Invalid {
                name: "delivery",
                why: "namespaces whose counters expire need exactly-once delivery".to_owned(),
            });
        }
        check_kafka_options(&v.kafka, delivery)?;
        let redis = RedisTarget::parse(&v.redis_url).map_err(|e| ConfigError::Invalid {
            name: "redis_url",
            why: e.to_string(),
        })?;
        let redis_atomicity = v.redis_atomicity;
        if redis_atomicity == Atomicity::Transactions && redis.is_cluster() {
            return Err(ConfigError::Invalid {
                name: "redis_atomicity",
                why: "transactions need a standalone Redis; on Redis Cluster use scripts"
                    .to_owned(),
            });
        }
        let store = v.store;
        if store == Store::Postgres && namespaces.any_windows() {
            return Err(ConfigError::Invalid {
                name: "store",
                why: "windowed counts are kept in Redis only: a namespace with windows needs --store redis".to_owned(),
            });
        }
        if store == Store::Postgres && namespaces.shortest_expiry_ms().is_some() {
            return Err(ConfigError::Invalid {
                name: "store",
                why: "counters expire in Redis only for now: a namespace with expire_after needs --store redis".to_owned(),
            });
        }
        let postgres = PostgresTarget::from_settings(
            store,
            v.postgres_url,
            v.postgres_pool_size,
            v.postgres_statement_timeout_ms,
        )?;
        let keyspace = Keyspace::new(v.key_prefix, v.shard_groups)?;
        // The spread bounds Redis scripts; a PostgreSQL transaction per group would only add
        // round trips and commits.
        let partition_spread = v.partition_spread.unwrap_or(match store {
            Store::Redis => tally_common::keyspace::DEFAULT_SPREAD.min(keyspace.groups()),
            Store::Postgres => 1,
        });
        if partition_spread == 0 || partition_spread > keyspace.groups() {
            return Err(ConfigError::Invalid {
                name: "partition_spread",
                why: format!(
                    "must be between 1 and the number of shard groups ({}), not {partition_spread}",
                    keyspace.groups()
                ),
            });
        }
        let ms = |name, value| Ok::<_, ConfigError>(Duration::from_millis(positive(name, value)?));
        Ok(Config {
            brokers: v.brokers,
            topic: v.topic,
            group: v.group,
            redis,
            limits,
            metrics_addr: v.metrics_addr,
            dead_letter_topic: v.dead_letter_topic,
            keyspace,
            max_message_bytes: positive("max_message_bytes", v.max_message_bytes)?,
            shutdown_timeout: ms("shutdown_timeout_ms", v.shutdown_timeout_ms)?,
            revoke_timeout: ms("revoke_timeout_ms", v.revoke_timeout_ms)?,
            retry_max_backoff: ms("retry_max_backoff_ms", v.retry_max_backoff_ms)?,
            check_idle_interval: ms("check_idle_interval_ms", v.check_idle_interval_ms)?,
            delivery,
            grouping,
            partition_spread,
            namespaces: Arc::new(namespaces),
            shard_threshold: v.shard_threshold,
            trending_interval: Duration::from_millis(v.trending_interval_ms),
            redis_atomicity,
            store,
            postgres,
            log_format: v.log_format,
            fetch: v.fetch,
            kafka: v.kafka,
        })
    }
}

/// The flush triggers.
fn limits(v: &Values) -> Result<Limits, ConfigError> {
    let size = |events_name, events, counters_name, counters| {
        Ok::<_, ConfigError>(Size {
            max_events: positive(events_name, events)?,
            max_counters: positive(counters_name, counters)?,
            // The flush script's weight; a sink that writes likes otherwise says its own.
            memberships_per_entry: MEMBERSHIPS_PER_ENTRY,
            max_group_entries: usize::MAX,
        })
    };
    Ok(Limits {
        flush_interval: Duration::from_millis(positive("flush_interval_ms", v.flush_interval_ms)?),
        live: size(
            "max_batch_events",
            v.max_batch_events,
            "max_batch_counters",
            v.max_batch_counters,
        )?,
        catch_up: size(
            "catch_up_max_batch_events",
            v.catch_up_max_batch_events,
            "catch_up_max_batch_counters",
            v.catch_up_max_batch_counters,
        )?,
        catch_up_interval: Duration::from_millis(positive(
            "catch_up_flush_interval_ms",
            v.catch_up_flush_interval_ms,
        )?),
    })
}

/// Raw librdkafka options tally cannot run with.
fn check_kafka_options(
    kafka: &BTreeMap<String, String>,
    delivery: Delivery,
) -> Result<(), ConfigError> {
    if kafka.contains_key("enable.auto.commit") {
        return Err(ConfigError::Invalid {
            name: "kafka.enable.auto.commit",
            why: "tally commits offsets itself, only after a flush is durable".to_owned(),
        });
    }
    // Exactly-once resumes a partition by seeking to an absolute offset (the ledger's, or the
    // log's low watermark). If retention deletes past it before the fetch, librdkafka applies
    // `auto.offset.reset`: `latest` would then skip every event in between, silently.
    if let Some(reset) = kafka.get("auto.offset.reset")
        && delivery == Delivery::ExactlyOnce
        && !matches!(
            reset.as_str(),
            "earliest" | "smallest" | "beginning" | "error"
        )
    {
        return Err(ConfigError::Invalid {
            name: "kafka.auto.offset.reset",
            why: format!(
                "{reset:?} would skip events whose offsets retention deleted under a resuming \
                 partition; exactly-once needs earliest (the default) or error"
            ),
        });
    }
    Ok(())
}

impl Cli {
    /// The command line's grammar, with each setting's default in its help.
    pub fn command() -> clap::Command {
        with_defaults_in_help(<Self as clap::CommandFactory>::command())
    }

    /// Parses the process's command line (exiting with clap's message on a usage error), and
    /// refuses secrets given as flags (see [`tally_ops::secrets`]).
    pub fn from_command_line() -> Result<Self, ConfigError> {
        let matches = Self::command().get_matches();
        Self::from_matches(&matches)
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

    /// Resolves the command line (with the file it names, if any) and the secrets in the
    /// environment into a [`Config`].
    pub fn into_config(self) -> Result<Config, ConfigError> {
        self.into_config_with(Secrets::from_env()?)
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
    use std::path::Path;

    use clap::Parser;

    use super::*;

    #[test]
    fn secrets_given_as_flags_are_refused_and_from_the_environment_taken() {
        let parse = |args: &[&str]| {
            let matches = <Cli as clap::CommandFactory>::command()
                .try_get_matches_from(args)
                .expect("parses");
            Cli::from_matches(&matches)
        };
        let refused = parse(&[
            "tally-aggregator",
            "--kafka-option",
            "sasl.password=hunter2",
        ]);
        assert!(matches!(
            refused,
            Err(ConfigError::Invalid {
                name: "kafka-option",
                ..
            })
        ));
        let refused = parse(&["tally-aggregator", "--redis-url", "redis://u:hunter2@h:1"]);
        assert!(matches!(
            refused,
            Err(ConfigError::Invalid {
                name: "redis-url",
                ..
            })
        ));
        let actor = parse(&["tally-aggregator", "--grouping", "actor"]).expect("parses");
        assert_eq!(actor.settings.grouping, Some(GroupingRule::ByActor));
        let cli = parse(&["tally-aggregator", "--kafka-option", "sasl.username=u"]).expect("fine");
        let secrets = Secrets::from_lookup(|name| {
            (name == "TALLY_KAFKA_SASL_PASSWORD").then(|| "hunter2".to_owned())
        })
        .expect("secrets");
        let config = cli.into_config_with(secrets).expect("config");
        assert_eq!(
            config.kafka.get("sasl.password").map(String::as_str),
            Some("hunter2")
        );
        assert!(!format!("{config:?}").contains("hunter2"));
    }

    #[test]
    fn the_help_shows_each_default_the_resolve_applies() {
        let c = Settings::default().resolve().expect("valid");
        let v = Settings::default().values();
        let applied = |id: &str| -> Option<String> {
            let limits = &c.limits;
            Some(match id {
                "brokers" => c.brokers.clone(),
                "topic" => c.topic.clone(),
                "group" => c.group.clone(),
                "redis_url" => c.redis.to_string(),
                "flush_interval_ms" => limits.flush_interval.as_millis().to_string(),
                "max_batch_events" => limits.live.max_events.to_string(),
                "max_batch_counters" => limits.live.max_counters.to_string(),
                "catch_up_max_batch_events" => limits.catch_up.max_events.to_string(),
                "catch_up_max_batch_counters" => limits.catch_up.max_counters.to_string(),
                "catch_up_flush_interval_ms" => limits.catch_up_interval.as_millis().to_string(),
                "metrics_addr" => c.metrics_addr.to_string(),
                "dead_letter_topic" => c.dead_letter_topic.clone(),
                "key_prefix" => c.keyspace.prefix().to_owned(),
                "shard_groups" => c.keyspace.groups().to_string(),
                "max_message_bytes" => c.max_message_bytes.to_string(),
                "shutdown_timeout_ms" => c.shutdown_timeout.as_millis().to_string(),
                "revoke_timeout_ms" => c.revoke_timeout.as_millis().to_string(),
                "check_idle_interval_ms" => c.check_idle_interval.as_millis().to_string(),
                "retry_max_backoff_ms" => c.retry_max_backoff.as_millis().to_string(),
                "delivery" => c.delivery.shown(),
                "grouping" => c.grouping.shown(),
                "shard_threshold" => c.shard_threshold.to_string(),
                "trending_interval_ms" => c.trending_interval.as_millis().to_string(),
                "redis_atomicity" => c.redis_atomicity.shown(),
                "log_format" => c.log_format.shown(),
                "store" => c.store.shown(),
                "fetch" => c.fetch.shown(),
                // Applied only with --store postgres.
                "postgres_pool_size" => v.postgres_pool_size.to_string(),
                "postgres_statement_timeout_ms" => v.postgres_statement_timeout_ms.to_string(),
                _ => return None,
            })
        };
        let command = Cli::command();
        let help = |id: &str| -> String {
            let arg = (command.get_arguments())
                .find(|a| a.get_id() == id)
                .unwrap_or_else(|| panic!("{id} is a flag"));
            arg.get_help().map(ToString::to_string).unwrap_or_default()
        };
        let defaults = Settings::defaults();
        for (id, default) in &defaults {
            let applied = applied(id).unwrap_or_else(|| panic!("{id}: add its applied default"));
            assert_eq!(*default, applied, "{id}");
            let help = help(id);
            assert!(
                help.ends_with(&format!("[default: {default}]")),
                "{id}: {help}"
            );
        }
        assert_eq!(defaults.len(), 29, "every default is checked");
        // The one default that depends on another setting is written by hand.
        assert!(help("partition_spread").ends_with(&format!(
            "[default: {}, or 1 with --store postgres]",
            c.partition_spread
        )));
        assert_eq!(c.keyspace, Keyspace::default());
    }

    /// The TOML inside `deploy/k8s/tally-aggregator.yaml`'s ConfigMap.
    fn k8s_config() -> String {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s/tally-aggregator.yaml");
        let yaml = std::fs::read_to_string(path).expect("the k8s manifest");
        let (_, after) = yaml
            .split_once("aggregator.toml: |\n")
            .expect("the ConfigMap holds aggregator.toml");
        after
            .lines()
            .take_while(|l| l.starts_with("    ") || l.is_empty())
            .map(|l| l.strip_prefix("    ").unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn the_example_file_and_the_k8s_config_follow_the_declaration() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/aggregator.example.toml");
        let text = std::fs::read_to_string(&path).expect("the example file");
        let wrong = tally_ops::settings::example_mismatches(
            &text,
            &Settings::names(),
            &Settings::defaults(),
        );
        assert!(
            wrong.is_empty(),
            "deploy/aggregator.example.toml: {wrong:?}"
        );
        let k8s: Settings = toml::from_str(&k8s_config()).expect("the k8s config's keys");
        k8s.resolve().expect("the k8s config resolves");
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("tally-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("a.toml");
        std::fs::write(
            &path,
            "topic = \"from-file\"\nflush_interval_ms = 250\n[kafka]\n\"fetch.max.bytes\" = \"1000\"\n",
        )
        .expect("written");
        let cli = Cli::try_parse_from([
            "tally-aggregator",
            "--config",
            path.to_str().expect("utf-8"),
            "--flush-interval-ms",
            "50",
            "--kafka-option",
            "client.id=x",
        ])
        .expect("parses");
        let c = cli.into_config().expect("valid");
        assert_eq!(c.topic, "from-file");
        assert_eq!(c.limits.flush_interval, Duration::from_millis(50));
        assert_eq!(
            c.kafka.get("fetch.max.bytes").map(String::as_str),
            Some("1000")
        );
        assert_eq!(c.kafka.get("client.id").map(String::as_str), Some("x"));
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn the_example_file_in_deploy_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/aggregator.example.toml");
        let c = Settings::from_file(&path)
            .and_then(Settings::resolve)
            .expect("the example config resolves");
        assert_eq!(
            c.kafka.get("session.timeout.ms").map(String::as_str),
            Some("45000")
        );
    }

    #[test]
    fn rejects_unknown_file_keys_and_bad_values() {
        assert!(toml::from_str::<Settings>("flush_intervl_ms = 5").is_err());
        let zero = Settings {
            flush_interval_ms: Some(0),
            ..Settings::default()
        };
        assert!(matches!(
            zero.resolve(),
            Err(ConfigError::Invalid {
                name: "flush_interval_ms",
                ..
            })
        ));
        let same = Settings {
            dead_letter_topic: Some("tally.events".to_owned()),
            ..Settings::default()
        };
        assert!(same.resolve().is_err());
        let groups = Settings {
            shard_groups: Some(0),
            ..Settings::default()
        };
        assert!(matches!(groups.resolve(), Err(ConfigError::Keyspace(_))));
        for (spread, groups) in [(0, 16), (17, 16), (5, 4)] {
            let spread = Settings {
                partition_spread: Some(spread),
                shard_groups: Some(groups),
                ..Settings::default()
            };
            assert!(matches!(
                spread.resolve(),
                Err(ConfigError::Invalid {
                    name: "partition_spread",
                    ..
                })
            ));
        }
        let few_groups = Settings {
            shard_groups: Some(2),
            ..Settings::default()
        };
        assert_eq!(few_groups.resolve().expect("valid").partition_spread, 2);
        let postgres = Settings {
            store: Some(Store::Postgres),
            postgres_url: Some("postgres://tally@127.0.0.1:5432/tally".to_owned()),
            ..Settings::default()
        };
        assert_eq!(postgres.resolve().expect("valid").partition_spread, 1);
        let watch_on_cluster = Settings {
            redis_url: Some("redis+cluster://127.0.0.1:7000".to_owned()),
            redis_atomicity: Some(Atomicity::Transactions),
            ..Settings::default()
        };
        assert!(matches!(
            watch_on_cluster.resolve(),
            Err(ConfigError::Invalid {
                name: "redis_atomicity",
                ..
            })
        ));
    }

    #[test]
    fn namespaces_come_from_their_file_and_dedup_needs_exactly_once() {
        let dir = std::env::temp_dir().join(format!("tally-ns-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("namespaces.toml");
        std::fs::write(&path, "[namespaces.likes]\ndedup = true\n").expect("written");
        let with = |delivery| Settings {
            namespaces: Some(path.clone()),
            delivery: Some(delivery),
            grouping: Some(GroupingRule::ByPartition),
            ..Settings::default()
        };
        let c = with(Delivery::ExactlyOnce).resolve().expect("valid");
        assert!(c.namespaces.policy("likes:post:1").dedup);
        assert_eq!(
            c.namespaces.policy("views:video:1").grouping,
            GroupingRule::ByPartition
        );
        assert!(matches!(
            with(Delivery::AtLeastOnce).resolve(),
            Err(ConfigError::Invalid {
                name: "delivery",
                ..
            })
        ));
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn exactly_once_refuses_an_offset_reset_that_skips_events() {
        let with = |delivery, reset: &str| Settings {
            delivery: Some(delivery),
            kafka: [("auto.offset.reset".to_owned(), reset.to_owned())].into(),
            ..Settings::default()
        };
        assert!(matches!(
            with(Delivery::ExactlyOnce, "latest").resolve(),
            Err(ConfigError::Invalid {
                name: "kafka.auto.offset.reset",
                ..
            })
        ));
        assert!(with(Delivery::ExactlyOnce, "earliest").resolve().is_ok());
        assert!(with(Delivery::ExactlyOnce, "error").resolve().is_ok());
        assert!(with(Delivery::AtLeastOnce, "latest").resolve().is_ok());
    }

    #[test]
    fn debug_output_hides_secrets() {
        let mut s = Settings {
            redis_url: Some("redis://app:hunter2@localhost:6379".to_owned()),
            ..Settings::default()
        };
        s.kafka
            .insert("sasl.password".to_owned(), "hunter2".to_owned());
        let shown = format!("{:?}", s.resolve().expect("valid"));
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("sasl.password"));
    }
}
