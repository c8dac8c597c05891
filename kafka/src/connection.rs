//! One connection to one broker: TCP, TLS if configured, the `ApiVersions` check, SASL if
//! configured, then requests one at a time ([`Connection::request`]). A response is read into a
//! buffer the caller owns and reuses, so a stream of large fetch responses allocates nothing.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::config::{ClientSettings, SocketOptions, Tls};
use crate::protocol::{self, Api, ErrorCode};
use crate::sasl;
use crate::wire::{Malformed, Writer};

/// What can go wrong on a connection. Every variant but [`Self::Auth`] and
/// [`Self::Unsupported`] is passing: connect again (with backoff).
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    /// The socket failed or closed.
    #[error("connection to {broker}: {source}")]
    Io {
        /// The broker's address.
        broker: String,
        /// The failure.
        source: std::io::Error,
    },
    /// No answer in time.
    #[error("connection to {broker}: no answer within {timeout:?}")]
    Timeout {
        /// The broker's address.
        broker: String,
        /// How long it waited.
        timeout: Duration,
    },
    /// TLS could not be set up.
    #[error("TLS to {broker}: {message}")]
    Tls {
        /// The broker's address.
        broker: String,
        /// What failed.
        message: String,
    },
    /// The broker refused the credentials, or the exchange failed.
    #[error("authentication with {broker} failed: {message}")]
    Auth {
        /// The broker's address.
        broker: String,
        /// Why (never the password).
        message: String,
    },
    /// The broker implements no version of an API tally needs that tally does.
    #[error("{broker} supports {api} {range}, tally {ours}: none in common")]
    Unsupported {
        /// The broker's address.
        broker: String,
        /// The API.
        api: &'static str,
        /// The versions tally implements (`v11-v12`).
        ours: String,
        /// What the broker supports (`v0-v10`, or `not at all`).
        range: String,
    },
    /// A response tally could not read.
    #[error("a malformed response from {broker}: {source}")]
    Malformed {
        /// The broker's address.
        broker: String,
        /// Where and what.
        source: Malformed,
    },
}

impl ConnectionError {
    /// Whether trying again cannot help.
    pub fn is_fatal(&self) -> bool {
        matches!(self, Self::Auth { .. } | Self::Unsupported { .. })
    }
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A connection to one broker.
pub struct Connection {
    stream: Box<dyn Io>,
    broker: String,
    client_id: String,
    correlation_id: i32,
    timeout: Duration,
    /// Largest response accepted (`receive.message.max.bytes`).
    max_response: usize,
    /// The version of each API agreed with the broker: `(key, version)`.
    versions: Vec<(i16, i16)>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("broker", &self.broker)
            .finish_non_exhaustive()
    }
}

/// The APIs every connection checks the broker supports.
const NEEDED: [Api; 6] = [
    protocol::FETCH,
    protocol::METADATA,
    protocol::LIST_OFFSETS,
    protocol::OFFSET_FOR_LEADER_EPOCH,
    protocol::PRODUCE,
    protocol::INIT_PRODUCER_ID,
];

