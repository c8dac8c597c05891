//! SASL's client side: `PLAIN` (RFC 4616) and `SCRAM-SHA-256`/`-512` (RFC 5802, 7677), as a
//! state machine of messages in and out; `crate::connection` carries them in `SaslAuthenticate`
//! requests.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::digest::Digest;
use hmac::{EagerHash, Hmac, KeyInit, Mac};

use crate::config::{Mechanism, Sasl};

/// The exchange failed: the server's message was not what the mechanism expects, or the
/// server could not prove it knows the password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("SASL {mechanism}: {what}")]
pub struct SaslError {
    /// The mechanism.
    pub mechanism: &'static str,
    /// What went wrong.
    pub what: String,
}

/// One client's side of one exchange.
#[derive(Debug)]
pub enum Exchange {
    /// `PLAIN`: one message, no answer expected beyond success.
    Plain,
    /// SCRAM, waiting for the server's first message.
    ScramFirst(Scram),
    /// SCRAM, waiting for the server's final message, which must carry this signature.
    ScramFinal {
        /// The mechanism.
        mechanism: Mechanism,
        /// The server signature expected.
        expected: Vec<u8>,
    },
    /// Done.
    Done,
}

/// A SCRAM exchange's state after the client's first message.
#[derive(Debug)]
pub struct Scram {
    mechanism: Mechanism,
    password: String,
    client_nonce: String,
    client_first_bare: String,
}

/// The client's first message and the exchange that reads the server's answers.
pub fn start(sasl: &Sasl, nonce: &str) -> (Vec<u8>, Exchange) {
    match sasl.mechanism {
        Mechanism::Plain => {
            let mut message = vec![0u8];
            message.extend_from_slice(sasl.username.as_bytes());
            message.push(0);
            message.extend_from_slice(sasl.password.as_bytes());
            (message, Exchange::Plain)
        }
        mechanism @ (Mechanism::ScramSha256 | Mechanism::ScramSha512) => {
            let user = sasl.username.replace('=', "=3D").replace(',', "=2C");
            let client_first_bare = format!("n={user},r={nonce}");
            let message = format!("n,,{client_first_bare}").into_bytes();
            let scram = Scram {
                mechanism,
                password: sasl.password.clone(),
                client_nonce: nonce.to_owned(),
                client_first_bare,
            };
            (message, Exchange::ScramFirst(scram))
        }
    }
}

impl Exchange {
    /// Reads the server's message; returns the client's next message, if the exchange goes on.
    pub fn step(&mut self, server: &[u8]) -> Result<Option<Vec<u8>>, SaslError> {
        match std::mem::replace(self, Exchange::Done) {
            Exchange::Plain | Exchange::Done => Ok(None),
            Exchange::ScramFirst(scram) => {
                let (message, expected) = scram.respond(server)?;
                *self = Exchange::ScramFinal {
                    mechanism: scram.mechanism,
                    expected,
                };
                Ok(Some(message))
            }
            Exchange::ScramFinal {
                mechanism,
                expected,
            } => {
                let error = |what: &str| SaslError {
                    mechanism: mechanism.name(),
                    what: what.to_owned(),
                };
                let text = std::str::from_utf8(server)
                    .map_err(|_| error("a server-final message that is not UTF-8"))?;
                if let Some(e) = attribute(text, 'e') {
                    return Err(error(&format!("the server refused: {e}")));
                }
                let signature = attribute(text, 'v').ok_or_else(|| error("no server signature"))?;
                let signature = BASE64
                    .decode(signature)
                    .map_err(|_| error("a server signature that is not base64"))?;
                if signature != expected {
                    return Err(error(
                        "the server's signature is wrong: it does not know the password",
                    ));
                }
                Ok(None)
            }
        }
    }

    /// Whether the client expects another message from the server.
    pub fn expects_more(&self) -> bool {
        matches!(self, Exchange::ScramFirst(_) | Exchange::ScramFinal { .. })
    }
}

/// The value of `name=` in a SCRAM message.
fn attribute(message: &str, name: char) -> Option<&str> {
    message.split(',').find_map(|part| {
        let mut chars = part.chars();
        (chars.next() == Some(name) && chars.next() == Some('=')).then(|| &part[2..])
    })
}

