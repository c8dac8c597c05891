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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<std::process::ExitCode> {
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
