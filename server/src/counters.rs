//! Counter routes: totals (through the cache, or exact), a batch of totals, a counter's shares
//! for the console, likes, and a namespace's top counters.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use tally_common::event::{validate_actor, validate_counter};
use tally_producer::WriteError;
use utoipa::{IntoParams, ToSchema};

use crate::error::{ApiError, ErrorBody};
use crate::limits::{MAX_BATCH, MAX_TOP};
use crate::state::AppState;

/// One counter's total.
#[derive(Debug, Serialize, ToSchema)]
pub struct Total {
    /// The counter id.
    pub counter: String,
    /// Its total; with a window, its sum over that window.
    pub total: i64,
    /// The window asked for (`24h`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
}

/// `GET /v1/counters/{id}`'s query.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ReadQuery {
    /// Sum the shares now instead of serving the cached total.
    #[serde(default)]
    exact: bool,
    /// The sum over the last span instead of the total (`24h`, `7d`, `90m`): the sum of the
    /// namespace's buckets of the widest window dividing the span, the current one included.
    /// Read from Redis every time.
    window: Option<String>,
}

/// The span of `?window=`, in ms.
fn window_span(window: &str) -> Result<i64, ApiError> {
    tally_common::window::parse_duration(window)
        .map_err(|why| ApiError::bad_request("invalid_window", format!("window {window:?}: {why}")))
}

/// A counter's total: through its namespace's cache (TTL per namespace, one refresh per counter
/// across processes), or with `?exact=true` summed from its shares now; with `?window=24h`, its
/// sum over the last 24 hours, from the namespace's windows.
#[utoipa::path(
    get, path = "/v1/counters/{id}", tag = "counters",
    params(("id" = String, Path, description = "The counter id, e.g. likes:post:42"), ReadQuery),
    responses(
        (status = 200, body = Total),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
pub async fn get_counter(
    State(state): State<Arc<AppState>>,
    counter: Result<Path<String>, PathRejection>,
    query: Result<Query<ReadQuery>, QueryRejection>,
) -> Result<Json<Total>, ApiError> {
    let Path(counter) = counter?;
    let Query(query) = query?;
    let reader = state.counts.reader();
    let total = match &query.window {
        Some(window) => reader.get_window(&[&counter], window_span(window)?).await?[0],
        None if query.exact => reader.get_exact(&counter).await?,
        None => reader.get(&counter).await?,
    };
    Ok(Json(Total {
        counter,
        total,
        window: query.window,
    }))
}

/// A `batch-get` body.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchGet {
    /// The counter ids, at most 1,000.
    counters: Vec<String>,
    /// Sums over the last span (`24h`) instead of totals, as `GET /v1/counters/{id}?window=`.
    #[serde(default)]
    window: Option<String>,
}

/// `batch-get`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Totals {
    /// The totals, in the order asked.
    totals: Vec<Total>,
}

