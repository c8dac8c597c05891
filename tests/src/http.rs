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
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let mut request =
        format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n");
    if let Some(body) = body {
        request.push_str(&format!(
            "content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        ));
    } else {
        request.push_str("\r\n");
    }
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Some((
        status,
        if chunked {
            dechunk(body)?
        } else {
            body.to_owned()
        },
    ))
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
