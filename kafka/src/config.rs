//! What the fetcher is built from: [`FetchConfig`], read from the same librdkafka-style options
//! the rest of tally passes to librdkafka (`bootstrap.servers`, `security.protocol`,
//! `sasl.*`, `ssl.*`, the fetch sizes), so that one `[kafka]` table configures both.
//!
//! An option that matters to how a connection is made or authenticated and that the fetcher does
//! not implement is an [`Unsupported`] error naming it, never ignored: the caller then reads
//! through librdkafka instead (the aggregator's `--fetch auto`).

use std::time::Duration;

use crate::protocol::{FetchLimits, Isolation};

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

/// How to reach and talk to the cluster: what the fetcher and the appender share.
#[derive(Debug, Clone)]
pub struct ClientSettings {
    /// `bootstrap.servers` (or `metadata.broker.list`): `host:port` to ask for metadata first.
    pub bootstrap: Vec<String>,
    /// `client.id`.
    pub client_id: String,
    /// How connections are secured.
    pub security: Security,
    /// Longest wait for a response beyond a request's own wait (`socket.timeout.ms`).
    pub timeout: Duration,
    /// Longest wait for a TCP connection and its TLS handshake
    /// (`socket.connection.setup.timeout.ms`; tally's default 10 s, librdkafka's 30 s: a
    /// broker that is down must not hold up finding its successor).
    pub connect_timeout: Duration,
    /// Longest wait for the `ApiVersions` answer that opens a connection
    /// (`api.version.request.timeout.ms`, 10 s).
    pub api_versions_timeout: Duration,
    /// Largest response accepted (`receive.message.max.bytes`, 100,000,000 as in
    /// librdkafka; at least `fetch.max.bytes` plus 512, which librdkafka demands too).
    pub max_response: usize,
    /// How its sockets are set up.
    pub socket: SocketOptions,
}

/// Socket options, as librdkafka names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketOptions {
    /// `socket.keepalive.enable` (false).
    pub keepalive: bool,
    /// `socket.nagle.disable` (tally's default true: requests go out at once; librdkafka's
    /// false).
    pub nodelay: bool,
    /// `socket.send.buffer.bytes` (0: the system's default).
    pub send_buffer: u32,
    /// `socket.receive.buffer.bytes` (0: the system's default).
    pub receive_buffer: u32,
}

/// Everything the fetcher needs.
#[derive(Debug, Clone)]
pub struct FetchConfig {
    /// The cluster.
    pub client: ClientSettings,
    /// The topic read.
    pub topic: String,
    /// Fetch sizes and wait (`fetch.wait.max.ms`, `fetch.min.bytes`, `fetch.max.bytes`,
    /// `max.partition.fetch.bytes`).
    pub limits: FetchLimits,
    /// Most decompressed bytes handed out and not yet released by their reader, counted as
    /// allocated: past it, no more of an answer is read into chunks, and each broker's next
    /// answer waits, compressed, for room (`queued.max.messages.kbytes`).
    pub max_buffered_bytes: usize,
    /// `auto.offset.reset`.
    pub offset_reset: OffsetReset,
    /// `check.crcs`: verify each batch's CRC-32C; a batch that does not match is never handed
    /// out, nor read past.
    pub check_crcs: bool,
    /// `isolation.level`: read_committed (librdkafka's default) or read_uncommitted.
    pub isolation: Isolation,
    /// How long it waits before trying again.
    pub waits: Waits,
}

/// How long the fetcher waits before trying again: librdkafka's options where given, tally's
/// own defaults otherwise (shorter than librdkafka's, so that a broker back from a restart is
/// read again within about 2 s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waits {
    /// First wait before connecting again to a broker, or asking for metadata again, after a
    /// failure (`reconnect.backoff.ms`; tally's default 50 ms, librdkafka's 100 ms); it doubles
    /// up to `reconnect_max`.
    pub reconnect: Duration,
    /// `reconnect.backoff.max.ms` (tally's default 2 s, librdkafka's 10 s).
    pub reconnect_max: Duration,
    /// How long a partition whose fetch failed waits (`fetch.error.backoff.ms`, 500 ms).
    pub fetch_error: Duration,
    /// How often metadata is asked for when nothing asks for it
    /// (`topic.metadata.refresh.interval.ms`; tally's default 60 s, librdkafka's 300 s; -1:
    /// never).
    pub metadata_refresh: Duration,
}

