//! A minimal HTTP/1.1 client over TCP, for the aggregator's `/metrics`, `/healthz` and
//! `/readyz` and the API server's routes.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A one-shot HTTP GET on loopback; the body, or `None` if nothing answers.
pub async fn http_get(port: u16, path: &str) -> Option<String> {
    http_get_status(port, path).await.map(|(_, body)| body)
}

/// A one-shot HTTP/1.1 GET on loopback (`connection: close`, chunked bodies decoded): the status
/// code and the body, or `None` if nothing answers.
pub async fn http_get_status(port: u16, path: &str) -> Option<(u16, String)> {
    http_request(port, "GET", path, None).await
}

/// A one-shot HTTP/1.1 request on loopback, with a JSON body if given: the status code and the
/// body, or `None` if nothing answers.
pub async fn http_request(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Option<(u16, String)> {
    let headers: &[(&str, &str)] = match body {
        Some(_) => &[("content-type", "application/json")],
        None => &[],
    };
    let answer = http_call(port, method, path, headers, body).await?;
    Some((answer.status, answer.body))
}

/// An HTTP answer.
#[derive(Debug, Clone)]
pub struct HttpAnswer {
    /// The status code.
    pub status: u16,
    /// The header lines, lowercased.
    pub head: String,
    /// The body, dechunked.
    pub body: String,
}

/// A one-shot HTTP/1.1 request on loopback (`connection: close`) with the given extra headers
/// (`host: localhost` unless they name another) and body; `None` if nothing answers.
pub async fn http_call(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Option<HttpAnswer> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let mut request = format!("{method} {path} HTTP/1.1\r\nconnection: close\r\n");
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        request.push_str("host: localhost\r\n");
    }
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    let body = body.unwrap_or_default();
    if !body.is_empty() || method == "POST" || method == "PUT" {
        request.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).await.ok()?;
    // Read to the end of the message, not of the connection: some servers (chromedriver) keep
    // it open whatever `connection: close` asked.
    let mut bytes = Vec::new();
    let mut chunk = [0_u8; 16 * 1024];
    let (head, body_start) = loop {
        if let Some(at) = bytes.windows(4).position(|w| w == b"\r\n\r\n") {
            break (
                String::from_utf8_lossy(&bytes[..at]).to_ascii_lowercase(),
                at + 4,
            );
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        bytes.extend_from_slice(&chunk[..n]);
    };
    let length = (head.lines())
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok());
    let chunked = head.contains("transfer-encoding: chunked");
    loop {
        let body = &bytes[body_start..];
        let complete = match length {
            Some(length) => body.len() >= length,
            None if chunked => body.ends_with(b"0\r\n\r\n"),
            None => false,
        };
        if complete {
            break;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&chunk[..n]);
    }
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = String::from_utf8(bytes[body_start..].to_vec()).ok()?;
    let body = if chunked { dechunk(&body)? } else { body };
    Some(HttpAnswer { status, head, body })
}

/// Decodes an HTTP/1.1 chunked body.
fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size + 2..)?;
    }
}
