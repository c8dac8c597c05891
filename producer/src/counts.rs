//! [`Counts`]: one handle a service uses for every namespace. Each write takes the path its
//! namespace's policy names (`docs/namespaces.md`): through Kafka ([`Producer`]) for `stream`,
//! straight to Redis ([`DirectWriter`]) for `direct`. Reads go through the cache
//! ([`CachedReader`]).

use std::sync::Arc;

use tally_common::namespace::WritePath;
use tally_common::{CachedReader, Namespaces, ReadError};

use crate::direct::{DirectError, DirectWriter};
use crate::kafka::{ProduceError, Producer};

/// Why a write through [`Counts`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// The streamed write failed.
    #[error(transparent)]
    Stream(#[from] ProduceError),
    /// The direct write failed.
    #[error(transparent)]
    Direct(#[from] DirectError),
    /// The namespace writes directly, and this handle has no direct writer.
    #[error("{counter} is in a direct namespace, and no DirectWriter was given")]
    NoDirectWriter {
        /// The counter.
        counter: String,
    },
    /// The namespace writes through Kafka, and this handle has no producer.
    #[error("{counter} is in a streamed namespace, and no Producer was given")]
    NoProducer {
        /// The counter.
        counter: String,
    },
}

/// Writes by each namespace's path, reads through the cache.
#[derive(Debug, Clone)]
pub struct Counts {
    namespaces: Arc<Namespaces>,
    producer: Option<Producer>,
    direct: Option<DirectWriter>,
    reader: CachedReader,
}

impl Counts {
    /// A handle over the given parts; a service that only uses streamed (or only direct)
    /// namespaces may leave the other writer out.
    pub fn new(
        namespaces: Arc<Namespaces>,
        producer: Option<Producer>,
        direct: Option<DirectWriter>,
        reader: CachedReader,
    ) -> Self {
        Self {
            namespaces,
            producer,
            direct,
            reader,
        }
    }

    fn path(&self, counter: &str) -> WritePath {
        self.namespaces.policy(counter).write_path
    }

    fn producer(&self, counter: &str) -> Result<&Producer, WriteError> {
        self.producer
            .as_ref()
            .ok_or_else(|| WriteError::NoProducer {
                counter: counter.to_owned(),
            })
    }

    fn direct(&self, counter: &str) -> Result<&DirectWriter, WriteError> {
        self.direct
            .as_ref()
            .ok_or_else(|| WriteError::NoDirectWriter {
                counter: counter.to_owned(),
            })
    }

    /// Adds `delta` to `counter`: acknowledged by Kafka, or written to Redis.
    pub async fn add(&self, counter: &str, delta: i64) -> Result<(), WriteError> {
        match self.path(counter) {
            WritePath::Stream => {
                self.producer(counter)?.add(counter, delta).await?;
            }
            WritePath::Direct => self.direct(counter)?.add(counter, delta).await?,
        }
        Ok(())
    }

    /// `actor` likes `counter` (once per actor in a namespace that deduplicates).
    pub async fn like(&self, counter: &str, actor: &str) -> Result<(), WriteError> {
        match self.path(counter) {
            WritePath::Stream => {
                self.producer(counter)?.like(counter, actor).await?;
            }
            WritePath::Direct => {
                self.direct(counter)?.like(counter, actor).await?;
            }
        }
        Ok(())
    }

    /// `actor` takes back a like of `counter`.
    pub async fn unlike(&self, counter: &str, actor: &str) -> Result<(), WriteError> {
        match self.path(counter) {
            WritePath::Stream => {
                self.producer(counter)?.unlike(counter, actor).await?;
            }
            WritePath::Direct => {
                self.direct(counter)?.unlike(counter, actor).await?;
            }
        }
        Ok(())
    }

    /// Whether `actor`'s like of `counter` is counted (never cached).
    pub async fn has_liked(&self, counter: &str, actor: &str) -> Result<bool, ReadError> {
        self.reader.has_liked(counter, actor).await
    }

    /// The total, cached for the namespace's TTL.
    pub async fn get(&self, counter: &str) -> Result<i64, ReadError> {
        self.reader.get(counter).await
    }

    /// The totals of a feed of counters, cached for their namespaces' TTLs.
    pub async fn get_many<S: AsRef<str>>(&self, counters: &[S]) -> Result<Vec<i64>, ReadError> {
        self.reader.get_many(counters).await
    }

    /// The exact total, bypassing the cache.
    pub async fn get_exact(&self, counter: &str) -> Result<i64, ReadError> {
        self.reader.get_exact(counter).await
    }

    /// The total as people read it (`10.2K`), in the namespace's style.
    pub async fn display(&self, counter: &str) -> Result<String, ReadError> {
        self.reader.display(counter).await
    }

    /// The `k` fastest-moving counters of `namespace` over the last minute.
    pub async fn top(&self, namespace: &str, k: usize) -> Result<Vec<(String, f64)>, ReadError> {
        self.reader.top(namespace, k).await
    }

    /// The cached reader, for its statistics.
    pub fn reader(&self) -> &CachedReader {
        &self.reader
    }
}
