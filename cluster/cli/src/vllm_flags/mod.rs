//! vLLM's command-line names on `serve` and `bench`, as shorthands over lockstep's
//! scenario and workload.

mod serve;

pub(crate) use serve::ServeShorthands;
