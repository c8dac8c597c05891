//! Credentials: where the aggregator takes them from, and where it refuses them.
//!
//! Secrets come from the environment, or from files the environment names (Kubernetes Secrets
//! and systemd credentials are files), or from the config file's `[kafka]` table (a file an
//! operator protects). They never come from command-line flags, which any local user can read in
//! `ps`: a secret librdkafka option given with `--kafka-option`, or a Redis URL with a password
//! given with `--redis-url`, is refused at start-up with an error saying where to put it.
//!
//! | variable (or `<variable>_FILE`, a path to read it from) | becomes |
//! |---|---|
//! | `TALLY_REDIS_USERNAME` | the Redis ACL user (in the URL) |
//! | `TALLY_REDIS_PASSWORD` | the Redis password (in the URL) |
//! | `TALLY_POSTGRES_PASSWORD` | the PostgreSQL password (`--store postgres`) |
//! | `TALLY_KAFKA_SASL_PASSWORD` | librdkafka `sasl.password` |
//! | `TALLY_KAFKA_SSL_KEY_PASSWORD` | librdkafka `ssl.key.password` |
//! | `TALLY_KAFKA_SSL_KEYSTORE_PASSWORD` | librdkafka `ssl.keystore.password` |
//! | `TALLY_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET` | librdkafka `sasl.oauthbearer.client.secret` |
//!
//! Once in the aggregator's `Config`, secrets are never printed: its `Debug` shows Kafka
//! option names only and the Redis URL with `***` for the password, and no metric carries a
//! setting's value.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tally_common::RedisTarget;

use crate::error::ConfigError;

/// librdkafka options whose values are secrets, and the variables that set them.
pub const KAFKA_SECRET_VARIABLES: [(&str, &str); 4] = [
    ("sasl.password", "TALLY_KAFKA_SASL_PASSWORD"),
    ("ssl.key.password", "TALLY_KAFKA_SSL_KEY_PASSWORD"),
    ("ssl.keystore.password", "TALLY_KAFKA_SSL_KEYSTORE_PASSWORD"),
    (
        "sasl.oauthbearer.client.secret",
        "TALLY_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET",
    ),
];

/// Whether a librdkafka option's value is a secret (a password, a private key, a client secret).
pub fn is_secret_option(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.contains("password")
        || key.contains("secret")
        || key == "ssl.key.pem"
        || key == "sasl.oauthbearer.config"
}

/// Credentials gathered from the environment.
#[derive(Default, Clone, PartialEq, Eq)]
pub struct Secrets {
    /// The Redis ACL user.
    pub redis_username: Option<String>,
    /// The Redis password.
    pub redis_password: Option<String>,
    /// The PostgreSQL password.
    pub postgres_password: Option<String>,
    /// Secret librdkafka options.
    pub kafka: BTreeMap<String, String>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secrets")
            .field("redis_username", &self.redis_username)
            .field(
                "redis_password",
                &self.redis_password.as_ref().map(|_| "***"),
            )
            .field(
                "postgres_password",
                &self.postgres_password.as_ref().map(|_| "***"),
            )
            .field("kafka", &self.kafka.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Secrets {
    /// Reads the variables of the table above from the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `lookup` (the environment, or a map in tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut secrets = Secrets {
            redis_username: lookup("TALLY_REDIS_USERNAME"),
            redis_password: value_or_file(&lookup, "TALLY_REDIS_PASSWORD")?,
            postgres_password: value_or_file(&lookup, "TALLY_POSTGRES_PASSWORD")?,
            kafka: BTreeMap::new(),
        };
        for (option, variable) in KAFKA_SECRET_VARIABLES {
            if let Some(value) = value_or_file(&lookup, variable)? {
                secrets.kafka.insert(option.to_owned(), value);
            }
        }
        Ok(secrets)
    }

    /// `target` with the Redis credentials put in (percent-encoded), if any were given. On a
    /// cluster they apply to every seed node.
    pub fn redis_target(&self, target: RedisTarget) -> Result<RedisTarget, ConfigError> {
        if self.redis_username.is_none() && self.redis_password.is_none() {
            return Ok(target);
        }
        if target.has_credentials() {
            return Err(ConfigError::Invalid {
                name: "redis_url",
                why: "already holds credentials: give them either in the URL or in TALLY_REDIS_USERNAME / TALLY_REDIS_PASSWORD, not both".to_owned(),
            });
        }
        Ok(target.with_credentials(
            self.redis_username.as_deref().map(percent_encode),
            self.redis_password.as_deref().map(percent_encode),
        ))
    }
}

