//! A real Prometheus server on loopback (Debian's `prometheus` package), scraping test targets
//! every second and loading tally's alert rules, with a small client for its query API.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use tally_ops::secrets::percent_encode;

use crate::http::http_get_status;
use crate::support::{TempDir, eventually, free_port};

/// The repository's `deploy/prometheus` directory.
pub fn rules_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus")
}

/// Runs `promtool` with `args` in `deploy/prometheus`; panics with its output unless it succeeds.
pub fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(rules_dir())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run promtool ({e}): install Debian's prometheus package (deploy/local/install.sh)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// A running Prometheus; killed when dropped.
#[derive(Debug)]
pub struct Prometheus {
    child: Child,
    port: u16,
    _dir: TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (`host:port`) as job `job` every second, with
    /// `deploy/prometheus/alerts.yml` loaded, and waits until it is ready.
    pub async fn start(job: &str, targets: &[String]) -> Self {
        let dir = TempDir::new("prometheus");
        let config = dir.path().join("prometheus.yml");
        let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                rules_dir().join("alerts.yml").display(),
                targets.join(", ")
            ),
        )
        .expect("prometheus.yml");
        promtool(&["check", "config", &config.display().to_string()]);
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run prometheus ({e}): install Debian's prometheus package (deploy/local/install.sh)")
            });
        let prometheus = Self {
            child,
            port,
            _dir: dir,
        };
        eventually(
            Duration::from_secs(30),
            "Prometheus to be ready",
            || async {
                matches!(http_get_status(port, "/-/ready").await, Some((200, _))).then_some(())
            },
        )
        .await;
        prometheus
    }

    /// `GET /api/v1/<path>`: the `data` of a successful answer, or the error it gave.
    pub async fn api(&self, path: &str) -> Result<Value, String> {
        let (status, body) = http_get_status(self.port, &format!("/api/v1/{path}"))
            .await
            .ok_or("Prometheus did not answer")?;
        let answer: Value = serde_json::from_str(&body)
            .map_err(|e| format!("HTTP {status}, not JSON ({e}): {body}"))?;
        if answer["status"] == "success" {
            Ok(answer["data"].clone())
        } else {
            Err(format!("HTTP {status}: {body}"))
        }
    }

    /// An instant query: its result vector (`[{metric, value: [t, "v"]}]`).
    pub async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let data = self
            .api(&format!("query?query={}", percent_encode(expr)))
            .await?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The sum of an instant query's values (0 for an empty result).
    pub async fn value(&self, expr: &str) -> Result<f64, String> {
        let result = self.query(expr).await?;
        Ok(result
            .iter()
            .filter_map(|s| s["value"][1].as_str()?.parse::<f64>().ok())
            .sum())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
