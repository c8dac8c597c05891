//! A running `tally-server` for the HTTP API's tests.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::http::{HttpAnswer, http_call};
use crate::process::binary;
use crate::support::{eventually, free_port};

/// A running `tally-server` on a free loopback port, killed when dropped.
#[derive(Debug)]
pub struct ApiServer {
    child: Child,
    /// The port it listens on.
    pub port: u16,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ApiServer {
    /// Starts `tally-server` with `args` and `env` (its log to `log`), and waits until
    /// `/healthz` answers.
    pub async fn start(args: &[&str], env: &[(&str, &str)], log: &Path) -> Self {
        let port = free_port();
        let out = std::fs::File::create(log).expect("log file");
        let child = Command::new(binary("tally-server"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::from(out.try_clone().expect("log file")))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("tally-server starts");
        let server = Self { child, port };
        eventually(Duration::from_secs(20), "tally-server answers", || async {
            http_call(port, "GET", "/healthz", &[], None)
                .await
                .map(|_| ())
        })
        .await;
        server
    }

    /// `tally-server` over `setup`'s deployment (16 shard groups) on the Redis at `redis_url`,
    /// with the namespace file `namespaces`; its log in `dir/server.log`.
    pub async fn over(
        setup: &crate::process::AggregatorSetup,
        redis_url: &str,
        namespaces: &str,
        dir: &Path,
    ) -> Self {
        let args = [
            "--brokers",
            &setup.brokers,
            "--topic",
            &setup.topic,
            "--group",
            &setup.group,
            "--key-prefix",
            &setup.key_prefix,
            "--shard-groups",
            "16",
            "--namespaces",
            namespaces,
        ];
        let env = [("TALLY_REDIS_URL", redis_url)];
        Self::start(&args, &env, &dir.join("server.log")).await
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The base URL, `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A request with `headers`: the whole answer.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> HttpAnswer {
        http_call(self.port, method, path, headers, body)
            .await
            .unwrap_or_else(|| panic!("{method} {path}: an answer, not a dropped connection"))
    }

    /// A request (a body is sent as JSON): the status and the JSON body.
    pub async fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let headers: &[(&str, &str)] = match body {
            Some(_) => &[("content-type", "application/json")],
            None => &[],
        };
        let answer = self.request(method, path, headers, body).await;
        (answer.status, json(&answer.body))
    }
}

/// `text` as JSON, or a panic quoting it.
pub fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON: {text:?}: {e}"))
}

/// The stable code of an error answer.
pub fn error_code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or_default()
}

/// The whole pipeline for a test of the HTTP API: a `redis-server`, topics on the local Kafka,
/// an aggregator with a namespace file, and `tally-server` over the same deployment.
#[derive(Debug)]
pub struct Stack {
    /// The test's files: the namespace file, the logs.
    pub dir: crate::support::TempDir,
    /// Redis.
    pub redis: crate::store::RedisServer,
    /// The topics, group and key prefix.
    pub setup: crate::process::AggregatorSetup,
    /// The aggregator.
    pub aggregator: crate::process::AggregatorProcess,
    /// The API server.
    pub server: ApiServer,
}

impl Stack {
    /// Starts the stack `name` on a topic of `partitions`, with the namespace policies
    /// `namespaces` (TOML) and trending published every 500 ms.
    pub async fn start(name: &str, partitions: i32, namespaces: &str) -> Self {
        let dir = crate::support::TempDir::new(&format!("tally-{name}"));
        let redis = crate::store::RedisServer::start().await;
        let setup = crate::process::AggregatorSetup::create(name, &redis.url(), partitions).await;
        let file = dir.path().join("namespaces.toml");
        std::fs::write(&file, namespaces).expect("namespace file");
        let file = file.to_str().expect("utf-8 path").to_owned();
        let aggregator = setup.spawn(
            dir.path(),
            &["--namespaces", &file, "--trending-interval-ms", "500"],
        );
        let server = ApiServer::over(&setup, &redis.url(), &file, dir.path()).await;
        Self {
            dir,
            redis,
            setup,
            aggregator,
            server,
        }
    }

    /// A reader of the exact counts.
    pub async fn reader(&self) -> tally_common::Reader {
        crate::store::reader(&self.redis.url(), self.setup.keyspace()).await
    }
}
