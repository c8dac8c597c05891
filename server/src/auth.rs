//! Bearer tokens, each with scopes, from a file the operator protects.
//!
//! The file (`--tokens`, `TALLY_TOKENS`, or `tokens` in the config file) is TOML; it holds the
//! SHA-256 of each token, never the token, so a leaked file grants nothing:
//!
//! ```toml
//! [[token]]
//! name = "feed-service"          # who, for the logs
//! sha256 = "9f86d081884c7d65..." # printf %s "$TOKEN" | sha256sum
//! scopes = ["read"]              # "read", "write", "reset": any of them
//! ```
//!
//! A request to a `/v1/` route without `Authorization: Bearer <token>`, or with a token the file
//! does not list, is answered 401 `unauthorized`; with a listed token lacking the route's scope,
//! 403 `forbidden`. Resetting a counter (an event with `"reset": true`) needs the `reset` scope
//! on top of `write`: a service that counts need not be able to clear counts.
//!
//! With no file configured every request is let through, the server refuses to listen anywhere
//! but loopback (see `main.rs`), and it answers only requests addressed to a loopback name
//! ([`loopback_host`]): a web page the operator visits cannot reach it through DNS rebinding,
//! because the browser then sends the attacker's host name.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Read totals, likes, the top counters and the pipeline's state.
    Read,
    /// Send events, like and unlike.
    Write,
    /// Reset counters (with `write`, which sending the reset needs).
    Reset,
}

impl Scope {
    fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Write => "write",
            Scope::Reset => "reset",
        }
    }
}

/// The token file's layout.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenFile {
    #[serde(default)]
    token: Vec<TokenEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    sha256: String,
    scopes: Vec<Scope>,
}

/// Who a token belongs to and what it may do.
#[derive(Debug, Clone)]
struct Grant {
    name: String,
    scopes: Vec<Scope>,
}

/// The tokens the server accepts, by their SHA-256.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    by_digest: HashMap<[u8; 32], Arc<Grant>>,
}

/// Why the token file is unusable.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    /// It could not be read.
    #[error("cannot read the token file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// It is not a token file.
    #[error("invalid token file {path}: {why}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        why: String,
    },
}

/// The SHA-256 of `token`.
pub fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn parse_hex_digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0_u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl Tokens {
    /// Reads the token file at `path`.
    pub fn from_file(path: &Path) -> Result<Self, TokenFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenFileError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text).map_err(|why| TokenFileError::Invalid {
            path: path.display().to_string(),
            why,
        })
    }

    /// Parses a token file's text.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let file: TokenFile = toml::from_str(text).map_err(|e| e.to_string())?;
        if file.token.is_empty() {
            return Err("it lists no [[token]]".to_owned());
        }
        let mut by_digest = HashMap::new();
        for entry in file.token {
            let digest = parse_hex_digest(&entry.sha256).ok_or_else(|| {
                format!(
                    "token {:?}: sha256 must be 64 hex digits (printf %s \"$TOKEN\" | sha256sum)",
                    entry.name
                )
            })?;
            if entry.scopes.is_empty() {
                return Err(format!("token {:?} has no scopes", entry.name));
            }
            let grant = Grant {
                name: entry.name.clone(),
                scopes: entry.scopes,
            };
            if by_digest.insert(digest, Arc::new(grant)).is_some() {
                return Err(format!("token {:?} is listed twice", entry.name));
            }
        }
        Ok(Self { by_digest })
    }

    /// How many tokens are listed.
    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Whether no token is listed.
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// Lets the request through if its bearer token has `scope`: what the token may do.
    fn check(&self, authorization: Option<&str>, scope: Scope) -> Result<Granted, ApiError> {
        let unauthorized = |why: &str| {
            ApiError::new(
                axum::http::StatusCode::UNAUTHORIZED,
                "unauthorized",
                format!("{why}: send Authorization: Bearer <token>"),
            )
        };
        let Some(value) = authorization else {
            return Err(unauthorized("no token"));
        };
        let token = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(str::trim)
            .ok_or_else(|| unauthorized("not a bearer token"))?;
        let grant =
            (self.by_digest.get(&digest(token))).ok_or_else(|| unauthorized("unknown token"))?;
        let granted = Granted(Some(grant.clone()));
        granted.allows(scope, "this route")?;
        Ok(granted)
    }
}

