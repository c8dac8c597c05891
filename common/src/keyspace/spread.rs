//! Where a partition's stretches of log were placed ([`Fan`], [`Spread`]) and its watermark
//! ([`Watermark`]): what an exactly-once owner records in its home group.

/// Most shard groups allowed: a read sums one key per group.
pub const MAX_GROUPS: u32 = 1024;
/// How one stretch of a partition's log is placed: its counters spread over `k` groups out of
/// `groups` (`None`: the deployment's original count, [`crate::Keyspace::groups`]; a re-grouping,
/// [`crate::regroup`], records the count it moved the partition to).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fan {
    /// How many groups the stretch's counters spread over.
    pub k: u32,
    /// Out of how many groups; `None` for the deployment's original count.
    pub groups: Option<u32>,
}

impl Fan {
    /// A spread of `k` over the deployment's original groups.
    pub const fn of(k: u32) -> Self {
        Self { k, groups: None }
    }

    /// A spread of `k` over `groups` groups, recorded as the original count when it is that.
    pub fn over(k: u32, groups: u32, original: u32) -> Self {
        Self {
            k: k.min(groups),
            groups: (groups != original).then_some(groups),
        }
    }

    /// The number of groups, given the deployment's original count.
    pub fn groups_of(&self, original: u32) -> u32 {
        self.groups.unwrap_or(original)
    }
}

/// How many groups one partition's counters are spread over, offset by offset.
///
/// Grouped by partition, the message at offset `o` of partition `p` adds counter `c` into group
/// `(home(p) + (hash(c) mod k) * (N div k)) mod N`, where `k` and `N` are [`Spread::fan_at`]`(o)`:
/// a catch-up flush of 15,000 counters is then `k` scripts of about 15,000/`k` each, so that no
/// single script holds Redis for long, while each counter of a partition still lives in one
/// group. The stride `N div k` keeps the groups that partitions share few: with 8 partitions, 16
/// groups and a spread of 4, every group takes the counters of two partitions.
///
/// The exactly-once skip rule (a message below a group's ledger entry is not applied there again)
/// needs every replay of a message to place it in the group its first attempt did. So a
/// partition's spread (and its group count, after a re-grouping) only changes at an offset that
/// no group has applied yet (the highest ledger entry when a new owner takes the partition), and
/// the partition remembers, in its watermark, the fan of every stretch of its log: legacy
/// watermarks, without one, were written at a spread of 1 over the original groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spread {
    /// `(until, fan)`, in offset order: offsets below `until`, and at or above the step before,
    /// were placed so.
    steps: Vec<(i64, Fan)>,
    /// The fan of every offset after the last step.
    then: Fan,
}

impl Spread {
    /// The same spread at every offset, over the original groups.
    pub const fn uniform(k: u32) -> Self {
        Self::fixed(Fan::of(k))
    }

    /// The same fan at every offset.
    pub const fn fixed(fan: Fan) -> Self {
        Self {
            steps: Vec::new(),
            then: fan,
        }
    }

    /// The spread of the message at `offset`.
    pub fn at(&self, offset: i64) -> u32 {
        self.fan_at(offset).k
    }

    /// How the message at `offset` is placed.
    pub fn fan_at(&self, offset: i64) -> Fan {
        (self.steps.iter())
            .find(|(until, _)| offset < *until)
            .map_or(self.then, |(_, fan)| *fan)
    }

    /// The spread of offsets from here on.
    pub fn current(&self) -> u32 {
        self.then.k
    }

    /// How offsets from here on are placed.
    pub fn current_fan(&self) -> Fan {
        self.then
    }

    /// The offset from which no message is placed in more than `groups` groups (0 if none ever
    /// was), or `None` if messages from here on are; `original` is the deployment's original
    /// count. A re-grouping that retires groups waits for every partition's watermark to pass it.
    pub fn within_from(&self, groups: u32, original: u32) -> Option<i64> {
        if self.then.groups_of(original) > groups {
            return None;
        }
        Some(
            (self.steps.iter())
                .filter(|(_, fan)| fan.groups_of(original) > groups)
                .map(|(until, _)| *until)
                .max()
                .unwrap_or(0),
        )
    }

    /// This spread up to `from`, then `k` over the original groups.
    #[must_use]
    pub fn then(&self, k: u32, from: i64) -> Self {
        self.then_fan(Fan::of(k), from)
    }