impl Connection {
    /// Connects to `broker` (`host:port`) with `client`'s socket options, secures and
    /// authenticates the connection as its security says, and agrees with the broker on the
    /// version of each API tally sends.
    pub async fn open(broker: &str, client: &ClientSettings) -> Result<Self, ConnectionError> {
        let io = |source| ConnectionError::Io {
            broker: broker.to_owned(),
            source,
        };
        let connect_timeout = client.connect_timeout;
        let tcp = tokio::time::timeout(connect_timeout, tcp(broker, &client.socket))
            .await
            .map_err(|_| ConnectionError::Timeout {
                broker: broker.to_owned(),
                timeout: connect_timeout,
            })?
            .map_err(io)?;
        tcp.set_nodelay(client.socket.nodelay).map_err(io)?;
        let security = &client.security;
        let stream: Box<dyn Io> = match &security.tls {
            None => Box::new(tcp),
            Some(tls) => Box::new(secure(tcp, broker, tls, connect_timeout).await?),
        };
        let mut connection = Self {
            stream,
            broker: broker.to_owned(),
            client_id: client.client_id.clone(),
            correlation_id: 0,
            // The first request's own timeout; every later one has `socket.timeout.ms`.
            timeout: client.api_versions_timeout,
            max_response: client.max_response,
            versions: Vec::new(),
        };
        let mut buf = Vec::new();
        connection
            .request(protocol::API_VERSIONS, |_| {}, &mut buf)
            .await?;
        connection.timeout = client.timeout;
        let (error, ranges) =
            protocol::parse_api_versions(&buf).map_err(|e| connection.malformed(e))?;
        if error.is_error() {
            return Err(ConnectionError::Unsupported {
                broker: connection.broker.clone(),
                api: protocol::API_VERSIONS.name,
                ours: "v0 only".to_owned(),
                range: format!("none ({error})"),
            });
        }
        let mut needed = NEEDED.to_vec();
        if security.sasl.is_some() {
            needed.extend([protocol::SASL_HANDSHAKE, protocol::SASL_AUTHENTICATE]);
        }
        for api in needed {
            match api.negotiate(&ranges) {
                Ok(version) => connection.versions.push((api.key, version)),
                Err(range) => return Err(connection.unsupported(api, range)),
            }
        }
        if let Some(sasl) = &security.sasl {
            connection.authenticate(sasl).await?;
        }
        Ok(connection)
    }