/// Defaults: what librdkafka does, but a 100 ms fetch wait (a paused partition resumed while a
/// fetch waits at the broker waits with it) and 4 MiB per partition.
pub const DEFAULT_LIMITS: FetchLimits = FetchLimits {
    max_wait_ms: 100,
    min_bytes: 1,
    max_bytes: 64 << 20,
    partition_max_bytes: 4 << 20,
};

/// A wait that never ends in practice: a metadata refresh turned off.
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// Options that change nothing about how tally's fetcher or appender connect and read: the
/// consumer group's (membership, commits, and the group client's statistics and logs, which
/// librdkafka's consumer runs in every fetch mode), options that only matter at a value of
/// another option refused elsewhere (`api.version.fallback.ms` without `api.version.request`),
/// deprecated ones librdkafka ignores too, librdkafka's internals and callbacks, and a
/// producer's options the appender has no use for.
const IGNORED: &[&str] = &[
    "group.",
    "session.",
    "heartbeat.",
    "max.poll.",
    "partition.assignment",
    "enable.auto",
    "statistics.",
    "queued.min",
    "fetch.queue",
    "enable.partition",
    "reconnect.backoff.jitter",
    "socket.blocking.max.ms",
    "retries",
    "log",
    "debug",
    "broker.version",
    "api.version.fallback",
    "allow.auto",
    "message.max",
    "request.timeout",
    "coordinator.",
    "internal.",
    "builtin.",
    "plugin.",
    "interceptor",
    "enable.metrics",
    "resolve.",
    "open_cb",
    "closesocket",
    "topic.metadata.propagation",
    "sticky.partitioning",
    "max.in.flight",
    "enable.gapless",
    "transaction",
    "enable.sasl.oauthbearer.unsecure",
    "offset.store",
    "auto.commit",
    "consume.callback",
    "enable.random.seed",
    "topic.metadata.refresh.fast",
    "topic.metadata.refresh.sparse",
    "default.topic",
];

/// Options that change how a client connects, taken only at librdkafka's default, which is
/// what tally's client does: any other value is for librdkafka to honour. (TLS ciphers, curves,
/// signature algorithms, engines and providers are not taken at all.)
const AS_THEIR_DEFAULT: &[(&str, &str)] = &[
    ("api.version.request", "true"),
    ("broker.address.family", "any"),
    ("client.dns.lookup", "use_all_dns_ips"),
    // A connection is given up on at its first failed request, and kept however long idle.
    ("socket.max.fails", "1"),
    ("connections.max.idle.ms", "0"),
];

/// The options the client settings read.
const CLIENT_KEYS: &[&str] = &[
    "bootstrap.servers",
    "metadata.broker.list",
    "client.id",
    "security.protocol",
    "sasl.mechanisms",
    "sasl.mechanism",
    "sasl.username",
    "sasl.password",
    "ssl.ca.location",
    "ssl.certificate.location",
    "ssl.key.location",
    "enable.ssl.certificate.verification",
    "ssl.endpoint.identification.algorithm",
    "socket.timeout.ms",
    "socket.connection.setup.timeout.ms",
    "api.version.request.timeout.ms",
    "receive.message.max.bytes",
    "socket.keepalive.enable",
    "socket.nagle.disable",
    "socket.send.buffer.bytes",
    "socket.receive.buffer.bytes",
];

/// Options as librdkafka takes them, the last of a key winning.
struct Options<'a>(Vec<(&'a str, &'a str)>);

impl<'a> Options<'a> {
    /// The options, with the connection settings they give, once every key is known.
    fn read(
        options: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<(Self, ClientSettings), Unsupported> {
        let o = Options(options.into_iter().collect());
        let client = ClientSettings::read(&o)?;
        o.known_only()?;
        Ok((o, client))
    }

    fn get(&self, key: &str) -> Option<&'a str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
    }