/// The value of `variable`, or the contents of the file `<variable>_FILE` names (without its
/// trailing newline); both set is an error.
fn value_or_file(
    lookup: &impl Fn(&str) -> Option<String>,
    variable: &'static str,
) -> Result<Option<String>, ConfigError> {
    let file_variable = format!("{variable}_FILE");
    match (lookup(variable), lookup(&file_variable)) {
        (Some(_), Some(_)) => Err(ConfigError::Invalid {
            name: variable,
            why: format!("set either {variable} or {file_variable}, not both"),
        }),
        (Some(value), None) => Ok(Some(value)),
        (None, Some(path)) => {
            let path = PathBuf::from(path);
            let text = std::fs::read_to_string(&path)
                .map_err(|source| ConfigError::Read { path, source })?;
            Ok(Some(text.trim_end_matches(['\r', '\n']).to_owned()))
        }
        (None, None) => Ok(None),
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters (for a URL's user info or
/// query string).
pub fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A PostgreSQL connection string fit to print: the password of a URL's user information, a
/// URL's `password` query parameter, and a key=value string's `password` each as `***`.
pub fn masked_postgres_url(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let authority = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***@{hosts}"),
                None => format!("{userinfo}@{hosts}"),
            },
            None => authority.to_owned(),
        };
        let tail = match tail.split_once('?') {
            Some((path, query)) => {
                let pairs: Vec<String> = (query.split('&'))
                    .map(|pair| match pair.split_once('=') {
                        Some(("password", _)) => "password=***".to_owned(),
                        _ => pair.to_owned(),
                    })
                    .collect();
                format!("{path}?{}", pairs.join("&"))
            }
            None => tail.to_owned(),
        };
        return format!("{scheme}://{authority}{tail}");
    }
    // key=value pairs, a value maybe quoted with single quotes (and \' inside).
    let mut out = String::with_capacity(url.len());
    let mut rest = url;
    while let Some(at) = rest.find("password") {
        let (before, from) = rest.split_at(at);
        out.push_str(before);
        let after_key = from["password".len()..].trim_start();
        let starts_word = before.is_empty() || before.ends_with(char::is_whitespace);
        let Some(value) = after_key.strip_prefix('=').filter(|_| starts_word) else {
            out.push_str("password");
            rest = &from["password".len()..];
            continue;
        };
        let value = value.trim_start();
        let end = match value.strip_prefix('\'') {
            Some(quoted) => {
                let mut escaped = false;
                let close = quoted.char_indices().find_map(|(i, c)| {
                    let closes = c == '\'' && !escaped;
                    escaped = c == '\\' && !escaped;
                    closes.then_some(i)
                });
                close.map_or(value.len(), |i| i + 2)
            }
            None => value.find(char::is_whitespace).unwrap_or(value.len()),
        };
        out.push_str("password=***");
        rest = &value[end..];
    }
    out.push_str(rest);
    out
}

/// Whether a PostgreSQL connection string holds a password.
pub fn postgres_url_has_password(url: &str) -> bool {
    <tokio_postgres::Config as std::str::FromStr>::from_str(url)
        .is_ok_and(|c| c.get_password().is_some())
}

