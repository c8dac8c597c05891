//! What one membership (an actor in a counter's member set, `dedup = true`) costs Redis in
//! memory, by set size and by the shape of the actor ids: strings (`u123456`) and integers
//! (`123456`), which Redis keeps as an intset, eight bytes or fewer each, while a set holds at
//! most `set-max-intset-entries` (512 by default) of them and nothing else.

use crate::env::{Env, delete_matching};
use crate::results::MembershipMemory;
use crate::scenarios::windows::used_memory;

/// Memberships written per case: enough that the main dictionary's growth is a small part.
const MEMBERSHIPS: u64 = 400_000;
/// Members per set, from a long tail's one like per counter to a hot post's thousands.
const SET_SIZES: [u64; 5] = [1, 4, 32, 400, 2_000];

/// Per set size and id shape, the Redis memory a membership adds (`used_memory` after − before,
/// over the memberships, sets' keys included), each case's keys deleted after it.
pub(crate) async fn members(env: &mut Env<'_>) -> anyhow::Result<Vec<MembershipMemory>> {
    let setting: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("set-max-intset-entries")
        .query_async(&mut env.redis)
        .await?;
    let intset_entries: u64 = setting.get(1).and_then(|v| v.parse().ok()).unwrap_or(512);
    let mut cases = Vec::new();
    for integer_ids in [false, true] {
        for per_set in SET_SIZES {
            let prefix = env.name("members");
            settle(&mut env.redis).await?;
            let before = used_memory(&mut env.redis).await?;
            let sets = MEMBERSHIPS / per_set;
            let mut pipe = redis::pipe();
            let mut queued = 0;
            for set in 0..sets {
                let cmd = pipe
                    .cmd("SADD")
                    .arg(format!("{prefix}:{{g3}}:m:likes:post:{set}"));
                for member in 0..per_set {
                    // Actors spread like real ids, not 0..n in every set.
                    let id = 1_000_000 + (set * 7_919 + member * 104_729) % 50_000_000;
                    if integer_ids {
                        cmd.arg(id);
                    } else {
                        cmd.arg(format!("u{id}"));
                    }
                }
                cmd.ignore();
                queued += per_set;
                if queued >= 20_000 || set + 1 == sets {
                    pipe.query_async::<()>(&mut env.redis).await?;
                    pipe.clear();
                    queued = 0;
                }
            }
            let after = used_memory(&mut env.redis).await?;
            let memberships = sets * per_set;
            let case = MembershipMemory {
                integer_ids,
                members_per_set: per_set,
                bytes_per_membership: (after - before) / memberships as f64,
                intset: integer_ids && per_set <= intset_entries,
            };
            println!(
                "members: {} ids, {per_set} per set: {:.1} bytes per membership{}",
                if integer_ids { "integer" } else { "string" },
                case.bytes_per_membership,
                if case.intset { " (intset)" } else { "" }
            );
            cases.push(case);
            delete_matching(&mut env.redis, &format!("{prefix}*")).await;
        }
    }
    Ok(cases)
}

/// Waits until Redis has freed what earlier deletes handed its background thread (`UNLINK`),
/// so that `used_memory` does not fall under a case's feet.
async fn settle(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<()> {
    for _ in 0..600 {
        let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
        let pending = info
            .lines()
            .find_map(|l| l.strip_prefix("lazyfree_pending_objects:"))
            .map(str::trim);
        if pending.is_none_or(|p| p == "0") {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    anyhow::bail!("Redis still frees deleted keys after 30 s")
}