    fn int(&self, key: &str, default: i64) -> Result<i64, Unsupported> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.trim().parse().map_err(|_| unsupported(key, v)),
        }
    }

    /// A duration in milliseconds (a negative one is zero).
    fn millis(&self, key: &str, default: i64) -> Result<Duration, Unsupported> {
        Ok(Duration::from_millis(self.int(key, default)?.max(0) as u64))
    }

    /// `topic.metadata.refresh.interval.ms`: how often metadata is asked for unasked; -1 (or
    /// 0) turns that off, as in librdkafka. Metadata older than `metadata.max.age.ms` (if
    /// given) is asked for again all the same.
    fn metadata_refresh(&self, default: i64) -> Result<Duration, Unsupported> {
        let ms = self.int("topic.metadata.refresh.interval.ms", default)?;
        let refresh = match u64::try_from(ms) {
            Ok(ms) if ms > 0 => Duration::from_millis(ms),
            _ => NEVER,
        };
        let max_age = match self.get("metadata.max.age.ms") {
            Some(_) => self
                .millis("metadata.max.age.ms", 0)?
                .max(Duration::from_millis(1)),
            None => NEVER,
        };
        Ok(refresh.min(max_age))
    }

    /// A non-negative value that fits an `int32`.
    fn int32(&self, key: &str, default: i32) -> Result<i32, Unsupported> {
        let v = self.int(key, i64::from(default))?;
        i32::try_from(v)
            .ok()
            .filter(|v| *v >= 0)
            .ok_or_else(|| unsupported(key, &v.to_string()))
    }

    fn truthy(&self, key: &str, default: bool) -> Result<bool, Unsupported> {
        match self.get(key) {
            None => Ok(default),
            Some("true" | "True" | "1") => Ok(true),
            Some("false" | "False" | "0") => Ok(false),
            Some(v) => Err(unsupported(key, v)),
        }
    }

    /// Refuses any option that is neither ignored nor read by a client, the fetcher or the
    /// appender (either one ignores the other's: one `[kafka]` table configures the
    /// aggregator's consumer and its dead-letter producer alike).
    fn known_only(&self) -> Result<(), Unsupported> {
        let known = |key: &str, value: &str| {
            IGNORED.iter().any(|p| key.starts_with(p))
                || CLIENT_KEYS.contains(&key)
                || FETCH_KEYS.contains(&key)
                || APPEND_KEYS.contains(&key)
                || (AS_THEIR_DEFAULT.iter())
                    .any(|(k, v)| *k == key && value.eq_ignore_ascii_case(v))
        };
        match self.0.iter().find(|(k, v)| !known(k, v)) {
            Some((key, value)) => Err(unsupported(key, value)),
            None => Ok(()),
        }
    }
}

fn unsupported(key: &str, value: &str) -> Unsupported {
    Unsupported {
        key: key.to_owned(),
        value: value.to_owned(),
    }
}