/// Refuses secrets given as command-line flags: `from_command_line(id)` says whether the
/// argument `id` (`kafka_options`, `redis_url`, `postgres_url`) came from the command line rather
/// than from the environment.
pub fn refuse_secret_flags(
    kafka_options: &[(String, String)],
    redis_url: Option<&str>,
    postgres_url: Option<&str>,
    from_command_line: impl Fn(&str) -> bool,
) -> Result<(), ConfigError> {
    let secret_flag = kafka_options.iter().find(|(k, _)| is_secret_option(k));
    if let Some((key, _)) = secret_flag.filter(|_| from_command_line("kafka_options")) {
        let variable = KAFKA_SECRET_VARIABLES
            .iter()
            .find(|(option, _)| option == key)
            .map_or("TALLY_KAFKA_OPTIONS".to_owned(), |(_, v)| {
                format!("{v} or {v}_FILE")
            });
        return Err(ConfigError::Invalid {
            name: "kafka-option",
            why: format!(
                "{key} is a secret and command lines are visible to every local user: set it with {variable}, or in the config file's [kafka] table"
            ),
        });
    }
    let has_password = |url: &str| RedisTarget::parse(url).is_ok_and(|t| t.has_password());
    if from_command_line("redis_url") && redis_url.is_some_and(has_password) {
        return Err(ConfigError::Invalid {
            name: "redis-url",
            why: "the URL holds a password and command lines are visible to every local user: set TALLY_REDIS_PASSWORD or TALLY_REDIS_PASSWORD_FILE (and TALLY_REDIS_USERNAME), or put the URL in TALLY_REDIS_URL or the config file".to_owned(),
        });
    }
    if from_command_line("postgres_url") && postgres_url.is_some_and(postgres_url_has_password) {
        return Err(ConfigError::Invalid {
            name: "postgres-url",
            why: "the URL holds a password and command lines are visible to every local user: set TALLY_POSTGRES_PASSWORD or TALLY_POSTGRES_PASSWORD_FILE, or put the URL in TALLY_POSTGRES_URL or the config file".to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_urls_print_without_their_passwords() {
        for (url, printed) in [
            (
                "postgres://app:hunter2@db:5432/tally",
                "postgres://app:***@db:5432/tally",
            ),
            ("postgresql://app@db/tally", "postgresql://app@db/tally"),
            (
                "postgres://db/tally?user=app&password=hunter2&sslmode=require",
                "postgres://db/tally?user=app&password=***&sslmode=require",
            ),
            ("postgres://a:b:c@h1,h2/x", "postgres://a:***@h1,h2/x"),
            (
                "host=db user=app password=hunter2 dbname=tally",
                "host=db user=app password=*** dbname=tally",
            ),
            (
                "host=db password = 'hun ter\\'2' dbname=tally",
                "host=db password=*** dbname=tally",
            ),
            ("host=db mypassword=x", "host=db mypassword=x"),
        ] {
            assert_eq!(masked_postgres_url(url), printed, "{url}");
        }
    }

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn secrets_come_from_variables_or_the_files_they_name() {
        let dir = std::env::temp_dir().join(format!("tally-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("kafka-password");
        std::fs::write(&file, "s3cr:et/@\n").expect("written");
        let secrets = Secrets::from_lookup(lookup(&[
            ("TALLY_REDIS_USERNAME", "tally-aggregator"),
            ("TALLY_REDIS_PASSWORD", "p@ss:w/rd"),
            (
                "TALLY_KAFKA_SASL_PASSWORD_FILE",
                file.to_str().expect("utf-8"),
            ),
        ]))
        .expect("read");
        assert_eq!(
            secrets.kafka.get("sasl.password").map(String::as_str),
            Some("s3cr:et/@")
        );
        let with = |url: &str| {
            let target = RedisTarget::parse(url).expect("a Redis URL");
            secrets.redis_target(target).map(|t| t.url())
        };
        assert_eq!(
            with("redis://10.0.0.1:6379/0").expect("url"),
            "redis://tally-aggregator:p%40ss%3Aw%2Frd@10.0.0.1:6379/0"
        );
        assert_eq!(
            with("rediss+cluster://a:1,b:2").expect("url"),
            "rediss+cluster://tally-aggregator:p%40ss%3Aw%2Frd@a:1,b:2"
        );
        assert!(with("redis://u:x@h:1").is_err(), "credentials twice");
        let shown = format!("{secrets:?}");
        assert!(
            !shown.contains("p@ss") && !shown.contains("s3cr"),
            "{shown}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_variable_and_its_file_together_are_refused() {
        let both = Secrets::from_lookup(lookup(&[
            ("TALLY_REDIS_PASSWORD", "a"),
            ("TALLY_REDIS_PASSWORD_FILE", "/nonexistent"),
        ]));
        assert!(matches!(
            both,
            Err(ConfigError::Invalid {
                name: "TALLY_REDIS_PASSWORD",
                ..
            })
        ));
        let missing = Secrets::from_lookup(lookup(&[(
            "TALLY_KAFKA_SASL_PASSWORD_FILE",
            "/nonexistent/x",
        )]));
        assert!(matches!(missing, Err(ConfigError::Read { .. })));
    }

    #[test]
    fn secrets_on_the_command_line_are_refused_and_elsewhere_accepted() {
        let options = vec![
            ("security.protocol".to_owned(), "SASL_SSL".to_owned()),
            ("sasl.password".to_owned(), "hunter2".to_owned()),
        ];
        let flag = refuse_secret_flags(&options, None, None, |_| true).expect_err("refused");
        let message = flag.to_string();
        assert!(message.contains("TALLY_KAFKA_SASL_PASSWORD"), "{message}");
        assert!(!message.contains("hunter2"), "{message}");
        assert!(
            refuse_secret_flags(&options, None, None, |_| false).is_ok(),
            "from the environment"
        );
        let url = Some("redis://u:hunter2@h:6379");
        let flag =
            refuse_secret_flags(&[], url, None, |id| id == "redis_url").expect_err("refused");
        assert!(!flag.to_string().contains("hunter2"));
        assert!(refuse_secret_flags(&[], Some("redis://u@h:6379"), None, |_| true).is_ok());
        assert!(refuse_secret_flags(&[], url, None, |_| false).is_ok());
    }

    #[test]
    fn secret_options_are_recognised() {
        for key in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "ssl.key.pem",
            "sasl.oauthbearer.client.secret",
        ] {
            assert!(is_secret_option(key), "{key}");
        }
        for key in [
            "sasl.username",
            "security.protocol",
            "ssl.ca.location",
            "sasl.mechanisms",
        ] {
            assert!(!is_secret_option(key), "{key}");
        }
    }
}