impl Scram {
    /// The client-final message, and the server signature the server must then send.
    fn respond(&self, server_first: &[u8]) -> Result<(Vec<u8>, Vec<u8>), SaslError> {
        let error = |what: &str| SaslError {
            mechanism: self.mechanism.name(),
            what: what.to_owned(),
        };
        let text = std::str::from_utf8(server_first)
            .map_err(|_| error("a server-first message that is not UTF-8"))?;
        let nonce = attribute(text, 'r').ok_or_else(|| error("no nonce"))?;
        if !nonce.starts_with(&self.client_nonce) || nonce.len() <= self.client_nonce.len() {
            return Err(error("the server's nonce does not extend the client's"));
        }
        let salt = attribute(text, 's').ok_or_else(|| error("no salt"))?;
        let salt = BASE64
            .decode(salt)
            .map_err(|_| error("a salt that is not base64"))?;
        let iterations: u32 = attribute(text, 'i')
            .and_then(|i| i.parse().ok())
            .filter(|i| *i > 0)
            .ok_or_else(|| error("no iteration count"))?;
        let without_proof = format!("c=biws,r={nonce}");
        let auth_message = format!("{},{text},{without_proof}", self.client_first_bare);
        let (proof, server_signature) = match self.mechanism {
            Mechanism::ScramSha512 => {
                proofs::<sha2::Sha512>(&self.password, &salt, iterations, &auth_message)
            }
            _ => proofs::<sha2::Sha256>(&self.password, &salt, iterations, &auth_message),
        };
        let message = format!("{without_proof},p={}", BASE64.encode(proof)).into_bytes();
        Ok((message, server_signature))
    }
}

fn hmac<D: EagerHash>(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = <Hmac<D> as KeyInit>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    for part in parts {
        Mac::update(&mut mac, part);
    }
    mac.finalize().into_bytes().to_vec()
}

/// The client proof and the server signature of RFC 5802, for digest `D`.
fn proofs<D: EagerHash>(
    password: &str,
    salt: &[u8],
    iterations: u32,
    auth_message: &str,
) -> (Vec<u8>, Vec<u8>) {
    // Hi(): PBKDF2 with HMAC-D, one block.
    let mut u = hmac::<D>(password.as_bytes(), &[salt, &1u32.to_be_bytes()]);
    let mut salted = u.clone();
    for _ in 1..iterations {
        u = hmac::<D>(password.as_bytes(), &[&u]);
        salted.iter_mut().zip(&u).for_each(|(s, x)| *s ^= x);
    }
    let client_key = hmac::<D>(&salted, &[b"Client Key"]);
    let stored_key = <D as Digest>::digest(&client_key);
    let client_signature = hmac::<D>(&stored_key, &[auth_message.as_bytes()]);
    let proof = client_key
        .iter()
        .zip(&client_signature)
        .map(|(k, s)| k ^ s)
        .collect();
    let server_key = hmac::<D>(&salted, &[b"Server Key"]);
    let server_signature = hmac::<D>(&server_key, &[auth_message.as_bytes()]);
    (proof, server_signature)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sasl(mechanism: Mechanism, username: &str, password: &str) -> Sasl {
        Sasl {
            mechanism,
            username: username.into(),
            password: password.into(),
        }
    }

    #[test]
    fn plain_sends_one_message() {
        let (first, mut exchange) = start(&sasl(Mechanism::Plain, "u", "p"), "n");
        assert_eq!(first, b"\0u\0p");
        assert!(!exchange.expects_more());
        assert_eq!(exchange.step(b""), Ok(None));
    }

    /// RFC 7677's SCRAM-SHA-256 example, message for message.
    #[test]
    fn scram_sha_256_matches_rfc_7677() {
        let (first, mut exchange) = start(
            &sasl(Mechanism::ScramSha256, "user", "pencil"),
            "rOprNGfwEbeRWgbNEkqO",
        );
        assert_eq!(first, b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO");
        let server_first = b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096";
        let client_final = exchange
            .step(server_first)
            .expect("as written")
            .expect("as written");
        assert_eq!(
            String::from_utf8(client_final).expect("as written"),
            "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
        );
        assert!(exchange.expects_more());
        assert_eq!(
            exchange.step(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="),
            Ok(None)
        );
        assert!(!exchange.expects_more());
    }

    #[test]
    fn scram_refuses_a_server_that_does_not_know_the_password() {
        let (_, mut exchange) = start(&sasl(Mechanism::ScramSha512, "user", "pencil"), "abc");
        exchange
            .step(b"r=abcdef,s=c2FsdA==,i=4096")
            .expect("as written");
        let wrong = exchange.step(b"v=AAAA").expect_err("an error");
        assert!(wrong.what.contains("does not know the password"), "{wrong}");
        let (_, mut exchange) = start(&sasl(Mechanism::ScramSha512, "user", "pencil"), "abc");
        assert!(
            exchange.step(b"r=zzz,s=c2FsdA==,i=4096").is_err(),
            "a nonce not extending ours"
        );
        let (_, mut exchange) = start(&sasl(Mechanism::ScramSha512, "user", "pencil"), "abc");
        exchange
            .step(b"r=abcdef,s=c2FsdA==,i=4096")
            .expect("as written");
        assert!(
            exchange
                .step(b"e=invalid-proof")
                .expect_err("an error")
                .what
                .contains("invalid-proof")
        );
    }

    #[test]
    fn usernames_are_escaped() {
        let (first, _) = start(&sasl(Mechanism::ScramSha256, "a=b,c", "p"), "n");
        assert_eq!(first, b"n,,n=a=3Db=2Cc,r=n");
    }
}
