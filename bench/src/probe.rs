//! Measuring what a scenario costs: a process's CPU time and peak RSS from `/proc`, an
//! aggregator's Prometheus metrics, and Redis's command counts from `INFO commandstats`.

use std::collections::HashMap;
use std::process::Child;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// CPU seconds (user + system) and peak resident memory of a running process.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ProcStats {
    /// User plus system CPU time, in seconds.
    pub cpu_seconds: f64,
    /// Peak resident set size (`VmHWM`), in MiB.
    pub peak_rss_mib: f64,
}

/// Clock ticks per second, as `/proc/<pid>/stat` counts CPU time.
fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// The process's CPU time and peak RSS so far; `None` once it has exited.
pub fn proc_stats(pid: u32) -> Option<ProcStats> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let hwm_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())?;
    Some(ProcStats {
        cpu_seconds: ticks / clock_ticks(),
        peak_rss_mib: hwm_kib / 1024.0,
    })
}

/// The machine's idle and total CPU time so far, in clock ticks, from `/proc/stat` (idle counts
/// `idle` and `iowait`).
pub fn machine_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((idle, ticks.iter().sum()))
}

/// CPU seconds so far of every process whose command line contains `needle` (the Kafka broker:
/// `kafka.Kafka`; Redis: `redis-server`).
pub fn cpu_seconds_matching(needle: &str) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .filter_map(|pid| proc_stats(pid).map(|s| s.cpu_seconds))
        .sum()
}

/// CPU seconds used so far by every process whose command line holds `needle`, counting the
/// exited children they reaped: PostgreSQL's backends end with their connections, and their time
/// is then in the postmaster's `cutime` and `cstime`.
pub fn cpu_seconds_with_children_matching(needle: &str) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let ticks = |pid: u32| -> Option<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        // utime, stime, cutime, cstime: fields 14 to 17 of the line, 12 to 15 after the name.
        (11..15).map(|i| fields.get(i)?.parse::<f64>().ok()).sum()
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(needle))
        })
        .filter_map(ticks)
        .sum::<f64>()
        / clock_ticks()
}

/// Waits for `child` to exit, sampling its stats every 50 ms; returns the last sample taken
/// while it was alive (CPU time and peak RSS up to its end) and its wall time.
pub async fn run_to_end(mut child: Child) -> anyhow::Result<(ProcStats, Duration, bool)> {
    let started = std::time::Instant::now();
    let pid = child.id();
    let mut last = ProcStats::default();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok((last, started.elapsed(), status.success()));
        }
        if let Some(s) = proc_stats(pid) {
            last = s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The text of `/metrics`.
pub async fn metrics_text(port: u16) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .context("metrics endpoint")?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut body = String::new();
    stream.read_to_string(&mut body).await?;
    Ok(body)
}

/// Every sample of an un-labelled metric family, summed over its labels, from `/metrics`.
pub async fn metrics(port: u16) -> anyhow::Result<HashMap<String, f64>> {
    let body = metrics_text(port).await?;
    let mut out: HashMap<String, f64> = HashMap::new();
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        // Histogram buckets keep their `le` label; other labels are summed over.
        let name = if series.contains("_bucket{") {
            series.to_owned()
        } else {
            series.split('{').next().unwrap_or(series).to_owned()
        };
        *out.entry(name).or_default() += value;
    }
    Ok(out)
}

/// A histogram's quantile from its cumulative buckets (`<name>_bucket{le="..."}`): the upper
/// bound of the first bucket holding the quantile.
pub fn histogram_quantile(metrics: &HashMap<String, f64>, name: &str, q: f64) -> Option<f64> {
    let prefix = format!("{name}_bucket{{le=\"");
    let mut buckets: Vec<(f64, f64)> = metrics
        .iter()
        .filter_map(|(k, v)| {
            let le = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((bound, *v))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total == 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, count)| *count >= q * total)
        .map(|(bound, _)| *bound)
}

/// The histogram's buckets as (upper bound, count in that bucket alone).
pub fn histogram_buckets(metrics: &HashMap<String, f64>, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    let mut cumulative: Vec<(f64, f64)> = metrics
        .iter()
        .filter_map(|(k, v)| {
            let le = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
            (le != "+Inf").then_some((le.parse().ok()?, *v))
        })
        .collect();
    cumulative.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut before = 0.0;
    cumulative
        .into_iter()
        .map(|(bound, count)| {
            let alone = count - before;
            before = count;
            (bound, alone)
        })
        .collect()
}

/// Redis's command counts from `INFO commandstats`, which counts every command run, those run
/// inside a script or a `MULTI`/`EXEC` included (an `EVALSHA` and each command it runs).
#[derive(Debug, Clone, Default)]
pub struct CommandStats {
    /// `calls` per command.
    pub calls: HashMap<String, u64>,
}

