//! Packed shares (`crate::regroup::GroupPlan::buckets`): where a deployment packs counters'
//! shares as fields of small hashes, a counter's share in a group is its key's value plus its
//! field in the group's hash of its bucket, read in the same pipeline as the keys.

use super::{ReadError, Snapshot, parse_integer, value_as};
use crate::keyspace::Keyspace;

/// The reads of `counters`' packed shares: per group of `0..groups` and bucket holding any of
/// them, one `HMGET` of their fields.
pub(super) struct PackedReads {
    /// The commands, in the order their replies come back.
    pub(super) commands: Vec<redis::Cmd>,
    /// Per command, the indexes of the counters whose fields it reads, in its fields' order.
    of: Vec<Vec<usize>>,
}

impl PackedReads {
    /// Nothing to read where `buckets` is 0 (no packed shares).
    pub(super) fn new<S: AsRef<str>>(
        keyspace: &Keyspace,
        counters: &[S],
        groups: u32,
        buckets: u32,
    ) -> Self {
        let mut reads = Self {
            commands: Vec::new(),
            of: Vec::new(),
        };
        if buckets == 0 {
            return reads;
        }
        let mut by_bucket: Vec<(u32, usize)> = (counters.iter().enumerate())
            .map(|(i, c)| (Keyspace::bucket_of(c.as_ref(), buckets), i))
            .collect();
        by_bucket.sort_unstable();
        let runs: Vec<&[(u32, usize)]> = by_bucket.chunk_by(|a, b| a.0 == b.0).collect();
        for group in 0..groups {
            for run in &runs {
                let mut hmget = redis::cmd("HMGET");
                hmget.arg(keyspace.packed_key(group, run[0].0));
                for &(_, i) in *run {
                    hmget.arg(counters[i].as_ref());
                }
                reads.commands.push(hmget);
                reads.of.push(run.iter().map(|&(_, i)| i).collect());
            }
        }
        reads
    }

    /// How many replies the commands take.
    pub(super) fn len(&self) -> usize {
        self.commands.len()
    }

    /// Adds the fields found in `replies` (the commands' replies, in order) to the totals.
    pub(super) fn add<S: AsRef<str>>(
        &self,
        counters: &[S],
        replies: Vec<redis::Value>,
        snapshot: &mut Snapshot,
    ) -> Result<(), ReadError> {
        for (of, reply) in self.of.iter().zip(replies) {
            let fields: Vec<Option<String>> = value_as(reply)?;
            for (&i, field) in of.iter().zip(fields) {
                if let Some(value) = field {
                    let share = parse_integer(counters[i].as_ref(), &value)?;
                    snapshot.add(counters, i, share)?;
                }
            }
        }
        Ok(())
    }
}