    /// The connection in `slot`, made to `broker` first if there is none.
    pub async fn reuse<'a>(
        slot: &'a mut Option<Self>,
        broker: &str,
        client: &ClientSettings,
    ) -> Result<&'a mut Self, ConnectionError> {
        let connection = match slot.take() {
            Some(connection) => connection,
            None => Self::open(broker, client).await?,
        };
        Ok(slot.insert(connection))
    }

    /// A connection to the first of `client`'s bootstrap servers, then of `known`, that
    /// answers; the last failure if none does (`None`: there was nobody to ask).
    pub async fn any(
        client: &ClientSettings,
        known: &[String],
    ) -> Result<Self, Option<ConnectionError>> {
        let mut last = None;
        for broker in client.bootstrap.iter().chain(known) {
            match Self::open(broker, client).await {
                Ok(connection) => return Ok(connection),
                Err(e) => last = Some(e),
            }
        }
        Err(last)
    }

    /// The broker's address.
    pub fn broker(&self) -> &str {
        &self.broker
    }

    fn malformed(&self, source: Malformed) -> ConnectionError {
        ConnectionError::Malformed {
            broker: self.broker.clone(),
            source,
        }
    }

    fn unsupported(&self, api: Api, range: Option<protocol::ApiRange>) -> ConnectionError {
        let versions = |min, max| match (min, max) {
            (min, max) if min == max => format!("v{min} only"),
            (min, max) => format!("v{min}-v{max}"),
        };
        ConnectionError::Unsupported {
            broker: self.broker.clone(),
            api: api.name,
            ours: versions(api.oldest, api.newest),
            range: range.map_or_else(|| "not at all".to_owned(), |r| versions(r.min, r.max)),
        }
    }

    /// Speaks `version` of `api` from now on, whatever was agreed (for captures and tests of
    /// one version).
    pub fn speak(&mut self, api: Api, version: i16) {
        self.versions.retain(|(key, _)| *key != api.key);
        self.versions.push((api.key, version));
    }

    /// The version of `api` this connection speaks: the newest both sides implement
    /// (`ApiVersions` itself: v0, and an API the broker was not asked about: tally's oldest).
    pub fn version(&self, api: Api) -> i16 {
        (self.versions.iter())
            .find(|(key, _)| *key == api.key)
            .map_or(api.oldest, |&(_, version)| version)
    }

    async fn authenticate(&mut self, config: &crate::config::Sasl) -> Result<(), ConnectionError> {
        let broker = self.broker.clone();
        let auth = |message: String| ConnectionError::Auth {
            broker: broker.clone(),
            message,
        };
        let mechanism = config.mechanism.name();
        let mut buf = Vec::new();
        self.request(
            protocol::SASL_HANDSHAKE,
            |w| protocol::sasl_handshake_request(w, mechanism),
            &mut buf,
        )
        .await?;
        let (error, enabled) =
            protocol::parse_sasl_handshake(&buf).map_err(|e| self.malformed(e))?;
        if error.is_error() {
            return Err(auth(format!(
                "{mechanism} is not enabled on the broker ({error}; it offers {enabled:?})"
            )));
        }
        let nonce = nonce();
        let (mut message, mut exchange) = sasl::start(config, &nonce);
        loop {
            self.request(
                protocol::SASL_AUTHENTICATE,
                |w| protocol::sasl_authenticate_request(w, &message),
                &mut buf,
            )
            .await?;
            let (error, text, server) =
                protocol::parse_sasl_authenticate(&buf).map_err(|e| self.malformed(e))?;
            if error.is_error() {
                let text = text.unwrap_or_default();
                return Err(auth(format!("{error}: {text}")));
            }
            match exchange.step(&server).map_err(|e| auth(e.to_string()))? {
                Some(next) => message = next,
                None if exchange.expects_more() => {
                    return Err(auth("the exchange ended early".into()));
                }
                None => return Ok(()),
            }
        }
    }

    /// Sends a request for `api` whose body `body` writes, and reads its response's body into
    /// `response` (cleared first). Waits at most the connection's timeout plus `extra` (a
    /// fetch's own wait at the broker).
    pub async fn request_waiting(
        &mut self,
        api: Api,
        body: impl FnOnce(&mut Writer),
        response: &mut Vec<u8>,
        extra: Duration,
    ) -> Result<(), ConnectionError> {
        self.correlation_id = self.correlation_id.wrapping_add(1);
        let correlation_id = self.correlation_id;
        let version = self.version(api);
        // A response header of version 1 ends in tagged fields, none of which tally reads.
        let tagged_header = (api.response_header)(version) >= 1;
        let mut w = protocol::request_header(api, version, correlation_id, &self.client_id);
        body(&mut w);
        let size = i32::try_from(w.buf.len() - 4).unwrap_or(i32::MAX);
        w.buf[..4].copy_from_slice(&size.to_be_bytes());
        let timeout = self.timeout + extra;
        let max_response = self.max_response;
        let broker = self.broker.clone();
        let exchange = async {
            self.stream.write_all(&w.buf).await?;
            self.stream.flush().await?;
            let len = self.stream.read_i32().await?;
            let len = usize::try_from(len)
                .ok()
                .filter(|n| (4..=max_response).contains(n))
                .ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("a response of {len} bytes"),
                    )
                })?;
            let got = self.stream.read_i32().await?;
            if got != correlation_id {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("a response to request {got}, waiting for {correlation_id}"),
                ));
            }
            let mut header = 4;
            if tagged_header {
                header += skip_tagged_fields(&mut self.stream, len - header).await?;
            }
            response.clear();
            response.reserve(len - header);
            let read = (&mut self.stream)
                .take((len - header) as u64)
                .read_to_end(response)
                .await?;
            if read != len - header {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            Ok(())
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(ConnectionError::Io { broker, source }),
            Err(_) => Err(ConnectionError::Timeout { broker, timeout }),
        }
    }

    /// [`Self::request_waiting`] with no extra wait.
    pub async fn request(
        &mut self,
        api: Api,
        body: impl FnOnce(&mut Writer),
        response: &mut Vec<u8>,
    ) -> Result<(), ConnectionError> {
        self.request_waiting(api, body, response, Duration::ZERO)
            .await
    }

    /// Asks for `topic`'s metadata (`create`: see [`protocol::metadata_request`]).
    pub async fn metadata(
        &mut self,
        topic: &str,
        create: bool,
    ) -> Result<protocol::Metadata, ConnectionError> {
        let mut buf = Vec::new();
        self.request(
            protocol::METADATA,
            |w| protocol::metadata_request(w, topic, create),
            &mut buf,
        )
        .await?;
        protocol::parse_metadata(&buf, topic).map_err(|e| self.malformed(e))
    }

    /// A producer id and epoch for an idempotent producer (`InitProducerId`).
    pub async fn init_producer_id(&mut self) -> Result<(i64, i16), String> {
        let mut buf = Vec::new();
        self.request(
            protocol::INIT_PRODUCER_ID,
            protocol::init_producer_id_request,
            &mut buf,
        )
        .await
        .map_err(|e| e.to_string())?;
        let (error, id, epoch) =
            protocol::parse_init_producer_id(&buf).map_err(|e| e.to_string())?;
        if error.is_error() {
            return Err(format!("InitProducerId: {error}"));
        }
        Ok((id, epoch))
    }

    /// Where the leader's log ends each epoch asked about (KIP-320).
    pub async fn offsets_for_leader_epochs(
        &mut self,
        topic: &str,
        queries: &[protocol::EpochQuery],
    ) -> Result<Vec<protocol::EpochEnd>, ConnectionError> {
        let mut buf = Vec::new();
        self.request(
            protocol::OFFSET_FOR_LEADER_EPOCH,
            |w| protocol::offset_for_leader_epoch_request(w, topic, queries),
            &mut buf,
        )
        .await?;
        protocol::parse_offset_for_leader_epoch(&buf).map_err(|e| self.malformed(e))
    }

    /// Where the logs of `partitions` start or end.
    pub async fn list_offsets(
        &mut self,
        topic: &str,
        partitions: &[i32],
        end: protocol::LogEnd,
    ) -> Result<Vec<(i32, ErrorCode, i64)>, ConnectionError> {
        let mut buf = Vec::new();
        self.request(
            protocol::LIST_OFFSETS,
            |w| protocol::list_offsets_request(w, topic, partitions, end),
            &mut buf,
        )
        .await?;
        protocol::parse_list_offsets(&buf).map_err(|e| self.malformed(e))
    }
}

