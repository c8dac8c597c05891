//! `tally-aggregator`: the daemon. See `tally_aggregator::operator::config` for its settings.

use tally_aggregator::operator::config::{Cli, LogFormat};

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // A log line that cannot be written (stderr closed, say by `| head`) is dropped: by default
    // tracing-subscriber reports it with eprintln!, which panics on a closed stderr.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .log_internal_errors(false);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Makes a panic anywhere end the process. Unwinding one task would leave the daemon half
/// alive: a consumer dropped mid-unwind blocks in its close, and no one serves the signals.
/// A supervisor restarts a dead process; exactly-once resumes from Redis.
fn abort_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
}

/// Fixes glibc's mmap threshold at its initial 128 KiB and its trim threshold at 32 MiB, each
/// unless the operator set it (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, or the
/// `glibc.malloc.mmap_threshold` and `trim_threshold` tunables in `GLIBC_TUNABLES`).
///
/// By default glibc raises the mmap threshold to the size of each mmapped block freed (up to
/// 32 MiB), so once the idempotency tables and the fetcher's buffers have grown and been
/// replaced, later large blocks come from the heaps of the threads that allocate them (the
/// loop's, the decider's) and stay there, fragmented: over the bench's 5,000,000 ids
/// (`docs/guarantees.md`, "Idempotency keys"), 195-214 MiB of peak RSS against 175-188 with the
/// threshold fixed. Fixing it also fixes the trim threshold, at 128 KiB, and a heap then gives
/// back and takes again its top at almost every flush: over a long tail of 1,000,000 counters
/// (5 alternated rounds) the aggregator took 1.04 CPU s (median) against 0.92 with glibc's
/// defaults, and 0.89 with a 32 MiB trim threshold (the dynamic one reaches 64), at the same
/// peak RSS.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn tune_allocator() {
    // (the operator's variable, the tunable's name, the parameter, its value)
    const SETTINGS: [(&str, &str, libc::c_int, libc::c_int); 2] = [
        (
            "MALLOC_MMAP_THRESHOLD_",
            "mmap_threshold",
            libc::M_MMAP_THRESHOLD,
            128 * 1024,
        ),
        (
            "MALLOC_TRIM_THRESHOLD_",
            "trim_threshold",
            libc::M_TRIM_THRESHOLD,
            32 * 1024 * 1024,
        ),
    ];
    let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
    for (variable, tunable, parameter, value) in SETTINGS {
        if std::env::var_os(variable).is_none() && !tunables.contains(tunable) {
            // SAFETY: `mallopt` only sets a parameter of the allocator, under its own lock; it
            // is called before the runtime starts any thread.
            unsafe {
                libc::mallopt(parameter, value);
            }
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

fn main() -> anyhow::Result<std::process::ExitCode> {
    tune_allocator();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> anyhow::Result<std::process::ExitCode> {
    let config = Cli::from_command_line()?.into_config()?;
    init_logs(config.log_format);
    abort_on_panic();
    tracing::info!(?config, "starting");
    let shutdown = tally_ops::shutdown::on_signals()?;
    let summary = tally_aggregator::run(config, shutdown).await?;
    if let Some(why) = &summary.outdated {
        // Exits failing, so that a supervisor restarts it into the deployment's new layout.
        tracing::error!(partitions = summary.drained, %why, "stopped: the deployment moved on under this process; restart it");
        return Ok(std::process::ExitCode::FAILURE);
    }
    if summary.not_drained.is_empty() {
        tracing::info!(partitions = summary.drained, "drained and committed; bye");
        Ok(std::process::ExitCode::SUCCESS)
    } else {
        tracing::error!(
            partitions = ?summary.not_drained,
            "shutdown deadline passed before these partitions were durable; they will be re-read on restart"
        );
        Ok(std::process::ExitCode::FAILURE)
    }
}