impl ClientSettings {
    /// Reads the cluster's address, security and client id; an option about how connections are
    /// made that is not implemented here is an error.
    fn read(o: &Options<'_>) -> Result<Self, Unsupported> {
        let bootstrap: Vec<String> = o
            .get("bootstrap.servers")
            .or_else(|| o.get("metadata.broker.list"))
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
        let protocol = o
            .get("security.protocol")
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
            if let Some(v) = o.get(key).filter(|v| !v.is_empty()) {
                return Err(unsupported(
                    key,
                    if key.ends_with(".pem") { "<pem>" } else { v },
                ));
            }
        }
        if o.get("ssl.key.password").is_some_and(|v| !v.is_empty()) {
            return Err(unsupported("ssl.key.password", "<set>"));
        }
        let tls = tls
            .then(|| -> Result<Tls, Unsupported> {
                let client = match (o.get("ssl.certificate.location"), o.get("ssl.key.location")) {
                    (None, None) => None,
                    (Some(c), Some(k)) => Some((c.to_owned(), k.to_owned())),
                    (Some(c), None) => return Err(unsupported("ssl.certificate.location", c)),
                    (None, Some(k)) => return Err(unsupported("ssl.key.location", k)),
                };
                let verify_hostname = match o.get("ssl.endpoint.identification.algorithm") {
                    None | Some("https") => true,
                    Some("none") => false,
                    Some(v) => return Err(unsupported("ssl.endpoint.identification.algorithm", v)),
                };
                Ok(Tls {
                    ca_location: o
                        .get("ssl.ca.location")
                        .filter(|v| !v.is_empty())
                        .map(str::to_owned),
                    client,
                    verify_certificate: o.truthy("enable.ssl.certificate.verification", true)?,
                    verify_hostname,
                })
            })
            .transpose()?;
        let sasl = sasl
            .then(|| -> Result<Sasl, Unsupported> {
                let name = o
                    .get("sasl.mechanisms")
                    .or_else(|| o.get("sasl.mechanism"))
                    .unwrap_or("GSSAPI");
                let mechanism = match name.to_ascii_uppercase().as_str() {
                    "PLAIN" => Mechanism::Plain,
                    "SCRAM-SHA-256" => Mechanism::ScramSha256,
                    "SCRAM-SHA-512" => Mechanism::ScramSha512,
                    _ => return Err(unsupported("sasl.mechanisms", name)),
                };
                Ok(Sasl {
                    mechanism,
                    username: o.get("sasl.username").unwrap_or_default().to_owned(),
                    password: o.get("sasl.password").unwrap_or_default().to_owned(),
                })
            })
            .transpose()?;
        let max_response = o.int32("receive.message.max.bytes", 100_000_000)?;
        let fetch_max = o.int32("fetch.max.bytes", DEFAULT_LIMITS.max_bytes)?;
        if max_response < 1_000 || max_response < fetch_max.saturating_add(512) {
            return Err(unsupported(
                "receive.message.max.bytes",
                &max_response.to_string(),
            ));
        }
        let buffer = |key| -> Result<u32, Unsupported> { Ok(o.int32(key, 0)? as u32) };
        Ok(Self {
            bootstrap,
            client_id: o.get("client.id").unwrap_or("tally").to_owned(),
            security: Security { tls, sasl },
            timeout: o
                .millis("socket.timeout.ms", 60_000)?
                .max(Duration::from_millis(1)),
            connect_timeout: (o.millis("socket.connection.setup.timeout.ms", 10_000)?)
                .max(Duration::from_millis(1)),
            api_versions_timeout: (o.millis("api.version.request.timeout.ms", 10_000)?)
                .max(Duration::from_millis(1)),
            max_response: max_response as usize,
            socket: SocketOptions {
                keepalive: o.truthy("socket.keepalive.enable", false)?,
                nodelay: o.truthy("socket.nagle.disable", true)?,
                send_buffer: buffer("socket.send.buffer.bytes")?,
                receive_buffer: buffer("socket.receive.buffer.bytes")?,
            },
        })
    }
}

/// The options the fetcher reads beyond the client's.
const FETCH_KEYS: &[&str] = &[
    "fetch.wait.max.ms",
    "fetch.min.bytes",
    "fetch.max.bytes",
    "max.partition.fetch.bytes",
    "queued.max.messages.kbytes",
    "queued.max.messages",
    "fetch.message.max.bytes",
    "auto.offset.reset",
    "check.crcs",
    "isolation.level",
    "reconnect.backoff.ms",
    "reconnect.backoff.max.ms",
    "fetch.error.backoff.ms",
    "topic.metadata.refresh.interval.ms",
    "metadata.max.age.ms",
];

