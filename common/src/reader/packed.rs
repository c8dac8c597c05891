//! Packed shares (`crate::regroup::GroupPlan::buckets`): where a deployment packs counters'
//! shares as fields of small hashes, a counter's share in a group is its key's value plus its
//! field in the group's hash of its bucket, read in the same pipeline as the keys.

use super::{ReadError, Reader, Snapshot, parse_integer, value_as};
use crate::connection::query_each;
use crate::keyspace::Keyspace;

/// The reads of `counters`' packed shares: per group of `0..groups` and bucket holding any of
/// them, one `HMGET` of their fields.
pub(super) struct PackedReads {
    /// The commands, in the order their replies come back.
    pub(super) commands: Vec<redis::Cmd>,
    /// Per command, the indexes of the counters whose fields it reads, in its fields' order.
    of: Vec<Vec<usize>>,
    /// Commands per group: the commands are group after group, in order.
    per_group: usize,
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
            per_group: 0,
        };
        if buckets == 0 {
            return reads;
        }
        let mut by_bucket: Vec<(u32, usize)> = (counters.iter().enumerate())
            .map(|(i, c)| (Keyspace::bucket_of(c.as_ref(), buckets), i))
            .collect();
        by_bucket.sort_unstable();
        let runs: Vec<&[(u32, usize)]> = by_bucket.chunk_by(|a, b| a.0 == b.0).collect();
        reads.per_group = runs.len();
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

    /// Whether there is anything to read.
    pub(super) fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }

    /// The commands reading group `group`'s fields.
    pub(super) fn of_group(&self, group: u32) -> &[redis::Cmd] {
        let first = group as usize * self.per_group;
        &self.commands[first..first + self.per_group]
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

impl Reader {
    /// On a cluster where shares are packed, each group's `MGET` and `HMGET`s as one
    /// `MULTI`/`EXEC` in its slot (so that a key moved into its field, `tally pack`, is read in
    /// one form or the other, never both or neither), the groups at once, and the count sets'
    /// sizes beside: the `MGET`s' and sizes' replies, and the fields'.
    pub(super) async fn read_groups_whole<S: AsRef<str>>(
        &self,
        counters: &[S],
        groups: u32,
        packed: &PackedReads,
        sets: bool,
    ) -> Result<(Vec<redis::Value>, Vec<redis::Value>), ReadError> {
        let requests: Vec<_> = (0..groups)
            .map(|group| {
                let mut pipe = redis::pipe();
                pipe.atomic().add_command(self.group_mget(counters, group));
                for hmget in packed.of_group(group) {
                    pipe.add_command(hmget.clone());
                }
                let mut conn = self.conn.clone();
                tokio::spawn(async move { pipe.query_async::<Vec<redis::Value>>(&mut conn).await })
            })
            .collect();
        let sizes: Vec<redis::Value> = match sets {
            true => query_each(&self.conn, self.set_sizes(counters)).await?,
            false => Vec::new(),
        };
        let (mut keys, mut fields) = (Vec::new(), Vec::new());
        for request in requests {
            let cancelled = || redis::RedisError::from((redis::ErrorKind::Io, "read cancelled"));
            let mut replies = request.await.map_err(|_| cancelled())??.into_iter();
            keys.push(replies.next().unwrap_or(redis::Value::Nil));
            fields.extend(replies);
        }
        keys.extend(sizes);
        Ok((keys, fields))
    }
}
