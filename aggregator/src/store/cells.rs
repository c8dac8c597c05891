//! A group's window deltas as rewrites of its counters' cells (`tally_common::window::cells`):
//! which hashes and fields a write reads ([`Reads`]), and what it writes there once it has read
//! them ([`plan`]). The writer computes the new values; the write lands only if every field
//! still holds what was read (`scripts/flush.lua`, `scripts/cells.lua`, or a `WATCH` in the
//! transactions path), else it reads again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use redis::Value;
use tally_common::Keyspace;
use tally_common::window::cells::Cells;
use tally_kafka::backoff::Backoff;

use crate::machine::batch::WindowDelta;
use crate::machine::verdict::Current;
use crate::store::script_call::ScriptCall;

type Hasher = foldhash::fast::RandomState;

/// The cells hashes and fields one group's window deltas touch.
#[derive(Debug, Clone, Default)]
pub struct Reads {
    /// Per hash: its key and the fields (counters) to read, each once.
    pub stripes: Vec<(String, Vec<Arc<str>>)>,
    /// Per window delta: its hash and field, as indexes into `stripes`.
    at: Vec<(usize, usize)>,
}

impl Reads {
    /// The fields `windows` (one group's) touch.
    pub fn new(keyspace: &Keyspace, group: u32, windows: &[WindowDelta]) -> Self {
        let mut reads = Self::default();
        if windows.is_empty() {
            return reads;
        }
        // Per stripe number, its index in `reads.stripes`.
        let mut stripes = vec![usize::MAX; keyspace.cells_stripes() as usize];
        let mut fields: HashMap<(usize, &str), usize, Hasher> = HashMap::default();
        for (i, w) in windows.iter().enumerate() {
            // A counter's deltas come one after another (a batch seals them so): one lookup each.
            if i > 0 && windows[i - 1].counter == w.counter {
                reads.at.push(reads.at[i - 1]);
                continue;
            }
            let stripe = keyspace.cells_stripe(&w.counter);
            let s = &mut stripes[stripe as usize];
            if *s == usize::MAX {
                let key = keyspace.cells_key_of_stripe(group, stripe);
                reads.stripes.push((key, Vec::new()));
                *s = reads.stripes.len() - 1;
            }
            let s = *s;
            let f = *fields.entry((s, &*w.counter)).or_insert_with(|| {
                reads.stripes[s].1.push(Arc::clone(&w.counter));
                reads.stripes[s].1.len() - 1
            });
            reads.at.push((s, f));
        }
        reads
    }

    /// Whether there is nothing to read.
    pub fn is_empty(&self) -> bool {
        self.stripes.is_empty()
    }

    /// One `HMGET` per hash, in order.
    pub fn add_to(&self, pipe: &mut redis::Pipeline) {
        for (key, fields) in &self.stripes {
            let hmget = pipe.cmd("HMGET").arg(key);
            for field in fields {
                hmget.arg(&**field);
            }
        }
    }
}

/// A field value, shared by what a write read, what it writes and what its writer remembers
/// (`crate::store::recall`), so that none of them copies it.
pub type FieldValue = Arc<str>;

/// What one hash's `HMGET` gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    /// Per field, its value.
    Fields(Vec<Option<FieldValue>>),
    /// The key holds another type.
    WrongType,
}

impl Read {
    /// The reply to one `HMGET` (read with errors kept); an error other than `WRONGTYPE`, or
    /// a reply of another shape, is `Err`.
    pub fn from_reply(value: Value) -> Result<Self, redis::RedisError> {
        match value {
            Value::Array(items) => items
                .into_iter()
                .map(|item| match item {
                    Value::Nil => Ok(None),
                    // Not UTF-8 is not cells either: kept readable, never written.
                    Value::BulkString(bytes) => Ok(Some(FieldValue::from(
                        String::from_utf8_lossy(&bytes).as_ref(),
                    ))),
                    other => Err(unexpected(&other)),
                })
                .collect::<Result<_, _>>()
                .map(Read::Fields),
            Value::ServerError(e) if e.code() == "WRONGTYPE" => Ok(Read::WrongType),
            Value::ServerError(e) => Err(redis::RedisError::from(e)),
            other => Err(unexpected(&other)),
        }
    }
}

