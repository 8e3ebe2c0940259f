//! vLLM's command-line names on `serve` and `bench`, as shorthands over lockstep's
//! scenario and workload.

mod bench;
mod serve;

pub(crate) use bench::{
    BenchShorthands, DatasetWorkload, default_bench_scenario, refuse_model_directory,
};
pub(crate) use serve::ServeShorthands;
