//! The `## Re-grouping under load` section of `results.md`.

use std::fmt::Write;

use crate::results::Results;

/// Writes the section, if the regroup scenario ran.
pub(super) fn section(out: &mut String, r: &Results) {
    if let [plain, regrouped, ..] = r.regroup.as_slice() {
        let (a, b) = (&plain.catch_up, &regrouped.catch_up);
        let _ = writeln!(
            out,
            "\n## Re-grouping under load\n\nThe exactly-once catch-up of {} events as it is, and re-grouped from 16 to 64 shard groups (`tally regroup --to 64`, started at the first flush; every partition moved {:.1} s later, 3 of them the readers' leases): {:.0} and {:.0} events/s from launch ({:.2} x); aggregator CPU {:.2} and {:.2} s per million events. Exact reads of 100 busy counters (`get_many`) throughout: {} and {} reads, median {:.2} and {:.2} ms, p99 {:.2} and {:.2} ms, worst {:.1} and {:.1} ms.",
            b.run.events,
            regrouped.regroup_seconds,
            a.events_per_second_from_launch,
            b.events_per_second_from_launch,
            b.events_per_second_from_launch / a.events_per_second_from_launch.max(1.0),
            a.run.cpu_seconds_per_million,
            b.run.cpu_seconds_per_million,
            plain.reads,
            regrouped.reads,
            plain.read_p50_ms,
            regrouped.read_p50_ms,
            plain.read_p99_ms,
            regrouped.read_p99_ms,
            plain.read_max_ms,
            regrouped.read_max_ms,
        );
        if !regrouped.ratios.is_empty() {
            let _ = writeln!(
                out,
                "\nPer alternated round, the re-grouped rate over the same round's plain one: {}; the figures above are the median round's.",
                (regrouped.ratios.iter())
                    .map(|r| format!("{r:.2}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            );
        }
    }
}