/// What the request's token may do, for handlers whose scope depends on the body (a reset);
/// every request that passed [`require`] carries it.
#[derive(Debug, Clone)]
pub struct Granted(Option<Arc<Grant>>);

impl Granted {
    /// Whether `scope` is granted (always, without a token file), or 403 naming `what` needs it.
    pub fn allows(&self, scope: Scope, what: &str) -> Result<(), ApiError> {
        let Some(grant) = &self.0 else {
            return Ok(());
        };
        if grant.scopes.contains(&scope) {
            return Ok(());
        }
        Err(ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "token {:?} lacks the {:?} scope {what} needs",
                grant.name,
                scope.as_str()
            ),
        ))
    }
}

/// The authentication a group of routes asks for.
#[derive(Debug, Clone)]
pub struct Guard {
    /// The accepted tokens; `None` when no token file is configured (loopback only).
    pub tokens: Option<Arc<Tokens>>,
    /// The scope the routes need.
    pub scope: Scope,
}

/// The middleware: answers 401 or 403 unless the request may go on.
pub async fn require(State(guard): State<Guard>, mut request: Request, next: Next) -> Response {
    let granted = match &guard.tokens {
        None => Granted(None),
        Some(tokens) => {
            let authorization =
                (request.headers().get(header::AUTHORIZATION)).and_then(|v| v.to_str().ok());
            match tokens.check(authorization, guard.scope) {
                Ok(granted) => granted,
                Err(error) => return axum::response::IntoResponse::into_response(error),
            }
        }
    };
    request.extensions_mut().insert(granted);
    next.run(request).await
}

