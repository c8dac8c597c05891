//! The one HTTP server of the project: `tally-server`'s API and console and each aggregator's
//! `/metrics`, `/healthz` and `/readyz` are an axum [`Router`] served by [`serve`], on hyper's
//! HTTP/1.1, with every resource a stranger can make it hold bounded:
//!
//! | what | bound | beyond it |
//! |---|---|---|
//! | open connections | [`Limits::max_connections`] | answered `503` and closed at once |
//! | request line and headers | [`Limits::max_header_bytes`] (hyper's read buffer) | `431` (`414` for a long URI), closed |
//! | time to send a request's headers, and a kept-alive connection's idle time | [`Limits::header_timeout`] | closed |
//! | time to answer one request, body read included | [`Limits::request_timeout`] | `503`, closed |
//! | accept errors (out of file descriptors) | backoff from 10 ms to 1 s | no busy loop |
//!
//! Bodies are bounded by each router (axum's `DefaultBodyLimit`). With a [`Tls`] acceptor the
//! server speaks HTTPS only; the TLS handshake must end within the header timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// What one server holds at most, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once; one more is answered `503` and closed.
    pub max_connections: usize,
    /// Bytes of a request line and headers (at least 8,192, hyper's floor).
    pub max_header_bytes: usize,
    /// Longest wait for a request's headers, from the connection's start or the previous
    /// answer: a client that sends them slowly, or nothing, is disconnected.
    pub header_timeout: Duration,
    /// Longest time to answer one request, reading its body included.
    pub request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 512,
            max_header_bytes: 16 * 1024,
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// The answer to a connection beyond [`Limits::max_connections`].
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n\
content-length: 25\r\nconnection: close\r\n\r\ntoo many open connections";

/// How long the busy answer may take to write before the connection is dropped anyway.
const BUSY_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// A TLS server identity, for HTTPS.
pub type Tls = tokio_native_tls::TlsAcceptor;

/// The TLS identity of a certificate chain and its private key, both PEM (the key PKCS#8,
/// `-----BEGIN PRIVATE KEY-----`, as `openssl req -newkey ... -nodes` writes it).
pub fn tls_identity(certificate_pem: &[u8], key_pem: &[u8]) -> Result<Tls, String> {
    let identity = native_tls::Identity::from_pkcs8(certificate_pem, key_pem)
        .map_err(|e| format!("the certificate or key is not usable: {e}"))?;
    let acceptor = native_tls::TlsAcceptor::builder(identity)
        .min_protocol_version(Some(native_tls::Protocol::Tlsv12))
        .build()
        .map_err(|e| format!("no TLS server from the certificate and key: {e}"))?;
    Ok(acceptor.into())
}

/// Serves `router` on `listener` within `limits` until `shutdown` fires, over HTTPS when `tls`
/// is given; then stops accepting and waits for the requests in flight (each bounded by the
/// request timeout).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    tls: Option<Tls>,
    shutdown: CancellationToken,
) {
    let router = router.layer(axum::middleware::from_fn_with_state(
        limits.request_timeout,
        answer_within,
    ));
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut backoff = ACCEPT_BACKOFF_FLOOR;
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => {
                backoff = ACCEPT_BACKOFF_FLOOR;
                accepted
            }
            Err(error) => {
                // Out of file descriptors, mostly: waiting lets connections close.
                tracing::warn!(%error, ?backoff, "accepting a connection failed; backing off");
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_CEILING);
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream, peer));
            continue;
        };
        let (router, watcher) = (router.clone(), graceful.watcher());
        let tls = tls.clone();
        tokio::spawn(async move {
            let ended = match tls {
                None => connection(stream, router, limits, watcher).await,
                Some(tls) => {
                    match tokio::time::timeout(limits.header_timeout, tls.accept(stream)).await {
                        Ok(Ok(stream)) => connection(stream, router, limits, watcher).await,
                        Ok(Err(error)) => Err(format!("TLS handshake: {error}")),
                        Err(_) => Err("TLS handshake: timed out".to_owned()),
                    }
                }
            };
            if let Err(error) = ended {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
            drop(permit);
        });
    }
    graceful.shutdown().await;
}

/// Serves one connection's requests until it closes, or shutdown closes it once idle.
async fn connection<S>(
    stream: S,
    router: Router,
    limits: Limits,
    watcher: hyper_util::server::graceful::Watcher,
) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192));
    let service = TowerToHyperService::new(router.into_service::<hyper::body::Incoming>());
    let served = builder.serve_connection(TokioIo::new(stream), service);
    watcher.watch(served).await.map_err(|e| e.to_string())
}

/// The first wait after an accept error.
const ACCEPT_BACKOFF_FLOOR: Duration = Duration::from_millis(10);

/// The longest wait after accept errors in a row.
const ACCEPT_BACKOFF_CEILING: Duration = Duration::from_secs(1);

/// Answers a connection beyond the cap with `503` and closes it.
async fn refuse(mut stream: TcpStream, peer: SocketAddr) {
    tracing::debug!(%peer, "too many open connections: refused");
    let _ = tokio::time::timeout(BUSY_WRITE_TIMEOUT, async {
        stream.write_all(BUSY).await?;
        stream.shutdown().await
    })
    .await;
}

/// Runs the rest of the request within `timeout`; past it, `503` and the connection closes.
async fn answer_within(
    axum::extract::State(timeout): axum::extract::State<Duration>,
    request: Request,
    next: Next,
) -> Response {
    match tokio::time::timeout(timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            let mut response = (
                StatusCode::SERVICE_UNAVAILABLE,
                "the request took too long to answer\n",
            )
                .into_response();
            (response.headers_mut()).insert(header::CONNECTION, HeaderValue::from_static("close"));
            response
        }
    }
}