    /// This spread up to `from`, then `fan`: what a new owner uses when no group has applied
    /// anything at or after `from`.
    #[must_use]
    pub fn then_fan(&self, fan: Fan, from: i64) -> Self {
        let mut steps: Vec<(i64, Fan)> = Vec::with_capacity(self.steps.len() + 1);
        let mut covered = 0;
        for &(until, placed) in &self.steps {
            if covered >= from {
                break;
            }
            steps.push((until.min(from), placed));
            covered = until;
        }
        if covered < from {
            steps.push((from, self.then));
        }
        // One step per stretch, and none that repeats what follows.
        steps.dedup_by(|later, earlier| {
            let same = later.1 == earlier.1;
            if same {
                earlier.0 = later.0;
            }
            same
        });
        while steps.last().is_some_and(|(_, placed)| *placed == fan) {
            steps.pop();
        }
        Self { steps, then: fan }
    }
}

/// A partition's watermark: everything before `next_offset` is applied in every group, these
/// were the groups' ledger entries when it was stored, and this is its [`Spread`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watermark {
    /// The offset to resume from; negative when no flush has landed everywhere yet (a new owner
    /// stores its spread before its first write).
    pub next_offset: i64,
    /// `(group, ledger entry)` for every group that had one.
    pub ledgers: Vec<(u32, i64)>,
    /// How the partition's counters spread over groups along its log.
    pub spread: Spread,
}

impl Watermark {
    /// The watermark after a flush up to `next_offset`, given the ledgers after it.
    pub fn new(next_offset: i64, ledgers: &[i64], spread: Spread) -> Self {
        Self {
            next_offset,
            ledgers: ledgers
                .iter()
                .enumerate()
                .filter(|(_, l)| **l >= 0)
                .map(|(g, l)| (g as u32, *l))
                .collect(),
            spread,
        }
    }

    /// Its stored form: `<next_offset>;<group>=<ledger>;...`, then the spread's steps as
    /// `;s=<k>@<until>` and its current value as `;s=<k>` (left out when it is a uniform 1, so
    /// that such a watermark reads as it did before spreads existed); a fan over other than the
    /// original groups is `<k>/<groups>`.
    pub fn encode(&self) -> String {
        use std::fmt::Write as _;
        let mut out = self.next_offset.to_string();
        for (group, ledger) in &self.ledgers {
            let _ = write!(out, ";{group}={ledger}");
        }
        let fan = |out: &mut String, fan: &Fan| {
            let _ = write!(out, ";s={}", fan.k);
            if let Some(groups) = fan.groups {
                let _ = write!(out, "/{groups}");
            }
        };
        for (until, placed) in &self.spread.steps {
            fan(&mut out, placed);
            let _ = write!(out, "@{until}");
        }
        if self.spread != Spread::uniform(1) {
            fan(&mut out, &self.spread.then);
        }
        out
    }

    /// Parses the stored form; `None` if it is not one (steps out of offset order included).
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split(';');
        let next_offset = parts.next()?.parse().ok()?;
        let mut ledgers = Vec::new();
        let mut spread = Spread::uniform(1);
        let mut ended = false;
        for part in parts {
            let (name, value) = part.split_once('=')?;
            if name != "s" {
                ledgers.push((name.parse().ok()?, value.parse().ok()?));
                continue;
            }
            if ended {
                return None;
            }
            match value.split_once('@') {
                Some((k, until)) => {
                    let until: i64 = until.parse().ok()?;
                    // Steps in offset order, or `at` would place messages in the wrong groups.
                    if spread
                        .steps
                        .last()
                        .is_some_and(|(before, _)| *before >= until)
                    {
                        return None;
                    }
                    spread.steps.push((until, fan(k)?));
                }
                None => {
                    spread.then = fan(value)?;
                    ended = true;
                }
            }
        }
        if !spread.steps.is_empty() && !ended {
            return None;
        }
        Some(Self {
            next_offset,
            ledgers,
            spread,
        })
    }
}

fn positive(text: &str) -> Option<u32> {
    text.parse().ok().filter(|k| *k > 0)
}

/// A stored fan: `<k>` or `<k>/<groups>`.
fn fan(text: &str) -> Option<Fan> {
    Some(match text.split_once('/') {
        None => Fan::of(positive(text)?),
        Some((k, groups)) => Fan {
            k: positive(k)?,
            groups: Some(positive(groups).filter(|g| *g <= MAX_GROUPS)?),
        },
    })
}
