//! How lockstep's messages travel between ranks. The `Collective` trait, the in-process
//! group and the MPI group arrive with the multi-rank runtime; this crate is a placeholder
//! until then.

#![forbid(unsafe_code)]
