//! What the fetcher is built from: [`FetchConfig`], read from the same librdkafka-style options
//! the rest of tally passes to librdkafka (`bootstrap.servers`, `security.protocol`,
//! `sasl.*`, `ssl.*`, the fetch sizes), so that one `[kafka]` table configures both.
//!
//! An option that matters to how a connection is made or authenticated and that the fetcher does
//! not implement is an [`Unsupported`] error naming it, never ignored: the caller then reads
//! through librdkafka instead (the aggregator's `--fetch auto`).

use std::time::Duration;

use crate::protocol::FetchLimits;

/// How connections are secured.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Security {
    /// TLS, if `security.protocol` is `SSL` or `SASL_SSL`.
    pub tls: Option<Tls>,
    /// SASL, if `security.protocol` is `SASL_PLAINTEXT` or `SASL_SSL`.
    pub sasl: Option<Sasl>,
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Security")
            .field("tls", &self.tls)
            .field(
                "sasl",
                &self.sasl.as_ref().map(|s| (s.mechanism, &s.username)),
            )
            .finish()
    }
}

/// TLS settings (librdkafka's names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    /// `ssl.ca.location`: a PEM file of the certificates to trust (else the system's).
    pub ca_location: Option<String>,
    /// `ssl.certificate.location` and `ssl.key.location`: the client's PEM certificate and
    /// its PKCS#8 PEM key, for mutual TLS.
    pub client: Option<(String, String)>,
    /// `enable.ssl.certificate.verification` (default true).
    pub verify_certificate: bool,
    /// `ssl.endpoint.identification.algorithm`: `https` (default) checks the broker's name.
    pub verify_hostname: bool,
}

/// A SASL mechanism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    /// `PLAIN`.
    Plain,
    /// `SCRAM-SHA-256`.
    ScramSha256,
    /// `SCRAM-SHA-512`.
    ScramSha512,
}

impl Mechanism {
    /// Kafka's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::ScramSha256 => "SCRAM-SHA-256",
            Self::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// SASL credentials. Its `Debug` leaves the password out.
#[derive(Clone, PartialEq, Eq)]
pub struct Sasl {
    /// `sasl.mechanisms`.
    pub mechanism: Mechanism,
    /// `sasl.username`.
    pub username: String,
    /// `sasl.password`.
    pub password: String,
}

impl std::fmt::Debug for Sasl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sasl")
            .field("mechanism", &self.mechanism)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// An option the fetcher cannot honour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key} = {value:?} is not supported by tally's fetcher")]
pub struct Unsupported {
    /// The option.
    pub key: String,
    /// Its value (never a secret: secrets are never refused by value).
    pub value: String,
}

/// What to do when a partition's position is not in its log (retention deleted it, or the log
/// was truncated): librdkafka's `auto.offset.reset`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OffsetReset {
    /// Read on from the log's start (`earliest`, `smallest`, `beginning`): the default.
    #[default]
    Earliest,
    /// Read on from the log's end (`latest`, `largest`, `end`).
    Latest,
    /// Do not move: report it and fetch the partition no more until it is sought (`error`).
    Error,
}

/// Everything the fetcher needs.
#[derive(Debug, Clone)]
pub struct FetchConfig {
    /// `bootstrap.servers` (or `metadata.broker.list`): `host:port` to ask for metadata first.
    pub bootstrap: Vec<String>,
    /// The topic read.
    pub topic: String,
    /// `client.id`.
    pub client_id: String,
    /// How connections are secured.
    pub security: Security,
    /// Fetch sizes and wait (`fetch.wait.max.ms`, `fetch.min.bytes`, `fetch.max.bytes`,
    /// `max.partition.fetch.bytes`).
    pub limits: FetchLimits,
    /// Most decompressed bytes handed out and not yet released by their reader: past it, no
    /// new fetch is sent (`queued.max.messages.kbytes`).
    pub max_buffered_bytes: usize,
    /// Longest wait for a connection, or for a response beyond the fetch's own wait
    /// (`socket.timeout.ms`).
    pub timeout: Duration,
    /// `auto.offset.reset`.
    pub offset_reset: OffsetReset,
}