fn unexpected(value: &Value) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "HMGET reply",
        format!("{value:?}"),
    ))
}

/// One field's rewrite.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldWrite {
    /// The field: the counter (shared with the reads and the window deltas).
    pub field: Arc<str>,
    /// What it held when read (`None`: nothing).
    pub read: Option<FieldValue>,
    /// What to write (`None`: delete the field).
    pub value: Option<FieldValue>,
}

/// The rewrites of one hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StripeWrite {
    /// The hash.
    pub key: String,
    /// When the last bucket written into it expires (`None`: leave its expiry).
    pub expire_at_ms: Option<i64>,
    /// The fields that change.
    pub fields: Vec<FieldWrite>,
}

impl StripeWrite {
    /// Adds this hash's rewrite to a script built on `scripts/cells_lib.lua`: its key, then its
    /// expiry (`''` to leave it), its field count and, per field, the field, the value read and
    /// the value to write (`''` for none).
    pub fn add_to(&self, invocation: &mut ScriptCall<'_>) {
        invocation
            .key(&self.key)
            .arg(self.expire_at_ms.map(|t| t.to_string()).unwrap_or_default())
            .arg(self.fields.len());
        for f in &self.fields {
            invocation
                .arg(&*f.field)
                .arg(f.read.as_deref().unwrap_or(""))
                .arg(f.value.as_deref().unwrap_or(""));
        }
    }
}

/// How many times a rewrite reads the cells again after another writer changed them before it
/// gives up (a flush's own retry then backs off).
pub const MAX_STALE_READS: usize = 32;

/// Starting over after another writer changed what a write read (cells fields, or the keys a
/// transaction `WATCH`es): a bounded number of times, each after a jittered wait, so that two
/// writers racing for one field do not keep meeting (from up to 1 ms to up to 20 ms). A write
/// planned from what its writer remembers (`crate::store::recall`) and found stale starts over
/// at once, reading, and never goes by memory again.
#[derive(Debug)]
pub struct Rereads {
    backoff: Backoff,
    /// Attempts left after the current one.
    left: usize,
    /// Whether the next attempt may go by what the writer remembers instead of reading.
    may_predict: bool,
}

impl Rereads {
    /// At most `attempts` attempts in all, besides one that went by memory.
    pub fn new(attempts: usize) -> Self {
        Self {
            backoff: Backoff::new(Duration::from_millis(1), Duration::from_millis(20)),
            left: attempts.saturating_sub(1),
            may_predict: true,
        }
    }

    /// Whether this attempt may go by what the writer remembers.
    pub fn may_predict(&self) -> bool {
        self.may_predict
    }

    /// After an attempt that found its reads changed: waits and says to start over, or says
    /// the attempts are used up.
    pub async fn again(&mut self) -> bool {
        if self.left == 0 {
            return false;
        }
        self.left -= 1;
        self.backoff.wait().await;
        true
    }

    /// After an attempt found stale that was `predicted` (planned from memory, not read): starts
    /// over at once, reading from now on; else as [`Rereads::again`].
    pub async fn again_after(&mut self, predicted: bool) -> bool {
        if predicted {
            self.may_predict = false;
            return true;
        }
        self.again().await
    }
}

/// What the window deltas find and write, given what was read (`got`, one per hash of `reads`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Per window delta, what its bucket holds, as far as adding to it is concerned (a field
    /// that is not cells is [`Current::NotAnInteger`], a hash of another type
    /// [`Current::WrongType`]): `crate::machine::verdict` refuses on it as on a counter key.
    pub currents: Vec<Current>,
    /// The rewrites, if nothing is refused; hashes with no change are left out.
    pub writes: Vec<StripeWrite>,
}

