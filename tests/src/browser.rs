//! A real headless Chromium (Debian's `chromium`), driven through `chromedriver` over the W3C
//! WebDriver protocol (JSON over HTTP, spoken with this crate's own HTTP client): open a page,
//! type, click, wait for an element, read what a person would see, take a screenshot.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use crate::http::http_call;
use crate::support::{eventually, free_port, unique};

/// Where Debian's packages put the browser and its driver.
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// Longest a lookup of an element waits for it to appear (WebDriver's implicit wait).
const ELEMENT_WAIT: Duration = Duration::from_secs(15);

/// A browser session, closed (and its driver killed) when dropped.
#[derive(Debug)]
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    profile: PathBuf,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        // Killing the driver leaves its Chromium running (and its helpers): they are the
        // processes that name this session's profile directory.
        kill_processes_naming(&self.profile.to_string_lossy());
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// SIGKILLs every process whose command line contains `needle`.
fn kill_processes_naming(needle: &str) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
}

impl Browser {
    /// Starts `chromedriver` and a headless Chromium session with a fresh profile, with the
    /// flags this machine's closed network needs (no background connections).
    pub async fn start() -> Self {
        for path in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                std::path::Path::new(path).exists(),
                "{path} is missing: install Debian's chromium and chromium-driver (deploy/local/install.sh does)"
            );
        }
        let port = free_port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let profile = std::env::temp_dir().join(unique("tally-chromium"));
        let mut browser = Self {
            driver,
            port,
            session: String::new(),
            profile,
        };
        eventually(Duration::from_secs(20), "chromedriver ready", || async {
            let status = browser.send("GET", "/status", None).await.ok()?;
            status["ready"].as_bool().filter(|ready| *ready).map(|_| ())
        })
        .await;
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1280,860",
            &format!("--user-data-dir={}", browser.profile.display()),
        ];
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": args},
        }}});
        let session = browser
            .send("POST", "/session", Some(capabilities))
            .await
            .expect("a browser session");
        browser.session = session["sessionId"]
            .as_str()
            .expect("a session id")
            .to_owned();
        browser
            .command(
                "POST",
                "/timeouts",
                json!({"implicit": ELEMENT_WAIT.as_millis() as u64}),
            )
            .await;
        browser
    }

    /// One WebDriver request: its `value`, or the driver's error.
    async fn send(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let body = body.map(|b| b.to_string());
        let answer = http_call(
            self.port,
            method,
            path,
            &[("content-type", "application/json")],
            body.as_deref(),
        )
        .await
        .ok_or_else(|| "chromedriver did not answer".to_owned())?;
        let value: Value =
            serde_json::from_str(&answer.body).map_err(|e| format!("{e}: {}", answer.body))?;
        if answer.status != 200 {
            return Err(format!(
                "{method} {path}: {}: {}",
                answer.status, value["value"]
            ));
        }
        Ok(value["value"].clone())
    }

    /// A command in this session; panics with the driver's error.
    async fn command(&self, method: &str, path: &str, body: Value) -> Value {
        let path = format!("/session/{}{path}", self.session);
        let body = (method == "POST").then_some(body);
        self.send(method, &path, body)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Opens `url` and waits for it to load.
    pub async fn open(&self, url: &str) {
        self.command("POST", "/url", json!({"url": url})).await;
    }

    /// The element matching the CSS `selector`, waiting up to [`ELEMENT_WAIT`] for it.
    async fn element(&self, selector: &str) -> String {
        let found = self
            .command(
                "POST",
                "/element",
                json!({"using": "css selector", "value": selector}),
            )
            .await;
        // The W3C reference is an object of one entry, whose key is the spec's fixed name.
        (found.as_object().and_then(|o| o.values().next()))
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no element reference for {selector}: {found}"))
            .to_owned()
    }

    /// Types `text` into the element matching `selector`, as keystrokes.
    pub async fn type_into(&self, selector: &str, text: &str) {
        let element = self.element(selector).await;
        self.command(
            "POST",
            &format!("/element/{element}/value"),
            json!({"text": text}),
        )
        .await;
    }

    /// Empties the input matching `selector`.
    pub async fn clear(&self, selector: &str) {
        let element = self.element(selector).await;
        self.command("POST", &format!("/element/{element}/clear"), json!({}))
            .await;
    }

    /// Clicks the element matching `selector`.
    pub async fn click(&self, selector: &str) {
        let element = self.element(selector).await;
        self.command("POST", &format!("/element/{element}/click"), json!({}))
            .await;
    }

    /// The rendered text of the element matching `selector` (waiting for it to exist).
    pub async fn text(&self, selector: &str) -> String {
        let element = self.element(selector).await;
        self.command("GET", &format!("/element/{element}/text"), Value::Null)
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Runs `script` (a function body) in the page and returns what it returns.
    pub async fn script(&self, script: &str) -> Value {
        self.command(
            "POST",
            "/execute/sync",
            json!({"script": script, "args": []}),
        )
        .await
    }

    /// The page's visible text.
    pub async fn page_text(&self) -> String {
        self.text("body").await
    }

    /// A PNG of the window.
    pub async fn screenshot(&self) -> Vec<u8> {
        let encoded = self.command("GET", "/screenshot", Value::Null).await;
        base64_decode(encoded.as_str().expect("base64 text")).expect("valid base64")
    }
}

/// Decodes standard base64 (with padding), as WebDriver sends screenshots.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let bytes: Vec<u8> = text.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    for chunk in bytes.chunks(4) {
        let pad = chunk.iter().rev().take_while(|c| **c == b'=').count();
        let mut n = 0_u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= if c == b'=' { 0 } else { value(c)? } << (18 - 6 * i);
        }
        let decoded = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&decoded[..3 - pad.min(2)]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_decodes_with_and_without_padding() {
        assert_eq!(
            super::base64_decode("aGVsbG8=").as_deref(),
            Some(&b"hello"[..])
        );
        assert_eq!(super::base64_decode("aGk=").as_deref(), Some(&b"hi"[..]));
        assert_eq!(super::base64_decode("aGV5").as_deref(), Some(&b"hey"[..]));
        assert_eq!(super::base64_decode("a?=="), None);
    }
}
