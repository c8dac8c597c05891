//! Secured connections for real: Kafka over TLS with SASL (SCRAM-SHA-512, then PLAIN) on a broker
//! that accepts nothing else (`deploy/local/kafka-secure.sh`), and Redis over TLS (`rediss://`),
//! with the SASL password from a file named by the environment. Every total is exact, and the
//! password appears in neither the log nor `/metrics`. A wrong password never gets into the
//! group, and says why without printing the password.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tally_cli::load::LoadSpec;
use tally_common::{Reader, RedisConn};
use tally_producer::ProducerConfig;
use tally_tests::{
    AggregatorSetup, TempDir, create_topic_on, eventually, finish_load, free_port, http_get,
    http_get_status, serial, start_load_with, unique, wait_for_totals,
};

const SCRAM_PASSWORD: &str = "scram-Secret-7f3a";
const PLAIN_PASSWORD: &str = "plain-Secret-91c2";

/// The secure broker of `deploy/local/kafka-secure.sh`, on free ports; stopped when dropped.
struct SecureKafka {
    dir: TempDir,
    port: u16,
    admin_port: u16,
    controller_port: u16,
}

impl SecureKafka {
    fn start() -> Self {
        let kafka = Self {
            dir: TempDir::new("kafka-secure"),
            port: free_port(),
            admin_port: free_port(),
            controller_port: free_port(),
        };
        let status = kafka
            .script("start")
            .status()
            .expect("kafka-secure.sh runs");
        assert!(status.success(), "kafka-secure.sh start failed");
        kafka
    }

    fn script(&self, command: &str) -> Command {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local/kafka-secure.sh");
        let mut c = Command::new(script);
        c.arg(command)
            .env("TALLY_SECURE_DIR", self.dir.path())
            .env("TALLY_SECURE_PORT", self.port.to_string())
            .env("TALLY_SECURE_ADMIN_PORT", self.admin_port.to_string())
            .env(
                "TALLY_SECURE_CONTROLLER_PORT",
                self.controller_port.to_string(),
            )
            .env("TALLY_SECURE_SCRAM_PASSWORD", SCRAM_PASSWORD)
            .env("TALLY_SECURE_PLAIN_PASSWORD", PLAIN_PASSWORD);
        c
    }

    fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// librdkafka options for `mechanism` as `user`, without the password.
    fn options(&self, mechanism: &str, user: &str) -> Vec<(String, String)> {
        [
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanisms", mechanism),
            ("sasl.username", user),
            ("ssl.ca.location", self.ca().to_str().expect("utf-8")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }
}

impl Drop for SecureKafka {
    fn drop(&mut self) {
        let _ = self.script("stop").status();
    }
}

/// A redis-server that only speaks TLS, with the secure broker's certificate.
struct TlsRedis {
    child: Child,
    port: u16,
}

impl TlsRedis {
    async fn start(certs: &Path, dir: &Path) -> Self {
        let port = free_port();
        let child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .arg("--tls-cert-file")
            .arg(certs.join("server.crt"))
            .arg("--tls-key-file")
            .arg(certs.join("server.key"))
            .arg("--tls-ca-cert-file")
            .arg(certs.join("ca.pem"))
            .args([
                "--tls-auth-clients",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        let redis = Self { child, port };
        eventually(
            Duration::from_secs(10),
            "TLS redis-server to answer",
            || async {
                let conn = RedisConn::connect(&redis.insecure_url()).await.ok()?;
                redis::cmd("PING")
                    .query_async::<String>(&mut conn.clone())
                    .await
                    .ok()
            },
        )
        .await;
        redis
    }

    /// What the aggregator uses: the certificate is verified against the CA.
    fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }

    /// For the test's own reads only.
    fn insecure_url(&self) -> String {
        format!("rediss://127.0.0.1:{}/#insecure", self.port)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An aggregator setup on the secure broker and the TLS Redis, with its topics created.
async fn setup(kafka: &SecureKafka, redis: &TlsRedis, name: &str) -> AggregatorSetup {
    let setup = AggregatorSetup::named(&format!("127.0.0.1:{}", kafka.port), name, &redis.url());
    let admin = format!("127.0.0.1:{}", kafka.admin_port);
    create_topic_on(&admin, &setup.topic, 4).await;
    create_topic_on(&admin, &setup.dead_letter_topic, 1).await;
    setup
}

/// Writes a config file holding `options` as its `[kafka]` table, and a file holding `password`.
fn files(dir: &Path, options: &[(String, String)], password: &str) -> (PathBuf, PathBuf) {
    let config = dir.join(format!("{}.toml", unique("aggregator")));
    let table: String = options
        .iter()
        .map(|(k, v)| format!("\"{k}\" = \"{v}\"\n"))
        .collect();
    std::fs::write(&config, format!("[kafka]\n{table}")).expect("config");
    let secret = dir.join(unique("sasl-password"));
    std::fs::write(&secret, format!("{password}\n")).expect("password file");
    (config, secret)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_over_tls_to_kafka_and_tls_to_redis_count_exactly_and_keep_secrets_out() {
    let _serial = serial().await;
    let dir = TempDir::new("tally-secure");
    let kafka = tokio::task::block_in_place(SecureKafka::start);
    let redis = TlsRedis::start(kafka.dir.path(), dir.path()).await;
    let reads = Reader::new(
        RedisConn::connect(&redis.insecure_url())
            .await
            .expect("reader"),
        tally_common::Keyspace::default(),
    );

    for (mechanism, user, password) in [
        ("SCRAM-SHA-512", "tally", SCRAM_PASSWORD),
        ("PLAIN", "tally-plain", PLAIN_PASSWORD),
    ] {
        let setup = setup(&kafka, &redis, "secure").await;
        let options = kafka.options(mechanism, user);
        let (config, secret) = files(dir.path(), &options, password);
        let ca = kafka.ca();
        let aggregator = setup.spawn_with_env(
            dir.path(),
            &["--config", config.to_str().expect("utf-8")],
            &[
                (
                    "TALLY_KAFKA_SASL_PASSWORD_FILE",
                    secret.to_str().expect("utf-8"),
                ),
                // OpenSSL's default trust store, for the Redis certificate.
                ("SSL_CERT_FILE", ca.to_str().expect("utf-8")),
            ],
        );
        let mut producer = ProducerConfig::new(&setup.brokers, &setup.topic);
        for (k, v) in options
            .iter()
            .cloned()
            .chain([("sasl.password".to_owned(), password.to_owned())])
        {
            producer = producer.option(k, v);
        }
        let spec = LoadSpec {
            events: 20_000,
            counters: 200,
            ..LoadSpec::default()
        };
        let report = finish_load(start_load_with(producer, spec), 20_000).await;
        let reader = Reader::new(reads.conn().clone(), setup.keyspace());
        wait_for_totals(&reader, &report.totals, Duration::from_secs(60)).await;

        let log = aggregator.log();
        let metrics = http_get(aggregator.metrics_port(), "/metrics")
            .await
            .expect("metrics");
        assert!(
            !log.contains(password),
            "{mechanism}: the password is in the log"
        );
        assert!(
            !metrics.contains(password),
            "{mechanism}: the password is in /metrics"
        );
        assert_eq!(
            aggregator.metric("tally_redis_up").await,
            Some(1.0),
            "{mechanism}"
        );
    }

    // A wrong password: alive, never in the group, and the log says why without the password.
    let setup = setup(&kafka, &redis, "secure-wrong").await;
    let (config, secret) = files(
        dir.path(),
        &kafka.options("SCRAM-SHA-512", "tally"),
        "not-the-password",
    );
    let wrong = setup.spawn_with_env(
        dir.path(),
        &["--config", config.to_str().expect("utf-8")],
        &[(
            "TALLY_KAFKA_SASL_PASSWORD_FILE",
            secret.to_str().expect("utf-8"),
        )],
    );
    eventually(
        Duration::from_secs(30),
        "an authentication failure in the log",
        || async { wrong.log().contains("Authentication failed").then_some(()) },
    )
    .await;
    let (status, why) = http_get_status(wrong.metrics_port(), "/readyz")
        .await
        .expect("answers");
    assert_eq!(
        (status, why.trim()),
        (503, "not a member of the consumer group")
    );
    assert!(!wrong.log().contains("not-the-password"));
}
