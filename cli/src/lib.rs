//! What the `tally` command line does beyond reading: generating traffic through the producer
//! crate ([`load`], `tally load`), waiting for known totals in Redis ([`verify`],
//! `tally verify`), recounting the log to prove the totals ([`audit`], `tally audit`), and
//! listing and replaying dead letters ([`dead_letters`], `tally dead-letters`). The
//! end-to-end tests drive the pipeline with the same.

pub mod audit;
pub mod dead_letters;
pub mod load;
pub mod verify;