/// A TCP connection to the first address of `broker` that accepts one, with `options` set.
async fn tcp(broker: &str, options: &SocketOptions) -> std::io::Result<TcpStream> {
    let mut last = None;
    for address in tokio::net::lookup_host(broker).await? {
        let socket = match address {
            std::net::SocketAddr::V4(_) => TcpSocket::new_v4()?,
            std::net::SocketAddr::V6(_) => TcpSocket::new_v6()?,
        };
        socket.set_keepalive(options.keepalive)?;
        if options.send_buffer > 0 {
            socket.set_send_buffer_size(options.send_buffer)?;
        }
        if options.receive_buffer > 0 {
            socket.set_recv_buffer_size(options.receive_buffer)?;
        }
        match socket.connect(address).await {
            Ok(stream) => return Ok(stream),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{broker} resolves to no address"),
        )
    }))
}

/// Reads and drops the tagged fields of a response header from `stream`, within `left`
/// bytes; returns how many bytes they took.
async fn skip_tagged_fields(
    stream: &mut (impl AsyncRead + Unpin),
    left: usize,
) -> std::io::Result<usize> {
    let mut taken = 0;
    let fields = read_uvarint(stream, &mut taken, left).await?;
    for _ in 0..fields {
        read_uvarint(stream, &mut taken, left).await?;
        let size = read_uvarint(stream, &mut taken, left).await?;
        let size = usize::try_from(size)
            .ok()
            .filter(|&n| n <= left - taken)
            .ok_or_else(|| invalid_header("tagged field's size"))?;
        let skipped = tokio::io::copy(
            &mut (&mut *stream).take(size as u64),
            &mut tokio::io::sink(),
        )
        .await?;
        if skipped != size as u64 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        taken += size;
    }
    Ok(taken)
}

