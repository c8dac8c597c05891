//! Turning SIGTERM and SIGINT into a [`CancellationToken`] that the whole daemon watches.
//!
//! The first signal starts a graceful shutdown: the consume loop stops polling, drains and
//! commits every partition (bounded by `shutdown_timeout_ms`), closes the consumer, and the
//! process exits 0. A second signal exits at once, with status 130, without committing anything
//! further: whatever was not committed is read again on restart.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Returns a token cancelled by the first SIGTERM or SIGINT.
pub fn on_signals() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let cancel = token.clone();
    tokio::spawn(async move {
        // Act first, then log: the log line is the part that can fail.
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        cancel.cancel();
        tracing::info!("{name} received: shutting down");
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        tracing::warn!("second signal: exiting without draining");
        std::process::exit(130);
    });
    Ok(token)
}
