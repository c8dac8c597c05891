//! A TCP proxy on loopback between the aggregators and a store, that misbehaves on demand the way
//! networks do ([`Fault`]): replies lost after the command ran, connections that stall both ways,
//! connections refused, slow replies.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// How the proxy treats traffic, from the moment it is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    /// Forwards everything.
    None = 0,
    /// Forwards requests, then drops the connection instead of the reply: the store ran the
    /// command, the client never hears of it.
    LoseReplies = 1,
    /// Holds every byte, both ways, until the fault changes: longer than a client's timeout.
    Stall = 2,
    /// Closes each new connection at once; open ones carry on.
    Refuse = 3,
    /// Delays every chunk, both ways, by 100 ms.
    Slow = 4,
}

impl Fault {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Fault::LoseReplies,
            2 => Fault::Stall,
            3 => Fault::Refuse,
            4 => Fault::Slow,
            _ => Fault::None,
        }
    }
}

/// The proxy: listens on a free loopback port and forwards to `upstream`.
#[derive(Debug)]
pub struct FaultyProxy {
    port: u16,
    fault: Arc<AtomicU8>,
    accept: JoinHandle<()>,
}

impl FaultyProxy {
    /// Starts a proxy to `upstream` (`host:port`), forwarding faithfully.
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        let fault = Arc::new(AtomicU8::new(Fault::None as u8));
        let upstream = upstream.to_owned();
        let shared = fault.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                if Fault::from_u8(shared.load(Ordering::Relaxed)) == Fault::Refuse {
                    drop(client);
                    continue;
                }
                let (fault, upstream) = (shared.clone(), upstream.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = (client.set_nodelay(true), server.set_nodelay(true));
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    // Whichever direction ends first ends the connection.
                    tokio::select! {
                        () = pump(client_read, server_write, fault.clone(), false) => {}
                        () = pump(server_read, client_write, fault, true) => {}
                    }
                });
            }
        });
        Self {
            port,
            fault,
            accept,
        }
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Misbehaves as `fault` says from now on.
    pub fn set(&self, fault: Fault) {
        self.fault.store(fault as u8, Ordering::Relaxed);
    }
}

impl Drop for FaultyProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies `from` to `to` chunk by chunk, as the fault of the moment says; `replies` is the
/// store-to-client direction.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    fault: Arc<AtomicU8>,
    replies: bool,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        loop {
            match Fault::from_u8(fault.load(Ordering::Relaxed)) {
                Fault::Stall => tokio::time::sleep(Duration::from_millis(20)).await,
                Fault::LoseReplies if replies => return,
                Fault::Slow => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    break;
                }
                _ => break,
            }
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
