//! What the `tally` command line does beyond reading: generating traffic through the producer
//! crate ([`load`], `tally load`) and waiting for known totals in Redis ([`verify`],
//! `tally verify`). The end-to-end tests drive the pipeline with the same two.

pub mod load;
pub mod verify;
