//! Bearer tokens, each with scopes, from a file the operator protects.
//!
//! The file (`--tokens`, `TALLY_TOKENS`, or `tokens` in the config file) is TOML; it holds the
//! SHA-256 of each token, never the token, so a leaked file grants nothing:
//!
//! ```toml
//! [[token]]
//! name = "feed-service"          # who, for the logs
//! sha256 = "9f86d081884c7d65..." # printf %s "$TOKEN" | sha256sum
//! scopes = ["read"]              # "read", "write", or both
//! ```
//!
//! A request to a `/v1/` route without `Authorization: Bearer <token>`, or with a token the file
//! does not list, is answered 401 `unauthorized`; with a listed token lacking the route's scope,
//! 403 `forbidden`. With no file configured every request is let through, and the server refuses
//! to listen anywhere but loopback (see `main.rs`).

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
}

impl Scope {
    fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Write => "write",
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
    by_digest: HashMap<[u8; 32], Grant>,
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
            if by_digest.insert(digest, grant).is_some() {
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

    /// Lets the request through if its bearer token has `scope`.
    fn check(&self, authorization: Option<&str>, scope: Scope) -> Result<(), ApiError> {
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
        if grant.scopes.contains(&scope) {
            return Ok(());
        }
        Err(ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "token {:?} lacks the {:?} scope this route needs",
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
pub async fn require(State(guard): State<Guard>, request: Request, next: Next) -> Response {
    if let Some(tokens) = &guard.tokens {
        let authorization =
            (request.headers().get(header::AUTHORIZATION)).and_then(|v| v.to_str().ok());
        if let Err(error) = tokens.check(authorization, guard.scope) {
            return axum::response::IntoResponse::into_response(error);
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

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