/// The plan of `windows` (those `reads` was made from) at `now_ms`: each field gets its deltas
/// and loses the buckets of the windows written that expired by `now_ms`.
pub fn plan(reads: &Reads, got: Vec<Read>, windows: &[WindowDelta], now_ms: i64) -> Plan {
    // Per field: its cells and whether they changed (None: not cells, or the hash is of
    // another type).
    let mut cells: Vec<Vec<Option<(Cells, bool)>>> = (reads.stripes.iter().zip(&got))
        .map(|((_, fields), read)| match read {
            Read::Fields(values) => (values.iter())
                .map(|v| {
                    Some((
                        v.as_deref().map_or(Some(Cells::default()), Cells::parse)?,
                        false,
                    ))
                })
                .chain(std::iter::repeat(None))
                .take(fields.len())
                .collect(),
            Read::WrongType => vec![None; fields.len()],
        })
        .collect();
    let currents = (windows.iter().zip(&reads.at))
        .map(|(w, &(s, f))| match (&got[s], &cells[s][f]) {
            (Read::WrongType, _) => Current::WrongType,
            (_, None) => Current::NotAnInteger,
            (_, Some((c, _))) => match c.get(w.width_ms, w.start_ms) {
                0 => Current::Missing,
                count => Current::Integer(count),
            },
        })
        .collect();
    let mut expire_at = vec![i64::MIN; reads.stripes.len()];
    for (w, &(s, f)) in windows.iter().zip(&reads.at) {
        let Some((c, changed)) = &mut cells[s][f] else {
            continue;
        };
        let retention = w.expire_at_ms - w.start_ms - w.width_ms;
        if w.expire_at_ms <= now_ms {
            // Its bucket has expired (a late event replayed long after): added, it would be
            // dropped at once, so only the buckets the expiry drops change the field.
            *changed |= c.expire(w.width_ms, retention, now_ms);
        } else {
            // An overflow leaves the cells as they were: that delta is refused (`currents`),
            // the field's others still apply (at-least-once writes the rest; exactly-once none).
            if c.add(w.width_ms, w.start_ms, w.delta).is_err() {
                continue;
            }
            // A delta is never 0 (a batch drops those) and its bucket is kept: the field changed.
            *changed = true;
            c.expire(w.width_ms, retention, now_ms);
        }
        expire_at[s] = expire_at[s].max(w.expire_at_ms);
    }
    // Each new value is written here, then copied once into the value the write shares.
    let mut text = String::new();
    let writes = (reads.stripes.iter().zip(got).zip(cells).zip(expire_at))
        .filter_map(|((((key, fields), read), cells), expire_at_ms)| {
            let Read::Fields(values) = read else {
                return None;
            };
            let fields: Vec<FieldWrite> = (fields.iter().zip(values).zip(cells))
                .filter_map(|((field, read), cells)| {
                    // A field that is not cells is never written: its deltas are refused.
                    let (cells, changed) = cells?;
                    changed.then(|| FieldWrite {
                        field: Arc::clone(field),
                        read,
                        value: (!cells.is_empty()).then(|| {
                            text.clear();
                            cells.write_value(&mut text);
                            FieldValue::from(text.as_str())
                        }),
                    })
                })
                .collect();
            (!fields.is_empty()).then(|| StripeWrite {
                key: key.clone(),
                expire_at_ms: Some(expire_at_ms),
                fields,
            })
        })
        .collect();
    Plan { currents, writes }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;
    const HOUR: i64 = 60 * MIN;

    fn delta(counter: &str, width_ms: i64, start_ms: i64, delta: i64) -> WindowDelta {
        WindowDelta {
            counter: counter.into(),
            width_ms,
            start_ms,
            expire_at_ms: start_ms + width_ms + 2 * width_ms,
            delta,
        }
    }

    #[test]
    fn deltas_merge_into_each_counters_field_once_per_hash() {
        let ks = Keyspace::new("t".to_owned(), 4).expect("keyspace");
        let now = 1_000 * HOUR;
        let windows = [
            delta("a:1", MIN, now, 3),
            delta("a:1", HOUR, now, 3),
            delta("b:2", MIN, now, 5),
            delta("a:1", MIN, now - MIN, 1),
        ];
        let reads = Reads::new(&ks, 1, &windows);
        let fields: usize = reads.stripes.iter().map(|(_, f)| f.len()).sum();
        assert_eq!(fields, 2);
        // a:1 holds an old minute (expired at `now`: it ended 3 minutes before) and the last one.
        let old = format!("1m={}:7,{}:2", now / MIN - 1, now / MIN - 4);
        let got: Vec<Read> = (reads.stripes.iter())
            .map(|(_, fields)| {
                Read::Fields(
                    (fields.iter())
                        .map(|f| (&**f == "a:1").then(|| old.as_str().into()))
                        .collect(),
                )
            })
            .collect();
        let plan = plan(&reads, got, &windows, now);
        assert_eq!(
            plan.currents,
            [
                Current::Missing,
                Current::Missing,
                Current::Missing,
                Current::Integer(7)
            ]
        );
        let mut written: Vec<(String, Option<String>, Option<String>)> = (plan.writes.iter())
            .flat_map(|s| s.fields.iter())
            .map(|f| {
                let text = |v: &Option<FieldValue>| v.as_deref().map(str::to_owned);
                (f.field.to_string(), text(&f.read), text(&f.value))
            })
            .collect();
        written.sort();
        assert_eq!(
            written,
            [
                (
                    "a:1".to_owned(),
                    Some(old),
                    Some(format!(
                        "1m={}:3,{}:8;1h={}:3",
                        now / MIN,
                        now / MIN - 1,
                        now / HOUR
                    ))
                ),
                ("b:2".to_owned(), None, Some(format!("1m={}:5", now / MIN))),
            ]
        );
        assert!((plan.writes.iter()).all(|s| s.expire_at_ms >= Some(now + 3 * MIN)));
    }

    #[test]
    fn a_delta_into_an_expired_bucket_changes_only_what_the_expiry_drops() {
        let ks = Keyspace::new("t".to_owned(), 1).expect("keyspace");
        let now = 1_000 * HOUR;
        // Its minute ended long before `now` (a replayed late event): expired on arrival.
        let windows = [delta("a:1", MIN, 0, 1), delta("b:2", MIN, 0, 1)];
        let reads = Reads::new(&ks, 0, &windows);
        // a:1 holds a live minute only; b:2 also an expired one.
        let live = format!("1m={}:4", now / MIN);
        let held = |f: &str| match f {
            "a:1" => Some(live.clone()),
            _ => Some(format!("{live},{}:2", now / MIN - 10)),
        };
        let got: Vec<Read> = (reads.stripes.iter())
            .map(|(_, fields)| {
                Read::Fields(fields.iter().map(|f| held(f).map(Into::into)).collect())
            })
            .collect();
        let plan = plan(&reads, got, &windows, now);
        let written: Vec<(String, Option<String>)> = (plan.writes.iter())
            .flat_map(|s| s.fields.iter())
            .map(|f| (f.field.to_string(), f.value.as_deref().map(str::to_owned)))
            .collect();
        assert_eq!(written, [("b:2".to_owned(), Some(live))]);
    }

    #[test]
    fn a_field_that_is_not_cells_or_a_hash_of_another_type_refuses_its_deltas() {
        let ks = Keyspace::new("t".to_owned(), 1).expect("keyspace");
        let windows = [delta("a:1", MIN, 0, 1), delta("a:1", HOUR, 0, 1)];
        let reads = Reads::new(&ks, 0, &windows);
        let junk = plan(
            &reads,
            vec![Read::Fields(vec![Some("junk".into())])],
            &windows,
            0,
        );
        assert_eq!(
            junk.currents,
            [Current::NotAnInteger, Current::NotAnInteger]
        );
        assert!(junk.writes.is_empty());
        let typed = plan(&reads, vec![Read::WrongType], &windows, 0);
        assert_eq!(typed.currents, [Current::WrongType, Current::WrongType]);
        assert!(typed.writes.is_empty());
        // Deltas that cancel out delete the field.
        let full = FieldValue::from("1m=0:-1;1h=0:-1");
        let cancel = plan(
            &reads,
            vec![Read::Fields(vec![Some(full.clone())])],
            &windows,
            0,
        );
        assert_eq!(cancel.writes[0].fields[0].value, None);
        assert_eq!(cancel.writes[0].fields[0].read, Some(full));
    }
}
