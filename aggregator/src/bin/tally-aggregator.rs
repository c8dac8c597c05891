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

/// Fixes glibc's mmap threshold at its initial 128 KiB, unless the operator set it
/// (`MALLOC_MMAP_THRESHOLD_`, or `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...`).
///
/// By default glibc raises the threshold to the size of each mmapped block freed (up to 32
/// MiB), so once the idempotency tables and the fetcher's buffers have grown and been replaced,
/// later large blocks come from the heaps of the threads that allocate them (the loop's, the
/// decider's) and stay there, fragmented. Measured over the bench's 5,000,000 ids
/// (`docs/guarantees.md`, "Idempotency keys"): 195-214 MiB of peak RSS with the dynamic threshold,
/// 184-188 with it fixed, at the same rate.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn tune_allocator() {
    let set_by_operator = std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
        || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("mmap_threshold"));
    if !set_by_operator {
        // SAFETY: `mallopt` only sets a parameter of the allocator, under its own lock; it is
        // called before the runtime starts any thread.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
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
