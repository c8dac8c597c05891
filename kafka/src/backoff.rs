//! Capped exponential backoff with jitter: the one every retry in tally uses (Redis and
//! PostgreSQL writes, Kafka connections and metadata, compaction passes). It lives in this
//! ground crate so that the Kafka client's own retries use it too.

use std::time::Duration;

/// Delays that double from `initial` up to `max`, each drawn uniformly from its upper half so
/// that many retrying flushes do not hit a recovering server in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    /// The first delay's upper bound, and where [`Backoff::reset`] goes back to.
    initial: Duration,
    /// The next delay's upper bound.
    next: Duration,
    /// The cap.
    max: Duration,
}

impl Backoff {
    /// A backoff starting at `initial` and capped at `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial: initial.min(max),
            next: initial.min(max),
            max,
        }
    }

    /// Back to the first delay, after a success.
    pub fn reset(&mut self) {
        self.next = self.initial;
    }

    /// Sleeps for the next delay.
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }

    /// The delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let upper = self.next;
        self.next = (self.next * 2).min(self.max);
        let half = upper / 2;
        half + half.mul_f64(rand::random::<f64>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_with_jitter_in_the_upper_half() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(1000));
        let bounds = [100, 200, 400, 800, 1000, 1000];
        for upper in bounds {
            let d = b.next_delay();
            let upper = Duration::from_millis(upper);
            assert!(
                d >= upper / 2 && d <= upper,
                "{d:?} not in [{:?}, {upper:?}]",
                upper / 2
            );
        }
        b.reset();
        let d = b.next_delay();
        assert!(d >= Duration::from_millis(50) && d <= Duration::from_millis(100));
    }
}
