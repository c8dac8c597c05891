//! Windowed reads: sums over a counter's time buckets, read from the cells hashes
//! (`crate::window::cells`) of every shard group.

use crate::connection::query_each;
use crate::event::validate_counter;
use crate::window::Window;
use crate::window::cells::Cells;

use super::{ReadError, Reader, sum};

impl Reader {
    /// The sums of `counters` over the last `buckets` buckets of `window` at `now_ms` (the
    /// bucket holding `now_ms` and the `buckets - 1` before it), in the same order: one `MGET`
    /// per shard group. A bucket never written, or expired, counts 0.
    pub async fn window_sums<S: AsRef<str>>(
        &self,
        counters: &[S],
        window: Window,
        buckets: i64,
        now_ms: i64,
    ) -> Result<Vec<i64>, ReadError> {
        for counter in counters {
            validate_counter(counter.as_ref())?;
        }
        if counters.is_empty() || buckets <= 0 {
            return Ok(vec![0; counters.len()]);
        }
        if self.store.is_some() {
            return Err(ReadError::Window {
                counter: counters[0].as_ref().to_owned(),
                why: "windowed counts are kept in Redis only, not with --store postgres".to_owned(),
            });
        }
        let current = window.start_of(now_ms);
        let first = current - (buckets - 1) * window.width_ms;
        let names: Vec<&str> = counters.iter().map(AsRef::as_ref).collect();
        let cells = self.cells(&names).await?;
        (names.iter().zip(cells))
            .map(|(counter, groups)| {
                (groups.iter())
                    .try_fold(0i64, |acc, c| {
                        acc.checked_add(c.sum(window.width_ms, first, current)?)
                    })
                    .ok_or_else(|| ReadError::Overflow {
                        counter: (*counter).to_owned(),
                    })
            })
            .collect()
    }
}

impl Reader {
    /// The values of single buckets, each `(counter, width_ms, start_ms)` summed over the shard
    /// groups (0 where never written or expired), in the same order.
    pub async fn bucket_values(&self, cells: &[(&str, i64, i64)]) -> Result<Vec<i64>, ReadError> {
        let mut names: Vec<&str> = cells.iter().map(|(counter, _, _)| *counter).collect();
        names.sort_unstable();
        names.dedup();
        let read = self.cells(&names).await?;
        (cells.iter())
            .map(|(counter, width, start)| {
                let at = names.binary_search(counter).unwrap_or_default();
                let values: Vec<Option<i64>> = read[at]
                    .iter()
                    .map(|c| Some(c.get(*width, *start)))
                    .collect();
                sum(counter, &values)
            })
            .collect()
    }

    /// How many cells hashes each group keeps: the deployment's record, or
    /// [`crate::window::cells::LEGACY_STRIPES`] while it records none (`crate::layout`).
    async fn stripes(&self) -> Result<u64, ReadError> {
        if let Some(stripes) = self.cells_stripes.get() {
            return Ok(*stripes);
        }
        match crate::layout::recorded_cells_stripes(&self.conn, &self.keyspace).await {
            Ok(Some(stripes)) => Ok(*self.cells_stripes.get_or_init(|| stripes)),
            Ok(None) => Ok(crate::window::cells::LEGACY_STRIPES),
            Err(crate::layout::LayoutError::Redis(e)) => Err(e.into()),
            Err(e) => Err(ReadError::Layout(e.to_string())),
        }
    }

    /// Each counter's cells (`crate::window::cells`) in every shard group, in the same order:
    /// one `HMGET` per cells hash holding any of them, all sent at once.
    async fn cells(&self, counters: &[&str]) -> Result<Vec<Vec<Cells>>, ReadError> {
        if counters.is_empty() {
            return Ok(Vec::new());
        }
        let ks = &self
            .keyspace
            .clone()
            .with_cells_stripes(self.stripes().await?);
        let groups = self.cell_groups().await?;
        let stripes: Vec<u64> = counters.iter().map(|c| ks.cells_stripe(c)).collect();
        let mut hashes: Vec<(String, Vec<&str>)> = Vec::new();
        // Per group, then per counter: its hash and field, as indexes into `hashes`.
        let mut at: Vec<(usize, usize)> = Vec::with_capacity(counters.len() * groups as usize);
        // Per stripe, its hash's index in `hashes` in the group at hand (usize::MAX: none yet).
        let mut seen = vec![usize::MAX; ks.cells_stripes() as usize];
        for group in 0..groups {
            seen.fill(usize::MAX);
            for (counter, stripe) in counters.iter().zip(&stripes) {
                let h = &mut seen[*stripe as usize];
                if *h == usize::MAX {
                    hashes.push((ks.cells_key_of_stripe(group, *stripe), Vec::new()));
                    *h = hashes.len() - 1;
                }
                hashes[*h].1.push(counter);
                at.push((*h, hashes[*h].1.len() - 1));
            }
        }
        let commands = (hashes.iter())
            .map(|(key, fields)| {
                let mut hmget = redis::cmd("HMGET");
                hmget.arg(key).arg(fields);
                hmget
            })
            .collect();
        let rows: Vec<Vec<Option<String>>> = query_each(&self.conn, commands).await?;
        let mut out: Vec<Vec<Cells>> = vec![Vec::with_capacity(groups as usize); counters.len()];
        for (n, (h, f)) in at.into_iter().enumerate() {
            let i = n % counters.len();
            let cells = match rows
                .get(h)
                .and_then(|row| row.get(f))
                .and_then(Option::as_deref)
            {
                None => Cells::default(),
                Some(value) => Cells::parse(value).ok_or_else(|| ReadError::Corrupt {
                    counter: counters[i].to_owned(),
                    value: value.to_owned(),
                })?,
            };
            out[i].push(cells);
        }
        Ok(out)
    }
}