/// The totals of up to 1,000 counters, in the order asked, through the cache, in one round of
/// Redis reads. A counter never written is 0.
#[utoipa::path(
    post, path = "/v1/counters/batch-get", tag = "counters",
    request_body = BatchGet,
    responses(
        (status = 200, body = Totals),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 415, body = ErrorBody), (status = 503, body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
pub async fn batch_get(
    State(state): State<Arc<AppState>>,
    body: Result<Json<BatchGet>, JsonRejection>,
) -> Result<Json<Totals>, ApiError> {
    let Json(BatchGet { counters, window }) = body?;
    if counters.len() > MAX_BATCH {
        return Err(ApiError::bad_request(
            "too_many_counters",
            format!(
                "{} counters asked; at most {MAX_BATCH} per request",
                counters.len()
            ),
        ));
    }
    let totals = match &window {
        Some(w) => {
            (state.counts.reader())
                .get_window(&counters, window_span(w)?)
                .await?
        }
        None => state.counts.get_many(&counters).await?,
    };
    let totals = (counters.into_iter().zip(totals))
        .map(|(counter, total)| Total {
            counter,
            total,
            window: window.clone(),
        })
        .collect();
    Ok(Json(Totals { totals }))
}

/// One shard group's share of a counter.
#[derive(Debug, Serialize, ToSchema)]
pub struct Share {
    /// The shard group.
    group: u32,
    /// What the group holds for the counter.
    value: i64,
}

/// What readers are served from the cache shared by every reader process.
#[derive(Debug, Serialize, ToSchema)]
pub struct CacheEntry {
    /// The cached total.
    total: i64,
    /// How long ago it was refreshed, in ms.
    age_ms: u64,
    /// The namespace's TTL, in ms: readers refresh an entry older than this.
    ttl_ms: u64,
}

/// A counter, taken apart: what the console shows.
#[derive(Debug, Serialize, ToSchema)]
pub struct Inspection {
    /// The counter id.
    counter: String,
    /// The exact total (shares and pending compaction journals).
    total: i64,
    /// The share each shard group holds (groups without one left out); compaction journals in
    /// flight are in `total` but not here.
    shares: Vec<Share>,
    /// How many shards direct writes spread it over.
    direct_shards: u32,
    /// The cached total readers are being served, if any reader cached it.
    cache: Option<CacheEntry>,
    /// Whether its namespace counts once per actor.
    dedup: bool,
}

/// A counter taken apart: its exact total, each shard group's share, its direct-write shard
/// count, and the cached total readers are served with its age.
#[utoipa::path(
    get, path = "/v1/counters/{id}/shares", tag = "counters",
    params(("id" = String, Path, description = "The counter id")),
    responses(
        (status = 200, body = Inspection),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
pub async fn inspect(
    State(state): State<Arc<AppState>>,
    counter: Result<Path<String>, PathRejection>,
) -> Result<Json<Inspection>, ApiError> {
    let Path(counter) = counter?;
    let cached = state.counts.reader();
    let reader = cached.reader();
    let (total, shares, direct_shards, entry) = tokio::try_join!(
        reader.get(&counter),
        reader.shares(&counter),
        reader.direct_shards(&counter),
        cached.shared_entry(&counter),
    )?;
    let policy = cached.namespaces().policy(&counter);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    Ok(Json(Inspection {
        total,
        shares: (0_u32..)
            .zip(shares)
            .filter_map(|(group, value)| {
                Some(Share {
                    group,
                    value: value?,
                })
            })
            .collect(),
        direct_shards,
        cache: entry.map(|(total, at)| CacheEntry {
            total,
            age_ms: now.saturating_sub(at),
            ttl_ms: policy.cache_ttl_ms,
        }),
        dedup: policy.dedup,
        counter,
    }))
}

/// Whether an actor's like is counted.
#[derive(Debug, Serialize, ToSchema)]
pub struct Liked {
    /// The counter id.
    counter: String,
    /// The actor.
    actor: String,
    /// Whether the actor's like is counted now.
    liked: bool,
}

/// A like or unlike taken: acknowledged by Kafka (a streamed namespace, counted once the
/// aggregator flushes it) or written to Redis (a direct namespace).
#[derive(Debug, Serialize, ToSchema)]
pub struct LikeTaken {
    /// The counter id.
    counter: String,
    /// The actor.
    actor: String,
    /// `stream` (acknowledged by Kafka) or `direct` (written to Redis).
    path: &'static str,
}

/// The counter and actor of a like route, checked; refused unless the namespace counts once per
/// actor.
fn like_target(
    state: &AppState,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<(String, String), ApiError> {
    let Path((counter, actor)) = path?;
    validate_counter(&counter)
        .map_err(|e| ApiError::bad_request("invalid_counter", e.to_string()))?;
    validate_actor(&actor).map_err(|e| ApiError::bad_request("invalid_actor", e.to_string()))?;
    if !state.counts.reader().namespaces().policy(&counter).dedup {
        return Err(ApiError::bad_request(
            "not_deduplicated",
            format!(
                "{counter}'s namespace does not count once per actor (set dedup = true for it): send events instead"
            ),
        ));
    }
    Ok((counter, actor))
}

fn write_error(error: WriteError) -> ApiError {
    match error {
        WriteError::Stream(e) => ApiError::kafka(e),
        other => ApiError::redis(other),
    }
}

/// Whether `actor`'s like of the counter is counted (read from Redis, never cached).
#[utoipa::path(
    get, path = "/v1/counters/{id}/likes/{actor}", tag = "likes",
    params(("id" = String, Path, description = "The counter id"), ("actor" = String, Path, description = "Who")),
    responses(
        (status = 200, body = Liked),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
pub async fn has_liked(
    State(state): State<Arc<AppState>>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<Liked>, ApiError> {
    let (counter, actor) = like_target(&state, path)?;
    let liked = state.counts.has_liked(&counter, &actor).await?;
    Ok(Json(Liked {
        counter,
        actor,
        liked,
    }))
}

/// `actor` likes the counter: counted once however often it is sent.
#[utoipa::path(
    put, path = "/v1/counters/{id}/likes/{actor}", tag = "likes",
    params(("id" = String, Path, description = "The counter id"), ("actor" = String, Path, description = "Who")),
    responses(
        (status = 202, body = LikeTaken),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = ["write"]))
)]
pub async fn like(
    State(state): State<Arc<AppState>>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<(StatusCode, Json<LikeTaken>), ApiError> {
    take_like(&state, path, true).await
}

/// `actor` takes a like of the counter back (nothing happens if it was not counted).
#[utoipa::path(
    delete, path = "/v1/counters/{id}/likes/{actor}", tag = "likes",
    params(("id" = String, Path, description = "The counter id"), ("actor" = String, Path, description = "Who")),
    responses(
        (status = 202, body = LikeTaken),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = ["write"]))
)]
pub async fn unlike(
    State(state): State<Arc<AppState>>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<(StatusCode, Json<LikeTaken>), ApiError> {
    take_like(&state, path, false).await
}

/// A like (`like`) or an unlike, by the counter's namespace's write path.
async fn take_like(
    state: &AppState,
    path: Result<Path<(String, String)>, PathRejection>,
    like: bool,
) -> Result<(StatusCode, Json<LikeTaken>), ApiError> {
    let (counter, actor) = like_target(state, path)?;
    let taken = if like {
        state.counts.like(&counter, &actor).await
    } else {
        state.counts.unlike(&counter, &actor).await
    };
    taken.map_err(write_error)?;
    let path = path_name(
        state
            .counts
            .reader()
            .namespaces()
            .policy(&counter)
            .write_path,
    );
    Ok((
        StatusCode::ACCEPTED,
        Json(LikeTaken {
            counter,
            actor,
            path,
        }),
    ))
}

/// `GET /v1/namespaces/{ns}/top`'s query.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TopQuery {
    /// How many counters, 1 to 100 (default 10).
    k: Option<usize>,
}

