//! What the `tally` command line does beyond reading: generating traffic through the producer
//! crate ([`load`], `tally load`), waiting for known totals in Redis ([`verify`],
//! `tally verify`), and recounting the log to prove the totals ([`audit`], `tally audit`). The
//! end-to-end tests drive the pipeline with the same.

pub mod audit;
pub mod load;
pub mod verify;
