//! The `### The long tail against Redis's own floor` paragraph of `results.md`.

use std::fmt::Write;

use crate::results::Results;

/// The cardinality run's Redis cost per counter write against Redis's own floor for the same
/// writes (new keys), measured in the same rounds.
pub(super) fn section(out: &mut String, r: &Results) {
    let (Some(c), Some(floor)) = (&r.cardinality, &r.cardinality_floor) else {
        return;
    };
    let per_write = c.redis_cpu_us_per_write();
    let ratios: Vec<String> = (r.cardinality_floor_ratios.iter())
        .map(|x| format!("{x:.2}"))
        .collect();
    let _ = writeln!(
        out,
        "\n### The long tail against Redis's own floor\n\n\
         Every event of the cardinality run is a distinct counter, so every event is a write that \
         creates its key. In the same round, without tally, redis-server spent \
         **{:.2} CPU-us** per write of a bare Lua loop of `INCRBY`s over as many new keys \
         ({:.0} per script, as many as tally's flush scripts carried, keys shaped like tally's: \
         the least an atomic write costs) and {:.2} per pipelined `INCRBY` without a script; \
         tally's catch-up spent **{:.2}**, \
         **{:.2} x** the script floor (per round: {}). One redis-server core at the script \
         floor writes at most {:.0} new counters per second. Redis memory per counter at rest: \
         {} B in tally's run, {:.1} B for the floor's bare keys.",
        floor.script_cpu_us_per_write,
        floor.writes_per_script,
        floor.pipelined_cpu_us_per_write,
        per_write,
        per_write / floor.script_cpu_us_per_write.max(1e-9),
        ratios.join(", "),
        1e6 / floor.script_cpu_us_per_write.max(1e-9),
        r.cardinality_bytes_per_counter
            .map_or_else(|| "-".to_owned(), |b| format!("{b:.1}")),
        floor.bytes_per_key,
    );
    if let (Some(p), Some(bytes)) = (
        &r.cardinality_packed,
        r.cardinality_packed_bytes_per_counter,
    ) {
        let _ = writeln!(
            out,
            "\nThe same catch-up with the counters' shares packed into {} hashes per group \
             (`tally pack` before launch): {:.0} events/s from launch ({:.2} x the keys'), \
             redis-server **{:.2} CPU-us** per counter write, **{bytes:.1} B** per counter at \
             rest.",
            r.cardinality_packed_buckets,
            p.events_per_second_from_launch,
            p.events_per_second_from_launch / c.events_per_second_from_launch.max(1e-9),
            p.redis_cpu_us_per_write(),
        );
    }
    if let Some(eo) = r.exactly_once() {
        let zipf = eo.events_per_second_from_launch.max(1e-9);
        let _ = writeln!(
            out,
            "\nAgainst this run's exactly-once catch-up of the Zipf topic ({:.0} events/s from \
             launch): the long tail at **{:.2} x**; Redis's script floor alone, on a whole core \
             with nothing else running, would allow {:.2} x, and pipelined writes without a \
             script {:.2} x.",
            zipf,
            c.events_per_second_from_launch / zipf,
            1e6 / floor.script_cpu_us_per_write.max(1e-9) / zipf,
            1e6 / floor.pipelined_cpu_us_per_write.max(1e-9) / zipf,
        );
    }
}
