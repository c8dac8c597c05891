//! Namespaces: a counter id is `<namespace>:<rest>` (`likes:post:42`), and its namespace carries
//! a [`Policy`]: whether it counts one per actor, how it is written, how long a cached total may
//! be served, which shard group its deltas go to, and how a count is displayed.
//!
//! Policies come from one TOML file shared by producers, aggregators and readers
//! (`docs/namespaces.md`):
//!
//! ```toml
//! [defaults]                # every namespace the file does not list
//! cache_ttl_ms = 5000
//!
//! [namespaces.likes]        # fields left out are taken from [defaults]
//! dedup = true              # one like per actor; implies grouping = "counter"
//! cache_ttl_ms = 10000
//! display_never_decreases = true
//! ```
//!
//! Without a file every namespace gets [`Policy::default`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::keyspace::GroupingRule;
use crate::window::{WindowEntry, Windows};

/// The widest idempotency window: 30 days (the aggregator keeps ids' timestamps as 32-bit
/// milliseconds, 49 days, past the window).
pub const MAX_IDEMPOTENCY_WINDOW_MS: i64 = 30 * 24 * 3_600_000;

/// How a namespace's events reach Redis.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WritePath {
    /// Through Kafka and the aggregator: batched, exactly once per offset.
    #[default]
    Stream,
    /// Straight from the producer to Redis: visible at once, no Kafka needed.
    Direct,
}

/// How a count is rendered for people.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DisplayStyle {
    /// `9,847`, `10.2K`, `10.2M`, `2.3B`.
    #[default]
    Compact,
    /// Every digit, with thousands separators: `10,293,847`.
    Exact,
}

/// What a namespace does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// One count per actor: a repeated like counts once, an unlike takes a counted like back.
    pub dedup: bool,
    /// Through Kafka, or direct to Redis.
    pub write_path: WritePath,
    /// How long a cached total is served before it is refreshed, in ms ("TTL is a product
    /// decision": 1 s for a live auction, 5-30 s for likes, minutes for totals).
    pub cache_ttl_ms: u64,
    /// Which shard group deltas go to. [`GroupingRule::ByCounter`] (or, as asked,
    /// [`GroupingRule::ByActor`]) when `dedup` is set, so that a membership and the increment it
    /// guards share a slot, whatever the partition.
    pub grouping: GroupingRule,
    /// How counts are displayed.
    pub display: DisplayStyle,
    /// Whether a displayed count may never go down between refreshes (per reader process).
    pub display_never_decreases: bool,
    /// Sums per time bucket kept beside the total (`crate::window`); none by default.
    pub windows: Windows,
    /// Events with the same `event_id` for the same counter count once within this many ms of
    /// the first counted (by Kafka timestamp, in one partition); `None`: ids are not acted on.
    pub idempotency_window_ms: Option<i64>,
    /// A counter none of whose events arrived for this many ms (by Kafka timestamp) disappears
    /// with its keys; its next event starts it from zero. `None`: counters live forever.
    pub expire_after_ms: Option<i64>,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            dedup: false,
            write_path: WritePath::Stream,
            cache_ttl_ms: DEFAULT_CACHE_TTL_MS,
            grouping: GroupingRule::ByPartition,
            display: DisplayStyle::Compact,
            display_never_decreases: false,
            windows: Windows::default(),
            idempotency_window_ms: None,
            expire_after_ms: None,
        }
    }
}

/// The cache TTL of a namespace that sets none.
pub const DEFAULT_CACHE_TTL_MS: u64 = 5_000;

/// A policy as written in the file: every field optional, filled from `[defaults]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyEntry {
    dedup: Option<bool>,
    write_path: Option<WritePath>,
    cache_ttl_ms: Option<u64>,
    grouping: Option<GroupingRule>,
    display: Option<DisplayStyle>,
    display_never_decreases: Option<bool>,
    windows: Option<Vec<WindowEntry>>,
    window_grace: Option<String>,
    idempotency_window: Option<String>,
    expire_after: Option<String>,
}

