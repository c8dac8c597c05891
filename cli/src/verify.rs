//! Checking Redis against known totals: `tally verify`, the demo and the end-to-end tests wait
//! here until every counter reads exactly what was sent.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tally_common::Reader;

/// Counters that did not match before the deadline.
#[derive(Debug, thiserror::Error)]
#[error("{} of {checked} counters differ after {waited:?}, e.g. {}", .wrong.len(), .wrong.iter().take(5).cloned().collect::<Vec<_>>().join("; "))]
pub struct Mismatch {
    /// How many counters were checked.
    pub checked: usize,
    /// How long it waited.
    pub waited: Duration,
    /// One line per wrong counter (or failed read).
    pub wrong: Vec<String>,
}

/// Reads every counter of `expected` (in pipelines of 2,000) and lists those that differ.
pub async fn differences(reader: &Reader, expected: &HashMap<String, i64>) -> Vec<String> {
    let counters: Vec<&String> = expected.keys().collect();
    let mut wrong = Vec::new();
    for chunk in counters.chunks(2000) {
        match reader.get_many(chunk).await {
            Ok(values) => {
                for (counter, got) in chunk.iter().zip(values) {
                    let want = expected[*counter];
                    if got != want {
                        wrong.push(format!("{counter}: redis has {got}, sent {want}"));
                    }
                }
            }
            Err(e) => wrong.push(format!("read failed: {e}")),
        }
    }
    wrong
}

/// Waits (polling every 100 ms) until every counter in `expected` reads exactly its total;
/// returns how long that took, or the differences left at `timeout`.
pub async fn wait_for_totals(
    reader: &Reader,
    expected: &HashMap<String, i64>,
    timeout: Duration,
) -> Result<Duration, Mismatch> {
    let started = Instant::now();
    loop {
        let wrong = differences(reader, expected).await;
        if wrong.is_empty() {
            return Ok(started.elapsed());
        }
        if started.elapsed() >= timeout {
            return Err(Mismatch {
                checked: expected.len(),
                waited: started.elapsed(),
                wrong,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Parses `<counter> <total>` lines (as written by `tally load --totals-out`).
pub fn parse_totals(text: &str) -> Result<HashMap<String, i64>, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, line)| {
            let (counter, total) = line
                .rsplit_once(' ')
                .ok_or_else(|| format!("line {}: expected `<counter> <total>`", i + 1))?;
            let total = total
                .trim()
                .parse::<i64>()
                .map_err(|e| format!("line {}: {e}", i + 1))?;
            Ok((counter.to_owned(), total))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_totals_files_and_reports_bad_lines() {
        let t = parse_totals("likes:post:1 5\nlikes:post:2 -3\n\n").expect("valid");
        assert_eq!(t.len(), 2);
        assert_eq!(t["likes:post:2"], -3);
        assert!(parse_totals("nospace").is_err());
        assert!(parse_totals("a b").is_err());
    }
}
