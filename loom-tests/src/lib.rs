//! loom models of lockstep's synchronisation protocols arrive with the multi-rank runtime.

#![forbid(unsafe_code)]
