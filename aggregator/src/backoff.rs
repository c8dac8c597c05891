//! Capped exponential backoff with jitter, for retrying Redis and Kafka writes.

use std::time::Duration;

/// Delays that double from `initial` up to `max`, each drawn uniformly from its upper half so
/// that many retrying flushes do not hit a recovering server in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    /// The next delay's upper bound.
    next: Duration,
    /// The cap.
    max: Duration,
}

impl Backoff {
    /// A backoff starting at `initial` and capped at `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            next: initial.min(max),
            max,
        }
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
    }
}