impl PolicyEntry {
    fn over(&self, base: &Policy, name: &str) -> Result<Policy, NamespaceError> {
        let dedup = self.dedup.unwrap_or(base.dedup);
        let grouping = match (self.grouping, dedup) {
            (Some(GroupingRule::ByPartition), true) => {
                return Err(NamespaceError::Invalid {
                    namespace: name.to_owned(),
                    why: "dedup needs grouping = \"counter\" or \"actor\" (a membership and \
                          the increment it guards share a slot, whatever the partition)"
                        .to_owned(),
                });
            }
            (Some(g), true) => g,
            // An aggregator-wide `--grouping actor` keeps deduplicated counters by actor too.
            (None, true) if base.grouping != GroupingRule::ByPartition => base.grouping,
            (None, true) => GroupingRule::ByCounter,
            (Some(g), false) => g,
            (None, false) => base.grouping,
        };
        let cache_ttl_ms = self.cache_ttl_ms.unwrap_or(base.cache_ttl_ms);
        if cache_ttl_ms == 0 {
            return Err(NamespaceError::Invalid {
                namespace: name.to_owned(),
                why: "cache_ttl_ms must be greater than 0".to_owned(),
            });
        }
        let invalid = |why: String| NamespaceError::Invalid {
            namespace: name.to_owned(),
            why,
        };
        let grace_ms = match &self.window_grace {
            Some(grace) => crate::window::parse_duration(grace).map_err(invalid)?,
            None if base.windows.is_empty() => crate::window::DEFAULT_GRACE_MS,
            None => base.windows.grace_ms(),
        };
        let windows = match &self.windows {
            Some(entries) => Windows::from_entries(entries, grace_ms).map_err(invalid)?,
            None => Windows::new(base.windows.list().to_vec(), grace_ms),
        };
        let write_path = self.write_path.unwrap_or(base.write_path);
        let idempotency_window_ms = match &self.idempotency_window {
            Some(w) => Some(crate::window::parse_duration(w).map_err(invalid)?),
            None => base.idempotency_window_ms,
        };
        if idempotency_window_ms.is_some_and(|w| w > MAX_IDEMPOTENCY_WINDOW_MS) {
            return Err(invalid(
                "an idempotency window is at most 30d (the aggregator holds every id of it)"
                    .to_owned(),
            ));
        }
        if idempotency_window_ms.is_some() && write_path == WritePath::Direct {
            return Err(invalid(
                "idempotency keys are acted on by the aggregator: a direct namespace cannot keep them"
                    .to_owned(),
            ));
        }
        let expire_after_ms = match &self.expire_after {
            Some(e) => Some(crate::window::parse_duration(e).map_err(invalid)?),
            None => base.expire_after_ms,
        };
        if expire_after_ms.is_some() && write_path == WritePath::Direct {
            return Err(invalid(
                "counters expire through the aggregator's log: a direct namespace cannot expire"
                    .to_owned(),
            ));
        }
        if !windows.is_empty() && dedup {
            return Err(invalid(
                "windows are not kept in a namespace that counts one per actor (dedup)".to_owned(),
            ));
        }
        if !windows.is_empty() && write_path == WritePath::Direct {
            return Err(invalid(
                "windows are written by the aggregator's flush: a direct namespace cannot keep them"
                    .to_owned(),
            ));
        }
        Ok(Policy {
            dedup,
            write_path,
            cache_ttl_ms,
            grouping,
            display: self.display.unwrap_or(base.display),
            display_never_decreases: self
                .display_never_decreases
                .unwrap_or(base.display_never_decreases),
            windows,
            idempotency_window_ms,
            expire_after_ms,
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    defaults: PolicyEntry,
    #[serde(default)]
    namespaces: HashMap<String, PolicyEntry>,
}

/// Why a namespace file is unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NamespaceError {
    /// The file could not be read.
    #[error("cannot read namespace file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML for namespaces.
    #[error("invalid namespace file: {0}")]
    Parse(#[from] Box<toml::de::Error>),
    /// A namespace's policy is contradictory or out of range.
    #[error("namespace {namespace:?}: {why}")]
    Invalid {
        /// The namespace (`defaults` for the defaults).
        namespace: String,
        /// Why.
        why: String,
    },
}

/// Every namespace's policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Namespaces {
    /// For namespaces the file does not list.
    defaults: Policy,
    /// Listed namespaces, sorted by name. Looked up once per event: a binary search over a
    /// file's few names compares a handful of short strings, where a `HashMap` hashed each
    /// event's namespace with SipHash (a quarter of what windows added to a catch-up's CPU).
    listed: Vec<(String, Policy)>,
}

impl Namespaces {
    /// Parses a namespace file's text.
    pub fn from_toml(text: &str) -> Result<Self, NamespaceError> {
        let file: File = toml::from_str(text).map_err(Box::new)?;
        Self::resolve(file, None)
    }

    /// Parses a namespace file's text; `grouping`, if given, is the default grouping for
    /// namespaces that set none (the aggregator's `--grouping`).
    pub fn from_toml_with_grouping(
        text: &str,
        grouping: Option<GroupingRule>,
    ) -> Result<Self, NamespaceError> {
        let file: File = toml::from_str(text).map_err(Box::new)?;
        Self::resolve(file, grouping)
    }

    /// Reads a namespace file.
    pub fn from_file(path: &Path) -> Result<Self, NamespaceError> {
        Self::from_toml(&Self::read(path)?)
    }

    /// Reads a namespace file's text.
    pub fn read(path: &Path) -> Result<String, NamespaceError> {
        std::fs::read_to_string(path).map_err(|source| NamespaceError::Read {
            path: path.to_owned(),
            source,
        })
    }

    fn resolve(file: File, grouping: Option<GroupingRule>) -> Result<Self, NamespaceError> {
        let mut base = Policy::default();
        if let Some(grouping) = grouping {
            base.grouping = grouping;
        }
        let defaults = file.defaults.over(&base, "defaults")?;
        let mut listed = file
            .namespaces
            .iter()
            .map(|(name, entry)| Ok((name.clone(), entry.over(&defaults, name)?)))
            .collect::<Result<Vec<_>, NamespaceError>>()?;
        listed.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(Self { defaults, listed })
    }

    /// Every namespace gets `policy`.
    pub fn uniform(policy: Policy) -> Self {
        Self {
            defaults: policy,
            listed: Vec::new(),
        }
    }

    /// The policy of `counter`'s namespace.
    pub fn policy(&self, counter: &str) -> &Policy {
        if self.listed.is_empty() {
            // No namespace file, or one with defaults only: nothing to look up.
            return &self.defaults;
        }
        let namespace = namespace_of(counter);
        match (self.listed).binary_search_by(|(name, _)| name.as_str().cmp(namespace)) {
            Ok(i) => &self.listed[i].1,
            Err(_) => &self.defaults,
        }
    }

    /// The policy of namespaces the file does not list.
    pub fn defaults(&self) -> &Policy {
        &self.defaults
    }

    /// The listed namespaces and their policies.
    pub fn listed(&self) -> impl Iterator<Item = (&str, &Policy)> {
        self.listed.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The widest idempotency window of any namespace, if any keeps one.
    pub fn widest_idempotency_window_ms(&self) -> Option<i64> {
        self.listed
            .iter()
            .map(|(_, p)| p)
            .chain([&self.defaults])
            .filter_map(|p| p.idempotency_window_ms)
            .max()
    }

    /// The shortest `expire_after` of any namespace, if any expires its counters.
    pub fn shortest_expiry_ms(&self) -> Option<i64> {
        self.listed
            .iter()
            .map(|(_, p)| p)
            .chain([&self.defaults])
            .filter_map(|p| p.expire_after_ms)
            .min()
    }

    /// Whether any namespace keeps windows.
    pub fn any_windows(&self) -> bool {
        !self.defaults.windows.is_empty() || self.listed.iter().any(|(_, p)| !p.windows.is_empty())
    }

    /// Whether any namespace deduplicates per actor.
    pub fn any_dedup(&self) -> bool {
        self.defaults.dedup || self.listed.iter().any(|(_, p)| p.dedup)
    }
}

pub use crate::keyspace::namespace_of;

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// A namespace file of generated lines (valid keys with odd values, unknown keys,
        /// broken syntax): loaded or refused with a reason, never a panic.
        #[test]
        fn any_namespace_file_is_loaded_or_refused(lines in proptest::collection::vec(
            proptest::prop_oneof![
                proptest::strategy::Just("[namespaces.likes]".to_owned()),
                proptest::strategy::Just("[namespaces.\"a b\"]".to_owned()),
                "(dedup|cache_ttl_ms|shards|windows|window_grace|grouping|display|expire_after|idempotency_window|x) = [-a-z0-9\"\\[\\]{},=. ]{0,30}",
                "[ -~]{0,40}",
            ],
            0..12,
        )) {
            let _ = Namespaces::from_toml(&lines.join("\n"));
        }
    }

    const EXAMPLE: &str = r#"
[defaults]
cache_ttl_ms = 30000

[namespaces.likes]
dedup = true
cache_ttl_ms = 10000
display_never_decreases = true

[namespaces.views]
cache_ttl_ms = 120000

[namespaces.bids]
cache_ttl_ms = 1000
display = "exact"
write_path = "direct"
"#;

    #[test]
    fn listed_namespaces_override_the_defaults_field_by_field() {
        let ns = Namespaces::from_toml(EXAMPLE).expect("valid");
        let likes = ns.policy("likes:post:42");
        assert!(likes.dedup);
        assert_eq!(likes.grouping, GroupingRule::ByCounter);
        assert_eq!(likes.cache_ttl_ms, 10_000);
        assert!(likes.display_never_decreases);
        let bids = ns.policy("bids:lot:7");
        assert_eq!(bids.write_path, WritePath::Direct);
        assert_eq!(bids.display, DisplayStyle::Exact);
        assert_eq!(ns.policy("views:video:9").cache_ttl_ms, 120_000);
        // Unlisted: the defaults, with the file's TTL.
        let other = ns.policy("shares:post:1");
        assert_eq!(other.cache_ttl_ms, 30_000);
        assert!(!other.dedup);
        assert_eq!(other.grouping, GroupingRule::ByPartition);
        assert!(ns.any_dedup());
    }

    #[test]
    fn the_aggregators_grouping_is_the_default_grouping() {
        let ns = Namespaces::from_toml_with_grouping(EXAMPLE, Some(GroupingRule::ByActor))
            .expect("valid");
        assert_eq!(ns.policy("views:video:9").grouping, GroupingRule::ByActor);
        assert_eq!(ns.policy("likes:post:1").grouping, GroupingRule::ByActor);
        let by_actor = "[namespaces.likes]\ndedup = true\ngrouping = \"actor\"\n";
        let ns = Namespaces::from_toml(by_actor).expect("valid");
        assert_eq!(ns.policy("likes:post:1").grouping, GroupingRule::ByActor);
        let none = Namespaces::default();
        assert_eq!(none.policy("likes:post:1"), &Policy::default());
    }

    #[test]
    fn contradictions_and_unknown_keys_are_refused() {
        let partition_dedup = "[namespaces.likes]\ndedup = true\ngrouping = \"partition\"\n";
        assert!(matches!(
            Namespaces::from_toml(partition_dedup),
            Err(NamespaceError::Invalid { .. })
        ));
        assert!(Namespaces::from_toml("[namespaces.likes]\ndedupe = true\n").is_err());
        assert!(Namespaces::from_toml("[namespaces.x]\ncache_ttl_ms = 0\n").is_err());
    }

    #[test]
    fn windows_are_parsed_and_refused_where_they_cannot_be_kept() {
        let ns = Namespaces::from_toml(
            "[namespaces.views]\nwindows = [\"1h\", { width = \"1m\", retention = \"2h\" }]\nwindow_grace = \"5m\"\n",
        )
        .expect("valid");
        let windows = &ns.policy("views:v:1").windows;
        let widths: Vec<(i64, i64)> = (windows.list().iter())
            .map(|w| (w.width_ms, w.retention_ms))
            .collect();
        assert_eq!(widths, [(60_000, 7_200_000), (3_600_000, 48 * 3_600_000)]);
        assert_eq!(windows.grace_ms(), 300_000);
        assert!(ns.policy("likes:p:1").windows.is_empty());
        let ids = Namespaces::from_toml("[namespaces.views]\nidempotency_window = \"10m\"\n")
            .expect("valid");
        assert_eq!(ids.policy("views:v:1").idempotency_window_ms, Some(600_000));
        assert_eq!(ids.policy("likes:p:1").idempotency_window_ms, None);
        assert_eq!(ids.widest_idempotency_window_ms(), Some(600_000));
        let expiring = Namespaces::from_toml("[namespaces.campaign]\nexpire_after = \"30d\"\n")
            .expect("valid");
        assert_eq!(
            expiring.policy("campaign:c:1").expire_after_ms,
            Some(30 * 86_400_000)
        );
        assert_eq!(expiring.policy("likes:p:1").expire_after_ms, None);
        assert_eq!(expiring.shortest_expiry_ms(), Some(30 * 86_400_000));
        for bad in [
            "[namespaces.b]\nwrite_path = \"direct\"\nexpire_after = \"1d\"\n",
            "[namespaces.c]\nexpire_after = \"soon\"\n",
            "[namespaces.likes]\ndedup = true\nwindows = [\"1h\"]\n",
            "[namespaces.bids]\nwrite_path = \"direct\"\nwindows = [\"1h\"]\n",
            "[namespaces.v]\nwindows = [\"1h\", \"60m\"]\n",
            "[namespaces.v]\nwindows = [\"1x\"]\n",
            "[namespaces.v]\nwindows = [\"10ms\"]\n",
            "[namespaces.b]\nwrite_path = \"direct\"\nidempotency_window = \"1m\"\n",
            "[namespaces.v]\nidempotency_window = \"31d\"\n",
        ] {
            assert!(
                matches!(
                    Namespaces::from_toml(bad),
                    Err(NamespaceError::Invalid { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_example_file_is_valid() {
        let ns = Namespaces::from_toml(include_str!("../../deploy/namespaces.example.toml"))
            .expect("deploy/namespaces.example.toml is valid");
        assert_eq!(ns.policy("plays:video:9").windows.list().len(), 3);
    }

    #[test]
    fn the_namespace_is_what_comes_before_the_first_colon() {
        assert_eq!(namespace_of("likes:post:42"), "likes");
        assert_eq!(namespace_of("plain"), "plain");
        assert_eq!(namespace_of("caf\u{e9}:1"), "caf\u{e9}");
        assert_eq!(namespace_of(":x"), "");
    }
}