/// An unsigned varint read from `stream`, byte by byte, counted in `taken`, past which no
/// more than `left` bytes may be read.
async fn read_uvarint(
    stream: &mut (impl AsyncRead + Unpin),
    taken: &mut usize,
    left: usize,
) -> std::io::Result<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        if *taken >= left {
            return Err(invalid_header("tagged fields"));
        }
        let byte = stream.read_u8().await?;
        *taken += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Ok(value);
        }
    }
    Err(invalid_header("varint"))
}

fn invalid_header(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("a malformed response header ({what})"),
    )
}

/// A client nonce: 24 random bytes, base64.
fn nonce() -> String {
    use base64::Engine as _;
    let bytes: [u8; 24] = rand::random();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The PEM blocks of `pem` of the given label (`CERTIFICATE`).
fn pem_blocks<'a>(pem: &'a str, label: &str) -> Vec<&'a str> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let mut out = Vec::new();
    let mut rest = pem;
    while let Some(start) = rest.find(&begin) {
        let Some(stop) = rest[start..].find(&end) else {
            break;
        };
        let stop = start + stop + end.len();
        out.push(&rest[start..stop]);
        rest = &rest[stop..];
    }
    out
}

async fn secure(
    tcp: TcpStream,
    broker: &str,
    tls: &Tls,
    timeout: Duration,
) -> Result<tokio_native_tls::TlsStream<TcpStream>, ConnectionError> {
    let fail = |message: String| ConnectionError::Tls {
        broker: broker.to_owned(),
        message,
    };
    let read = |path: &str| {
        std::fs::read_to_string(path).map_err(|e| fail(format!("reading {path}: {e}")))
    };
    let mut builder = native_tls::TlsConnector::builder();
    if let Some(ca) = &tls.ca_location {
        let pem = read(ca)?;
        let certs = pem_blocks(&pem, "CERTIFICATE");
        if certs.is_empty() {
            return Err(fail(format!("{ca} holds no PEM certificate")));
        }
        for cert in certs {
            let cert = native_tls::Certificate::from_pem(cert.as_bytes())
                .map_err(|e| fail(format!("{ca}: {e}")))?;
            builder.add_root_certificate(cert);
        }
    }
    if let Some((cert, key)) = &tls.client {
        let identity =
            native_tls::Identity::from_pkcs8(read(cert)?.as_bytes(), read(key)?.as_bytes())
                .map_err(|e| fail(format!("{cert} and {key}: {e}")))?;
        builder.identity(identity);
    }
    builder.danger_accept_invalid_certs(!tls.verify_certificate);
    builder.danger_accept_invalid_hostnames(!tls.verify_hostname);
    let connector =
        tokio_native_tls::TlsConnector::from(builder.build().map_err(|e| fail(e.to_string()))?);
    let host = broker.rsplit_once(':').map_or(broker, |(host, _)| host);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match tokio::time::timeout(timeout, connector.connect(host, tcp)).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(e)) => Err(fail(e.to_string())),
        Err(_) => Err(ConnectionError::Timeout {
            broker: broker.to_owned(),
            timeout,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pem_bundles_split_into_their_certificates() {
        let pem = "junk\n-----BEGIN CERTIFICATE-----\nAAA\n-----END CERTIFICATE-----\n\
                   -----BEGIN CERTIFICATE-----\nBBB\n-----END CERTIFICATE-----\ntrailer";
        let blocks = pem_blocks(pem, "CERTIFICATE");
        assert_eq!(blocks.len(), 2);
        assert!(blocks[1].contains("BBB") && blocks[1].ends_with("-----END CERTIFICATE-----"));
        assert!(pem_blocks("none here", "CERTIFICATE").is_empty());
    }
}