impl FetchConfig {
    /// Reads the options (librdkafka's names and values) for reading `topic`; an option that
    /// would change how connections are made or records are read, and that the fetcher does not
    /// implement, is an error.
    pub fn from_options<'a>(
        topic: &str,
        options: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, Unsupported> {
        let (o, client) = Options::read(options)?;
        let d = DEFAULT_LIMITS;
        let limits = FetchLimits {
            max_wait_ms: o.int32("fetch.wait.max.ms", d.max_wait_ms)?,
            min_bytes: o.int32("fetch.min.bytes", d.min_bytes)?.max(1),
            max_bytes: o.int32("fetch.max.bytes", d.max_bytes)?,
            partition_max_bytes: o.int32(
                "max.partition.fetch.bytes",
                o.int32("fetch.message.max.bytes", d.partition_max_bytes)?,
            )?,
        };
        let offset_reset = match o.get("auto.offset.reset") {
            None | Some("earliest" | "smallest" | "beginning") => OffsetReset::Earliest,
            Some("latest" | "largest" | "end") => OffsetReset::Latest,
            Some("error") => OffsetReset::Error,
            Some(other) => return Err(unsupported("auto.offset.reset", other)),
        };
        let queued_kb = o.int("queued.max.messages.kbytes", 64 * 1024)?.max(1);
        let isolation = match o.get("isolation.level") {
            None | Some("read_committed") => Isolation::ReadCommitted,
            Some("read_uncommitted") => Isolation::ReadUncommitted,
            Some(other) => return Err(unsupported("isolation.level", other)),
        };
        let waits = Waits {
            reconnect: o.millis("reconnect.backoff.ms", 50)?,
            reconnect_max: o.millis("reconnect.backoff.max.ms", 2_000)?,
            fetch_error: o.millis("fetch.error.backoff.ms", 500)?,
            metadata_refresh: o.metadata_refresh(60_000)?,
        };
        Ok(Self {
            client,
            topic: topic.to_owned(),
            limits,
            max_buffered_bytes: usize::try_from(queued_kb).unwrap_or(usize::MAX / 1024) * 1024,
            offset_reset,
            check_crcs: o.truthy("check.crcs", false)?,
            isolation,
            waits,
        })
    }
}

/// How an appender compresses its batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// Not at all.
    None,
    /// LZ4 frames (what tally's producers use).
    Lz4,
    /// gzip.
    Gzip,
}

/// Everything an appender needs.
#[derive(Debug, Clone)]
pub struct AppendConfig {
    /// The cluster.
    pub client: ClientSettings,
    /// The topic written.
    pub topic: String,
    /// How long a batch waits for more records before it is sent (`linger.ms`).
    pub linger: Duration,
    /// Records section size at which a batch is sent at once (`batch.size`).
    pub batch_bytes: usize,
    /// Records at which a batch is sent at once (`batch.num.messages`).
    pub batch_records: usize,
    /// Records appended and not yet reported, past which an append is refused as full
    /// (`queue.buffering.max.messages`).
    pub max_queued: usize,
    /// The codec (`compression.type` / `compression.codec`).
    pub codec: Codec,
    /// How long a record may wait for its acknowledgement, retries included, before it is
    /// reported failed (`message.timeout.ms` / `delivery.timeout.ms`).
    pub delivery_timeout: Duration,
    /// How often the topic's partitions are looked up again, so that partitions added to it are
    /// written (`topic.metadata.refresh.interval.ms`, at most `metadata.max.age.ms`).
    pub metadata_refresh: Duration,
    /// The first and the longest wait before a failed request is sent again, or a failed
    /// connection made again (`retry.backoff.ms`, `retry.backoff.max.ms`; tally's defaults
    /// 20 ms and 1 s, librdkafka's 100 ms and 1 s).
    pub retry_backoff: (Duration, Duration),
}

/// The options the appender reads beyond the client's.
const APPEND_KEYS: &[&str] = &[
    "linger.ms",
    "queue.buffering.max.ms",
    "batch.size",
    "batch.num.messages",
    "queue.buffering.max.messages",
    "queue.buffering.max.kbytes",
    "compression.type",
    "compression.codec",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "partitioner",
    "retry.backoff.ms",
    "retry.backoff.max.ms",
];