impl CommandStats {
    /// Reads `INFO commandstats`.
    pub async fn read(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<Self> {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(conn)
            .await?;
        let calls = info
            .lines()
            .filter_map(|line| {
                let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
                Some((name.to_owned(), calls.parse().ok()?))
            })
            .collect();
        Ok(Self { calls })
    }

    /// Commands run since `before`, all of them, leaving out `INFO` (this module's own).
    pub fn since(&self, before: &Self) -> u64 {
        self.calls
            .iter()
            .filter(|(name, _)| name.as_str() != "info")
            .map(|(name, n)| n - before.calls.get(name).copied().unwrap_or(0))
            .sum()
    }

    /// Calls per command since `before`, most first (without `INFO`): what the commands per
    /// event are made of.
    pub fn breakdown(&self, before: &Self) -> Vec<(String, u64)> {
        let mut all: Vec<(String, u64)> = self
            .calls
            .iter()
            .filter(|(name, _)| name.as_str() != "info")
            .map(|(name, n)| {
                (
                    name.clone(),
                    n - before.calls.get(name).copied().unwrap_or(0),
                )
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        all
    }

    /// Calls of `name` since `before`.
    pub fn of(&self, before: &Self, name: &str) -> u64 {
        self.calls.get(name).copied().unwrap_or(0) - before.calls.get(name).copied().unwrap_or(0)
    }
}

/// Redis's own timing of every script it runs, from its slow log (set to log everything over
/// 1 ms while [`ScriptLog::start`]ed): how long each one held the server. The slow log never
/// lists `EXEC` (only the commands inside it), so the longest command of all, a transaction
/// included, comes from the latency monitor (set to 1 ms meanwhile).
#[derive(Debug)]
pub struct ScriptLog {
    /// `slowlog-log-slower-than`, `slowlog-max-len` and `latency-monitor-threshold` as they
    /// were, put back at the finish.
    before: Vec<(String, String)>,
}

impl ScriptLog {
    /// Empties the slow log and has it keep every command over 1 ms.
    pub async fn start(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<Self> {
        let mut before = Vec::new();
        for name in [
            "slowlog-log-slower-than",
            "slowlog-max-len",
            "latency-monitor-threshold",
        ] {
            let got: Vec<String> = redis::cmd("CONFIG")
                .arg("GET")
                .arg(name)
                .query_async(conn)
                .await?;
            if let [key, value] = got.as_slice() {
                before.push((key.clone(), value.clone()));
            }
        }
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("slowlog-log-slower-than")
            .arg(1_000)
            .arg("slowlog-max-len")
            .arg(100_000)
            .arg("latency-monitor-threshold")
            .arg(1)
            .query_async(conn)
            .await?;
        let _: () = redis::cmd("SLOWLOG").arg("RESET").query_async(conn).await?;
        let _: i64 = redis::cmd("LATENCY").arg("RESET").query_async(conn).await?;
        Ok(Self { before })
    }

    /// The durations, ms, of the scripts (`EVALSHA`, `EVAL`) logged since the start, and the
    /// longest any command (an `EXEC` included) held the server, ms, by the latency monitor
    /// (whole milliseconds); puts the settings back as they were.
    pub async fn finish(
        self,
        conn: &mut redis::aio::MultiplexedConnection,
    ) -> anyhow::Result<(Vec<f64>, f64)> {
        let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
            .arg("GET")
            .arg(-1)
            .query_async(conn)
            .await?;
        // Per event: its name, when it last passed the threshold, that latency and the most.
        let latest: Vec<(String, i64, i64, i64)> = redis::cmd("LATENCY")
            .arg("LATEST")
            .query_async(conn)
            .await?;
        let longest = (latest.iter())
            .filter(|(event, ..)| event == "command")
            .map(|&(.., most)| most as f64)
            .fold(0.0, f64::max);
        for (name, value) in &self.before {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query_async(conn)
                .await?;
        }
        let text = |v: &redis::Value| match v {
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).to_ascii_lowercase(),
            redis::Value::SimpleString(s) => s.to_ascii_lowercase(),
            _ => String::new(),
        };
        Ok(entries
            .iter()
            .filter_map(|entry| {
                let redis::Value::Array(fields) = entry else {
                    return None;
                };
                let (redis::Value::Int(micros), redis::Value::Array(args)) =
                    (fields.get(2)?, fields.get(3)?)
                else {
                    return None;
                };
                let command = text(args.first()?);
                matches!(command.as_str(), "evalsha" | "eval").then_some(*micros as f64 / 1000.0)
            })
            .collect::<Vec<f64>>())
        .map(|scripts| (scripts, longest))
    }
}

/// The `q` quantile of `values` (sorted in place), or 0 if empty.
pub fn quantile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((values.len() as f64 - 1.0) * q).round() as usize;
    values[rank.min(values.len() - 1)]
}