/// One of a namespace's busiest counters.
#[derive(Debug, Serialize, ToSchema)]
pub struct Trending {
    /// The counter id.
    counter: String,
    /// Its activity over the last minute: the sum of |delta| the aggregators saw; in a
    /// namespace that keeps windows, its exact sum in the narrowest window's buckets covering
    /// the last minute.
    activity: f64,
}

/// A namespace's fastest-moving counters.
#[derive(Debug, Serialize, ToSchema)]
pub struct Top {
    /// The namespace.
    namespace: String,
    /// Busiest first.
    top: Vec<Trending>,
}

/// A namespace's `k` fastest-moving counters over the last minute, busiest first (approximate:
/// each aggregator reports the heavy hitters of its partitions every few seconds).
#[utoipa::path(
    get, path = "/v1/namespaces/{ns}/top", tag = "counters",
    params(("ns" = String, Path, description = "The namespace, e.g. likes"), TopQuery),
    responses(
        (status = 200, body = Top),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = ["read"]))
)]
pub async fn top(
    State(state): State<Arc<AppState>>,
    namespace: Result<Path<String>, PathRejection>,
    query: Result<Query<TopQuery>, QueryRejection>,
) -> Result<Json<Top>, ApiError> {
    let Path(namespace) = namespace?;
    let Query(query) = query?;
    let k = query.k.unwrap_or(10);
    if !(1..=MAX_TOP).contains(&k) {
        return Err(ApiError::bad_request(
            "bad_query",
            format!("k must be 1 to {MAX_TOP}"),
        ));
    }
    if namespace.is_empty() || namespace.contains(':') {
        return Err(ApiError::bad_request(
            "bad_query",
            "a namespace is the part of a counter id before its first ':'",
        ));
    }
    let top = state.counts.top(&namespace, k).await?;
    Ok(Json(Top {
        namespace,
        top: top
            .into_iter()
            .map(|(counter, activity)| Trending { counter, activity })
            .collect(),
    }))
}

/// A namespace's policy, as configured.
#[derive(Debug, Serialize, ToSchema)]
pub struct NamespaceInfo {
    /// The namespace.
    name: String,
    /// Whether it counts once per actor.
    dedup: bool,
    /// `stream` (through Kafka) or `direct` (to Redis).
    write_path: &'static str,
    /// How long readers serve a cached total, in ms.
    cache_ttl_ms: u64,
}

/// The namespaces the policy file lists.
#[derive(Debug, Serialize, ToSchema)]
pub struct NamespaceList {
    /// Listed namespaces; any other gets the defaults.
    namespaces: Vec<NamespaceInfo>,
}

/// The namespaces the server's policy file lists, with their policies.
#[utoipa::path(
    get, path = "/v1/namespaces", tag = "counters",
    responses((status = 200, body = NamespaceList), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = ["read"]))
)]
pub async fn namespaces(State(state): State<Arc<AppState>>) -> Json<NamespaceList> {
    let namespaces = (state.counts.reader().namespaces().listed())
        .map(|(name, policy)| NamespaceInfo {
            name: name.to_owned(),
            dedup: policy.dedup,
            write_path: path_name(policy.write_path),
            cache_ttl_ms: policy.cache_ttl_ms,
        })
        .collect();
    Json(NamespaceList { namespaces })
}

fn path_name(path: tally_common::WritePath) -> &'static str {
    match path {
        tally_common::WritePath::Stream => "stream",
        tally_common::WritePath::Direct => "direct",
    }
}
