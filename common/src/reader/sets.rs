//! Count sets (`crate::layout`): where likes are counted by their sets, a counter's total adds
//! the size of its count set, read with its shares.

use super::{ReadError, Reader};

impl Reader {
    /// Whether reads add count sets' sizes (`crate::layout`): if this reader may run `SCARD`
    /// (asked once), always; if it may not, only where the deployment records that likes are
    /// counted in the shares, and otherwise the read fails and says which permission is missing
    /// (a read without the sets' sizes would miss every like counted by them).
    pub(super) async fn count_sets(&self) -> Result<bool, ReadError> {
        use std::sync::atomic::Ordering;
        match self.count_sets.load(Ordering::Relaxed) {
            SETS_COUNTED => return Ok(true),
            SETS_NONE => return Ok(false),
            _ => {}
        }
        let ks = &self.keyspace;
        let probe: redis::RedisResult<i64> = redis::cmd("SCARD")
            .arg(ks.count_set_key(0, "-"))
            .query_async(&mut self.conn.clone())
            .await;
        match probe {
            Ok(_) => {
                self.count_sets.store(SETS_COUNTED, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm) => {
                match crate::layout::recorded_likes_count(&self.conn, ks).await {
                    Ok(Some(crate::layout::LikesCount::Shares)) => {
                        self.count_sets.store(SETS_NONE, Ordering::Relaxed);
                        Ok(false)
                    }
                    _ => Err(ReadError::Layout(format!(
                        "this reader's Redis user may not run SCARD, which reads the likes this \
                         deployment counts by their sets ({} field likes): grant it +scard",
                        ks.layout_key()
                    ))),
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The `SCARD` of each of `counters`' count sets ([`Keyspace::count_set_key`], in its
    /// counter's group): where likes are counted by their sets, part of its total; 0 for a
    /// counter without one.
    pub(super) fn set_sizes<S: AsRef<str>>(&self, counters: &[S]) -> Vec<redis::Cmd> {
        let ks = &self.keyspace;
        (counters.iter())
            .map(|c| {
                let counter = c.as_ref();
                let mut scard = redis::cmd("SCARD");
                scard.arg(ks.count_set_key(ks.group_for_counter(counter), counter));
                scard
            })
            .collect()
    }
}

/// Not yet known whether reads add count sets' sizes.
pub(super) const SETS_UNKNOWN: u8 = 0;
/// They do.
pub(super) const SETS_COUNTED: u8 = 1;
/// They do not: this reader may not run `SCARD`, and the deployment counts likes in shares.
pub(super) const SETS_NONE: u8 = 2;