/// Defaults: what librdkafka does, but a 100 ms fetch wait (a paused partition resumed while a
/// fetch waits at the broker waits with it) and 4 MiB per partition.
pub const DEFAULT_LIMITS: FetchLimits = FetchLimits {
    max_wait_ms: 100,
    min_bytes: 1,
    max_bytes: 64 << 20,
    partition_max_bytes: 4 << 20,
};

/// Options that change nothing about how the fetcher reads, or that it honours elsewhere: the
/// consumer group's, librdkafka's internals, the producer's.
fn ignored(key: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "group.",
        "session.",
        "heartbeat.",
        "max.poll.",
        "partition.assignment",
        "enable.auto",
        "auto.",
        "statistics.",
        "topic.metadata",
        "metadata.max",
        "queued.min",
        "fetch.queue",
        "fetch.error",
        "enable.partition",
        "socket.",
        "reconnect.",
        "retry.",
        "log",
        "debug",
        "api.version",
        "broker.version",
        "allow.auto",
        "check.crcs",
        "isolation.level",
        "client.rack",
        "connections.max",
        "message.max",
        "receive.message",
        "linger",
        "batch.",
        "queue.buffering",
        "compression",
        "acks",
        "enable.idempotence",
        "request.",
        "delivery.",
        "message.timeout",
        "transaction",
        "ssl.endpoint",
        "enable.ssl",
        "ssl.ca",
        "ssl.certificate",
        "ssl.key",
        "sasl.username",
        "sasl.password",
        "sasl.mechanism",
        "security.protocol",
        "bootstrap.servers",
        "metadata.broker.list",
        "client.id",
        "fetch.",
        "max.partition",
        "queued.max",
        "coordinator.",
        "topic.",
        "internal.",
        "builtin.",
        "plugin.",
        "interceptor",
        "default.topic",
        "offset.",
        "consume.",
        "enable.metrics",
        "enable.sasl.oauthbearer.unsecure",
        "ssl.engine",
        "ssl_engine",
        "ssl.providers",
        "ssl.sigalgs",
        "ssl.curves",
        "ssl.cipher",
        "client.dns",
        "resolve.",
        "broker.address",
        "open_cb",
        "closesocket",
    ];
    PREFIXES.iter().any(|p| key.starts_with(p))
}

