//! What every test shares: one test at a time where needed, seeds, unique names, free ports,
//! waiting for a condition, and temporary directories.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Serializes the heavy tests of one test binary: cargo runs a binary's tests on parallel
/// threads, and two fault scenarios at once would fight over the machine's two cores.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

/// The seed of a test's randomness: `TALLY_TEST_SEED` if set (to replay a failure), else a fresh
/// one. Printed either way, so a failing run can be replayed.
pub fn seed() -> u64 {
    let seed = std::env::var("TALLY_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("test seed: {seed} (replay with TALLY_TEST_SEED={seed})");
    seed
}

/// A name no other test (or earlier run) uses: `<base>-<pid>-<n>-<random>`.
pub fn unique(base: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{base}-{}-{}-{:08x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        rand::random::<u32>()
    )
}

/// Ports handed out by [`free_port`]: below Linux's ephemeral range (32768-60999 by default),
/// and low enough that a Redis Cluster bus port (`port + 10000`) stays below it too.
const TEST_PORTS: std::ops::Range<u32> = 20_000..22_768;

/// Ports already handed out by this process.
static PORTS_HANDED_OUT: AtomicU32 = AtomicU32::new(0);

/// A free TCP port on loopback, never the same one twice in a process.
///
/// Not `bind(0)`: that returns an ephemeral port, which the kernel may also give to any outgoing
/// connection (a client of another test running in parallel) between our check and the server's
/// own bind; a Kafka node then fails to start with "Address already in use".
pub fn free_port() -> u16 {
    let span = TEST_PORTS.end - TEST_PORTS.start;
    // Processes started one after another begin at different places in the range.
    let start = std::process::id().wrapping_mul(97) % span;
    for _ in 0..span {
        let n = PORTS_HANDED_OUT.fetch_add(1, Ordering::Relaxed);
        let port = u16::try_from(TEST_PORTS.start + (start + n) % span).expect("range fits u16");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on 127.0.0.1 in {TEST_PORTS:?}");
}

/// Polls `check` every 50 ms until it returns `Some`, or panics after `timeout` with `what`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Where a test keeps its files; removed when dropped, unless the test is failing (then it is
/// kept, and the last lines of each log in it are printed with the failure) or
/// `TALLY_KEEP_TEST_DIRS` is set (to read a passing run's logs).
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh directory under the system temp dir.
    pub fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(unique(name));
        std::fs::create_dir_all(&path).expect("temp dir");
        Self(path)
    }
    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_log_tails(&self.0, 40);
        } else if std::env::var_os("TALLY_KEEP_TEST_DIRS").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Prints the last `lines` lines of every `*.log` file in `dir` (a failing test's evidence).
fn print_log_tails(dir: &Path, lines: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut logs: Vec<PathBuf> = (entries.flatten())
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "log"))
        .collect();
    logs.sort();
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        let tail = &all[all.len().saturating_sub(lines)..];
        eprintln!("--- the last {} lines of {}", tail.len(), log.display());
        for line in tail {
            eprintln!("{line}");
        }
    }
}