/// Whether a `Host` header names this machine's loopback: `localhost`, `127.0.0.1` (or any
/// `127.x.y.z`), `[::1]`, each with or without a port. A request without one (HTTP/1.0) is
/// not a browser's, so it is let through.
pub fn loopback_host(host: Option<&str>) -> bool {
    let Some(host) = host else {
        return true;
    };
    let name = match host.strip_prefix('[') {
        // [v6]:port or [v6]
        Some(rest) => match rest.split_once(']') {
            Some((v6, port)) if port.is_empty() || port.starts_with(':') => v6,
            _ => return false,
        },
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    if name.eq_ignore_ascii_case("localhost") {
        return true;
    }
    name.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// The middleware for a server without tokens: 403 `forbidden_host` to a request addressed to
/// anything but a loopback name.
pub async fn loopback_only(request: Request, next: Next) -> Response {
    let host = (request.headers().get(header::HOST)).map(|v| v.to_str().unwrap_or("\u{fffd}"));
    if loopback_host(host) {
        return next.run(request).await;
    }
    axum::response::IntoResponse::into_response(ApiError::new(
        axum::http::StatusCode::FORBIDDEN,
        "forbidden_host",
        "without tokens this server answers only requests addressed to localhost, 127.0.0.1 or [::1]",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// A token file of generated lines: read or refused with a reason, never a panic.
        #[test]
        fn any_token_file_is_read_or_refused(lines in proptest::collection::vec(
            proptest::prop_oneof![
                proptest::strategy::Just("[[token]]".to_owned()),
                "(name|sha256|scopes|x) = [-a-f0-9\"\\[\\], ]{0,70}",
                "[ -~]{0,40}",
            ],
            0..12,
        )) {
            let _ = Tokens::from_toml(&lines.join("\n"));
        }
    }

    fn hex(bytes: [u8; 32]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn tokens_are_checked_by_digest_and_scope() {
        let text = format!(
            "[[token]]\nname = \"reader\"\nsha256 = \"{}\"\nscopes = [\"read\"]\n\
             [[token]]\nname = \"writer\"\nsha256 = \"{}\"\nscopes = [\"read\", \"write\"]\n",
            hex(digest("r-secret")),
            hex(digest("w-secret")).to_uppercase(),
        );
        let tokens = Tokens::from_toml(&text).expect("a valid file");
        assert_eq!(tokens.len(), 2);
        assert!(tokens.check(Some("Bearer r-secret"), Scope::Read).is_ok());
        assert!(tokens.check(Some("Bearer w-secret"), Scope::Write).is_ok());
        let code = |auth, scope| tokens.check(auth, scope).map_err(|e| e.code()).err();
        assert_eq!(
            code(Some("Bearer r-secret"), Scope::Write),
            Some("forbidden")
        );
        assert_eq!(code(Some("Bearer nope"), Scope::Read), Some("unauthorized"));
        assert_eq!(
            code(Some("Basic r-secret"), Scope::Read),
            Some("unauthorized")
        );
        assert_eq!(code(None, Scope::Read), Some("unauthorized"));
    }

    #[test]
    fn reset_is_its_own_scope() {
        let text = format!(
            "[[token]]\nname = \"writer\"\nsha256 = \"{}\"\nscopes = [\"write\"]\n\
             [[token]]\nname = \"admin\"\nsha256 = \"{}\"\nscopes = [\"write\", \"reset\"]\n",
            hex(digest("w")),
            hex(digest("a")),
        );
        let tokens = Tokens::from_toml(&text).expect("a valid file");
        let writer = tokens
            .check(Some("Bearer w"), Scope::Write)
            .expect("writes");
        let refused = writer
            .allows(Scope::Reset, "a reset")
            .expect_err("no reset");
        assert_eq!(refused.code(), "forbidden");
        let admin = tokens
            .check(Some("Bearer a"), Scope::Write)
            .expect("writes");
        assert!(admin.allows(Scope::Reset, "a reset").is_ok());
        assert!(Granted(None).allows(Scope::Reset, "a reset").is_ok());
    }

    #[test]
    fn only_loopback_names_are_loopback_hosts() {
        for host in [
            "localhost",
            "LOCALHOST:8080",
            "127.0.0.1",
            "127.0.0.1:8080",
            "127.9.9.9:1",
            "[::1]",
            "[::1]:8080",
        ] {
            assert!(loopback_host(Some(host)), "{host}");
        }
        for host in [
            "attacker.example",
            "attacker.example:8080",
            "localhost.attacker.example",
            "10.0.0.1:8080",
            "[::2]:8080",
            "[::1]x",
            "",
            "127.0.0.1.nip.io",
        ] {
            assert!(!loopback_host(Some(host)), "{host}");
        }
        assert!(loopback_host(None));
    }

    #[test]
    fn bad_token_files_are_refused_with_the_reason() {
        let err = |text: &str| Tokens::from_toml(text).expect_err("refused");
        assert!(err("").contains("no [[token]]"));
        assert!(
            err("[[token]]\nname = \"a\"\nsha256 = \"abc\"\nscopes = [\"read\"]")
                .contains("64 hex")
        );
        let ok = hex(digest("x"));
        assert!(
            err(&format!(
                "[[token]]\nname = \"a\"\nsha256 = \"{ok}\"\nscopes = []"
            ))
            .contains("no scopes")
        );
        assert!(
            err(&format!(
                "[[token]]\nname = \"a\"\nsha256 = \"{ok}\"\nscopes = [\"admin\"]"
            ))
            .contains("admin")
        );
        let twice =
            format!("[[token]]\nname = \"a\"\nsha256 = \"{ok}\"\nscopes = [\"read\"]\n").repeat(2);
        assert!(err(&twice).contains("twice"));
    }
}