impl FetchConfig {
    /// Reads the options (librdkafka's names and values) for reading `topic`; an option that
    /// would change how connections are made and that the fetcher does not implement is an
    /// error.
    pub fn from_options<'a>(
        topic: &str,
        options: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, Unsupported> {
        let options: Vec<(&str, &str)> = options.into_iter().collect();
        let get = |key: &str| {
            options
                .iter()
                .rev()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| *v)
        };
        let unsupported = |key: &str, value: &str| Unsupported {
            key: key.to_owned(),
            value: value.to_owned(),
        };
        let parse = |key: &str, default: i64| -> Result<i64, Unsupported> {
            match get(key) {
                None => Ok(default),
                Some(v) => v.trim().parse().map_err(|_| unsupported(key, v)),
            }
        };
        let truthy = |key: &str, default: bool| match get(key) {
            None => Ok(default),
            Some("true" | "True" | "1") => Ok(true),
            Some("false" | "False" | "0") => Ok(false),
            Some(v) => Err(unsupported(key, v)),
        };
        let bootstrap: Vec<String> = get("bootstrap.servers")
            .or_else(|| get("metadata.broker.list"))
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.strip_prefix("PLAINTEXT://")
                    .or_else(|| s.strip_prefix("SSL://"))
                    .unwrap_or(s)
            })
            .map(str::to_owned)
            .collect();
        if bootstrap.is_empty() {
            return Err(unsupported("bootstrap.servers", ""));
        }
        let protocol = get("security.protocol")
            .unwrap_or("plaintext")
            .to_ascii_lowercase();
        let (tls, sasl) = match protocol.as_str() {
            "plaintext" => (false, false),
            "ssl" => (true, false),
            "sasl_plaintext" => (false, true),
            "sasl_ssl" => (true, true),
            _ => return Err(unsupported("security.protocol", &protocol)),
        };
        // TLS material librdkafka takes in forms not read here.
        for key in [
            "ssl.keystore.location",
            "ssl.ca.pem",
            "ssl.certificate.pem",
            "ssl.key.pem",
            "ssl.ca.certificate.stores",
            "ssl.crl.location",
            "ssl.engine.location",
        ] {
            if let Some(v) = get(key).filter(|v| !v.is_empty()) {
                return Err(unsupported(
                    key,
                    if key.ends_with(".pem") { "<pem>" } else { v },
                ));
            }
        }
        if get("ssl.key.password").is_some_and(|v| !v.is_empty()) {
            return Err(unsupported("ssl.key.password", "<set>"));
        }
        let tls = tls
            .then(|| -> Result<Tls, Unsupported> {
                let client = match (get("ssl.certificate.location"), get("ssl.key.location")) {
                    (None, None) => None,
                    (Some(c), Some(k)) => Some((c.to_owned(), k.to_owned())),
                    (Some(c), None) => return Err(unsupported("ssl.certificate.location", c)),
                    (None, Some(k)) => return Err(unsupported("ssl.key.location", k)),
                };
                let verify_hostname = match get("ssl.endpoint.identification.algorithm") {
                    None | Some("https") => true,
                    Some("none") => false,
                    Some(v) => return Err(unsupported("ssl.endpoint.identification.algorithm", v)),
                };
                Ok(Tls {
                    ca_location: get("ssl.ca.location")
                        .filter(|v| !v.is_empty())
                        .map(str::to_owned),
                    client,
                    verify_certificate: truthy("enable.ssl.certificate.verification", true)?,
                    verify_hostname,
                })
            })
            .transpose()?;
        let sasl = sasl
            .then(|| -> Result<Sasl, Unsupported> {
                let name = get("sasl.mechanisms")
                    .or_else(|| get("sasl.mechanism"))
                    .unwrap_or("GSSAPI");
                let mechanism = match name.to_ascii_uppercase().as_str() {
                    "PLAIN" => Mechanism::Plain,
                    "SCRAM-SHA-256" => Mechanism::ScramSha256,
                    "SCRAM-SHA-512" => Mechanism::ScramSha512,
                    _ => return Err(unsupported("sasl.mechanisms", name)),
                };
                Ok(Sasl {
                    mechanism,
                    username: get("sasl.username").unwrap_or_default().to_owned(),
                    password: get("sasl.password").unwrap_or_default().to_owned(),
                })
            })
            .transpose()?;
        for (key, value) in &options {
            if !ignored(key) {
                return Err(unsupported(key, value));
            }
        }
        let int = |key: &str, default: i32| -> Result<i32, Unsupported> {
            let v = parse(key, i64::from(default))?;
            i32::try_from(v)
                .ok()
                .filter(|v| *v >= 0)
                .ok_or_else(|| unsupported(key, &v.to_string()))
        };
        let d = DEFAULT_LIMITS;
        let limits = FetchLimits {
            max_wait_ms: int("fetch.wait.max.ms", d.max_wait_ms)?,
            min_bytes: int("fetch.min.bytes", d.min_bytes)?.max(1),
            max_bytes: int("fetch.max.bytes", d.max_bytes)?,
            partition_max_bytes: int("max.partition.fetch.bytes", d.partition_max_bytes)?,
        };
        let offset_reset = match get("auto.offset.reset") {
            None | Some("earliest" | "smallest" | "beginning") => OffsetReset::Earliest,
            Some("latest" | "largest" | "end") => OffsetReset::Latest,
            Some("error") => OffsetReset::Error,
            Some(other) => return Err(unsupported("auto.offset.reset", other)),
        };
        let queued_kb = parse("queued.max.messages.kbytes", 64 * 1024)?.max(1);
        let timeout_ms = parse("socket.timeout.ms", 60_000)?.max(1);
        Ok(Self {
            bootstrap,
            topic: topic.to_owned(),
            client_id: get("client.id").unwrap_or("tally").to_owned(),
            security: Security { tls, sasl },
            limits,
            max_buffered_bytes: usize::try_from(queued_kb).unwrap_or(usize::MAX / 1024) * 1024,
            timeout: Duration::from_millis(timeout_ms as u64),
            offset_reset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_options_give_plaintext_and_the_fetch_sizes() {
        let c = FetchConfig::from_options(
            "t",
            [
                ("bootstrap.servers", "a:9092, b:9093"),
                ("group.id", "g"),
                ("max.partition.fetch.bytes", "2097152"),
                ("fetch.queue.backoff.ms", "10"),
                ("statistics.interval.ms", "1000"),
            ],
        )
        .expect("as written");
        assert_eq!(c.bootstrap, ["a:9092", "b:9093"]);
        assert_eq!(c.security, Security::default());
        assert_eq!(c.limits.partition_max_bytes, 2 << 20);
        assert_eq!(c.limits.max_wait_ms, DEFAULT_LIMITS.max_wait_ms);
        assert_eq!(c.offset_reset, OffsetReset::Earliest);
        let reset = |v| {
            FetchConfig::from_options(
                "t",
                [("bootstrap.servers", "b:1"), ("auto.offset.reset", v)],
            )
            .map(|c| c.offset_reset)
        };
        assert_eq!(reset("smallest"), Ok(OffsetReset::Earliest));
        assert_eq!(reset("latest"), Ok(OffsetReset::Latest));
        assert_eq!(reset("error"), Ok(OffsetReset::Error));
        assert!(reset("sideways").is_err());
    }

    #[test]
    fn sasl_ssl_with_scram_reads_its_credentials() {
        let c = FetchConfig::from_options(
            "t",
            [
                ("bootstrap.servers", "b:1"),
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanisms", "SCRAM-SHA-512"),
                ("sasl.username", "u"),
                ("sasl.password", "secret"),
                ("ssl.ca.location", "/ca.pem"),
            ],
        )
        .expect("as written");
        let sasl = c.security.sasl.as_ref().expect("as written");
        assert_eq!(
            (
                sasl.mechanism,
                sasl.username.as_str(),
                sasl.password.as_str()
            ),
            (Mechanism::ScramSha512, "u", "secret")
        );
        assert_eq!(
            c.security
                .tls
                .as_ref()
                .expect("as written")
                .ca_location
                .as_deref(),
            Some("/ca.pem")
        );
        assert!(
            !format!("{c:?}").contains("secret"),
            "Debug must not show the password"
        );
    }

    #[test]
    fn what_the_fetcher_cannot_do_is_named() {
        let refused = |opts: &[(&str, &str)]| {
            let mut all = vec![("bootstrap.servers", "b:1")];
            all.extend_from_slice(opts);
            FetchConfig::from_options("t", all)
                .expect_err("an error")
                .key
        };
        assert_eq!(
            refused(&[
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanisms", "GSSAPI")
            ]),
            "sasl.mechanisms"
        );
        assert_eq!(
            refused(&[
                ("security.protocol", "SASL_PLAINTEXT"),
                ("sasl.mechanisms", "OAUTHBEARER")
            ]),
            "sasl.mechanisms"
        );
        assert_eq!(
            refused(&[
                ("security.protocol", "SSL"),
                ("ssl.keystore.location", "/k.p12")
            ]),
            "ssl.keystore.location"
        );
        assert_eq!(
            refused(&[("some.future.option", "x")]),
            "some.future.option"
        );
        let no_brokers = FetchConfig::from_options("t", [("group.id", "g")]).expect_err("an error");
        assert_eq!(no_brokers.key, "bootstrap.servers");
    }
}
