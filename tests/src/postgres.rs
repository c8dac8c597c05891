//! A private PostgreSQL server for a test: Debian's `postgresql` binaries, a fresh data directory
//! (trust authentication, loopback only, its own port), stopped and removed when dropped. As
//! root, the server runs as the `postgres` user (PostgreSQL refuses to run as root), through
//! `setpriv`, which execs: the child is the postmaster itself, so a test can SIGKILL it.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::{TempDir, free_port};

/// The newest installed PostgreSQL's binaries (`/usr/lib/postgresql/<version>/bin`).
fn bin_dir() -> PathBuf {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed: deploy/local/install.sh installs Debian's postgresql")
        .filter_map(|e| {
            let e = e.ok()?;
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .expect("a PostgreSQL server under /usr/lib/postgresql")
        .1
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

/// `program` run as the `postgres` user when we are root.
fn as_server_user(program: PathBuf) -> Command {
    if is_root() {
        let mut command = Command::new("setpriv");
        command
            .args([
                "--reuid=postgres",
                "--regid=postgres",
                "--init-groups",
                "--",
            ])
            .arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// A running private PostgreSQL server.
#[derive(Debug)]
pub struct PgServer {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
    /// Its `max_connections`.
    max_connections: u32,
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.kill();
    }
}

impl PgServer {
    /// Creates a data directory and starts a server on a free port.
    pub async fn start() -> Self {
        Self::start_with_max_connections(200).await
    }

    /// Like [`PgServer::start`], taking at most `max_connections` sessions.
    pub async fn start_with_max_connections(max_connections: u32) -> Self {
        let dir = TempDir::new("tally-pg");
        if is_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .status()
                .expect("chown runs");
            assert!(status.success(), "chown of the data directory");
        }
        let out = as_server_user(bin_dir().join("initdb"))
            .args([
                "-A",
                "trust",
                "-U",
                "tally",
                "--no-sync",
                "-E",
                "UTF8",
                "-D",
            ])
            .arg(dir.path().join("data"))
            .output()
            .expect("initdb runs");
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut server = Self {
            port: free_port(),
            dir,
            child: None,
            max_connections,
        };
        server.start_again().await;
        server
    }

    /// Starts the server on its data directory (again, after [`PgServer::kill`] or
    /// [`PgServer::stop_fast`]). After a SIGKILL the old backends may still hold the shared
    /// memory for a moment, and the new postmaster refuses to start: it is started again until
    /// one accepts connections.
    pub async fn start_again(&mut self) {
        let url = self.url();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let exited =
                (self.child.as_mut()).is_none_or(|c| c.try_wait().ok().flatten().is_some());
            if exited {
                self.child = Some(self.spawn_postmaster());
            }
            if let Ok((client, connection)) =
                tokio_postgres::connect(&url, tokio_postgres::NoTls).await
            {
                tokio::spawn(connection);
                if client.simple_query("SELECT 1").await.is_ok() {
                    return;
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "PostgreSQL did not start: {}",
                self.log()
            );
            // Polling, as `eventually` does.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn spawn_postmaster(&self) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("postgres.log"))
            .expect("log file");
        as_server_user(bin_dir().join("postgres"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string()])
            .arg("-k")
            .arg(self.dir.path())
            .args(["-c", "listen_addresses=127.0.0.1", "-c"])
            .arg(format!("max_connections={}", self.max_connections))
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("postgres starts")
    }

    /// SIGKILLs the postmaster (its backends then exit); the data directory stays.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A fast shutdown (SIGINT: sessions are disconnected, then a checkpoint), waited for.
    pub fn stop_fast(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }

    /// Its URL: `postgres://tally@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://tally@127.0.0.1:{}/postgres", self.port)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }
}