impl AppendConfig {
    /// Reads the options (librdkafka's names and values) for appending to `topic`: idempotent,
    /// every in-sync replica acknowledging, librdkafka's default partitioner. An option asking
    /// for anything else, or not implemented, is an error.
    pub fn from_options<'a>(
        topic: &str,
        options: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, Unsupported> {
        let (o, client) = Options::read(options)?;
        if !o.truthy("enable.idempotence", true)? {
            return Err(unsupported("enable.idempotence", "false"));
        }
        for key in ["acks", "request.required.acks"] {
            if let Some(v) = o.get(key).filter(|v| !matches!(*v, "all" | "-1")) {
                return Err(unsupported(key, v));
            }
        }
        if let Some(v) = o.get("partitioner").filter(|v| *v != "consistent_random") {
            return Err(unsupported("partitioner", v));
        }
        let codec = match o
            .get("compression.type")
            .or_else(|| o.get("compression.codec"))
        {
            None | Some("none") => Codec::None,
            Some("lz4") => Codec::Lz4,
            Some("gzip") => Codec::Gzip,
            Some(other) => return Err(unsupported("compression.type", other)),
        };
        let ms = |key: &str, alias: &str, default: i64| o.millis(key, o.int(alias, default)?);
        let count = |key: &str, default: i64| -> Result<usize, Unsupported> {
            Ok(usize::try_from(o.int(key, default)?.max(1)).unwrap_or(usize::MAX))
        };
        Ok(Self {
            client,
            topic: topic.to_owned(),
            linger: ms("linger.ms", "queue.buffering.max.ms", 5)?,
            batch_bytes: count("batch.size", 1_000_000)?,
            batch_records: count("batch.num.messages", 10_000)?,
            max_queued: count("queue.buffering.max.messages", 100_000)?,
            codec,
            delivery_timeout: ms("message.timeout.ms", "delivery.timeout.ms", 300_000)?,
            metadata_refresh: o.metadata_refresh(300_000)?,
            retry_backoff: (
                o.millis("retry.backoff.ms", 20)?,
                o.millis("retry.backoff.max.ms", 1_000)?,
            ),
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
        assert_eq!(c.client.bootstrap, ["a:9092", "b:9093"]);
        assert_eq!(c.client.security, Security::default());
        assert_eq!(c.limits.partition_max_bytes, 2 << 20);
        assert_eq!(c.limits.max_wait_ms, DEFAULT_LIMITS.max_wait_ms);
        assert_eq!(c.offset_reset, OffsetReset::Earliest);
        assert!(!c.check_crcs, "librdkafka's default");
        assert_eq!(c.waits.fetch_error, Duration::from_millis(500));
        assert_eq!(c.waits.metadata_refresh, Duration::from_secs(60));
        let checked = FetchConfig::from_options(
            "t",
            [
                ("bootstrap.servers", "b:1"),
                ("check.crcs", "true"),
                ("isolation.level", "read_committed"),
            ],
        )
        .expect("as written");
        assert!(checked.check_crcs);
        assert_eq!(checked.isolation, Isolation::ReadCommitted);
        let waits = FetchConfig::from_options(
            "t",
            [
                ("bootstrap.servers", "b:1"),
                ("reconnect.backoff.ms", "100"),
                ("reconnect.backoff.max.ms", "10000"),
                ("fetch.error.backoff.ms", "250"),
                ("topic.metadata.refresh.interval.ms", "-1"),
            ],
        )
        .expect("as written")
        .waits;
        assert_eq!(
            waits,
            Waits {
                reconnect: Duration::from_millis(100),
                reconnect_max: Duration::from_secs(10),
                fetch_error: Duration::from_millis(250),
                metadata_refresh: NEVER,
            }
        );
        let uncommitted = FetchConfig::from_options(
            "t",
            [
                ("bootstrap.servers", "b:1"),
                ("isolation.level", "read_uncommitted"),
            ],
        )
        .expect("as written");
        assert_eq!(uncommitted.isolation, Isolation::ReadUncommitted);
        // The appender reads the same refresh the same way: -1 turns it off rather than
        // asking for metadata in a loop.
        let append = |v| {
            AppendConfig::from_options(
                "t",
                [
                    ("bootstrap.servers", "b:1"),
                    ("topic.metadata.refresh.interval.ms", v),
                ],
            )
            .expect("as written")
            .metadata_refresh
        };
        assert_eq!(append("-1"), NEVER);
        assert_eq!(append("1000"), Duration::from_secs(1));
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
    fn socket_timeout_and_size_options_are_read() {
        let defaults = FetchConfig::from_options("t", [("bootstrap.servers", "b:1")])
            .expect("as written")
            .client;
        assert_eq!(
            (defaults.timeout, defaults.connect_timeout),
            (Duration::from_secs(60), Duration::from_secs(10))
        );
        assert_eq!(defaults.api_versions_timeout, Duration::from_secs(10));
        assert_eq!(defaults.max_response, 100_000_000);
        assert_eq!(
            defaults.socket,
            SocketOptions {
                keepalive: false,
                nodelay: true,
                send_buffer: 0,
                receive_buffer: 0
            }
        );
        let c = FetchConfig::from_options(
            "t",
            [
                ("bootstrap.servers", "b:1"),
                ("socket.timeout.ms", "5000"),
                ("socket.connection.setup.timeout.ms", "2000"),
                ("api.version.request.timeout.ms", "3000"),
                ("fetch.max.bytes", "1000000"),
                ("receive.message.max.bytes", "2000000"),
                ("socket.keepalive.enable", "true"),
                ("socket.nagle.disable", "false"),
                ("socket.send.buffer.bytes", "65536"),
                ("socket.receive.buffer.bytes", "131072"),
                ("socket.max.fails", "1"),
                ("connections.max.idle.ms", "0"),
                ("metadata.max.age.ms", "30000"),
            ],
        )
        .expect("as written");
        let client = c.client;
        assert_eq!(client.timeout, Duration::from_secs(5));
        assert_eq!(client.connect_timeout, Duration::from_secs(2));
        assert_eq!(client.api_versions_timeout, Duration::from_secs(3));
        assert_eq!(client.max_response, 2_000_000);
        assert_eq!(
            client.socket,
            SocketOptions {
                keepalive: true,
                nodelay: false,
                send_buffer: 65_536,
                receive_buffer: 131_072
            }
        );
        // Metadata older than its maximum age is asked for again, however rare the refresh.
        assert_eq!(c.waits.metadata_refresh, Duration::from_secs(30));
        let appender = AppendConfig::from_options(
            "t",
            [
                ("bootstrap.servers", "b:1"),
                ("retry.backoff.ms", "100"),
                ("retry.backoff.max.ms", "5000"),
                ("topic.metadata.refresh.interval.ms", "-1"),
                ("metadata.max.age.ms", "90000"),
            ],
        )
        .expect("as written");
        assert_eq!(
            appender.retry_backoff,
            (Duration::from_millis(100), Duration::from_secs(5))
        );
        assert_eq!(appender.metadata_refresh, Duration::from_secs(90));
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
        let sasl = c.client.security.sasl.as_ref().expect("as written");
        assert_eq!(
            (
                sasl.mechanism,
                sasl.username.as_str(),
                sasl.password.as_str()
            ),
            (Mechanism::ScramSha512, "u", "secret")
        );
        assert_eq!(
            c.client
                .security
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
        // Not read by the fetcher (`--fetch auto` falls back to librdkafka), or not a value.
        assert_eq!(
            refused(&[("isolation.level", "read_whatever")]),
            "isolation.level"
        );
        assert_eq!(refused(&[("client.rack", "eu-1a")]), "client.rack");
        assert_eq!(
            refused(&[("ssl.cipher.suites", "ECDHE-RSA-AES256-GCM-SHA384")]),
            "ssl.cipher.suites"
        );
        assert_eq!(
            refused(&[("broker.address.family", "v6")]),
            "broker.address.family"
        );
        assert_eq!(
            refused(&[("api.version.request", "false")]),
            "api.version.request"
        );
        // At librdkafka's default, what tally's client does anyway.
        let defaults = FetchConfig::from_options(
            "t",
            [
                ("bootstrap.servers", "b:1"),
                ("api.version.request", "true"),
                ("broker.address.family", "any"),
                ("client.dns.lookup", "use_all_dns_ips"),
            ],
        );
        assert!(defaults.is_ok(), "{defaults:?}");
        assert_eq!(refused(&[("check.crcs", "sometimes")]), "check.crcs");
        assert_eq!(refused(&[("socket.max.fails", "3")]), "socket.max.fails");
        assert_eq!(
            refused(&[("connections.max.idle.ms", "60000")]),
            "connections.max.idle.ms"
        );
        // A response limit below what a fetch may return, as librdkafka refuses it.
        assert_eq!(
            refused(&[("receive.message.max.bytes", "1000000")]),
            "receive.message.max.bytes"
        );
        let no_brokers = FetchConfig::from_options("t", [("group.id", "g")]).expect_err("an error");
        assert_eq!(no_brokers.key, "bootstrap.servers");
    }
}
