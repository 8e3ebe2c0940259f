//! The cheap side of the search: from the cost model alone, an upper bound on a
//! candidate's output tokens per second per GPU, and objectives no load can meet.
//!
//! The bound holds for any schedule: a decoding rank produces at most one token per
//! request per iteration, holds at most what its KV pool and batch allow, and an
//! iteration with `b` decoding requests lasts at least the cost model's time of `b`
//! requests attending their prompts alone. Candidates are simulated best bound first,
//! and one whose bound is below a simulated candidate's result cannot win.

use lockstep_actors::executor::BatchShape;
use lockstep_gpu::{AnalyticBackend, Backend, Coefficients};

use crate::space::{Candidate, Pool};
use crate::spec::{Metric, SearchSpec};

/// What the cost model alone says of a candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct Cheap {
    /// Output tokens per second per GPU it cannot exceed.
    pub tokens_per_gpu: f64,
    /// An objective it cannot meet at any load, with why.
    pub infeasible: Option<String>,
    /// Seconds one request takes alone (its prefill, then one decode step per further
    /// token): simulated clients start spread over this, as in a steady state, rather
    /// than all at once.
    pub unloaded_request_s: f64,
    /// Seconds the longest request (the longest prompt and output) takes alone: what a
    /// fleet that keeps up with open-loop arrivals may still need after the last one.
    pub longest_request_s: f64,
}

/// Below this share of an objective's limit, the lower bound is trusted to prune: the
/// front door and queueing only add time, but a percentile of a few requests is coarse.
const PRUNE_MARGIN: f64 = 0.9;

/// The bound of `c`, whose decoding ranks cost `decoder.0` and hold `decoder.1` KV
/// tokens each, and whose prefilling ranks (the same, aggregated) cost `prefill`.
pub fn cheap(
    spec: &SearchSpec,
    c: &Candidate,
    decoder: (Coefficients, u64),
    prefill: Coefficients,
) -> Cheap {
    let (coefficients, kv_tokens) = decoder;
    let backend = AnalyticBackend::new(coefficients);
    let input = u64::from(spec.workload.input_len().min());
    let d = c.decoder();
    // Requests one decoding rank holds at once: its batch, and its KV pool at their
    // shortest (a prompt and one token each).
    let by_kv = (kv_tokens / (input + 1)).max(1);
    let b = u64::from(d.max_batch_size).min(by_kv) as u32;
    let step = decode_step_ns(&backend, d, b, input);
    let per_instance = f64::from(d.shape.ranks()) * f64::from(b) / (step as f64 / 1e9);
    let tokens_per_gpu = f64::from(d.instances) * per_instance / f64::from(c.gpus());

    let mut infeasible = None;
    let prefill_backend = AnalyticBackend::new(prefill);
    let first_pool = c.pools.first().expect("a pool");
    // Milliseconds a request of `input` prompt tokens spends alone: its prefill, one
    // decode step, and the whole request of `output` tokens.
    let prompt_ms = |input: u64| prefill_ns(&prefill_backend, input, first_pool) as f64 / 1e6;
    let step_ms = |input: u64| decode_step_ns(&backend, d, 1, input) as f64 / 1e6;
    let alone_ms =
        |input: u64, output: u32| prompt_ms(input) + step_ms(input) * f64::from(output - 1);
    let shortest_output = spec.workload.output_len().min();
    for bound in spec.slo.bounds() {
        let floor = match bound.metric {
            Metric::Tpot => step_ms(input),
            Metric::Ttft => prompt_ms(input),
            Metric::E2e => alone_ms(input, shortest_output),
            // Deliveries can bunch at the front door: no floor on a gap.
            Metric::Itl => 0.0,
        };
        if floor * PRUNE_MARGIN > bound.limit_ms {
            infeasible = Some(format!(
                "{} = {} ms is below the cost model's floor of {:.1} ms",
                bound.key(),
                bound.limit_ms,
                floor
            ));
            break;
        }
    }
    let unloaded_ms = alone_ms(input, shortest_output);
    let longest_ms = alone_ms(
        u64::from(spec.workload.input_len().max()),
        spec.workload.output_len().max(),
    );
    Cheap {
        tokens_per_gpu,
        infeasible,
        unloaded_request_s: unloaded_ms / 1e3,
        longest_request_s: longest_ms / 1e3,
    }
}

/// The shortest iteration of a decoder instance with `b` requests per rank, each
/// attending `context` tokens.
fn decode_step_ns(backend: &AnalyticBackend, pool: &Pool, b: u32, context: u64) -> u64 {
    let shape = BatchShape {
        gen_requests: b,
        gen_tokens: b,
        gen_kv_tokens: u64::from(b) * context,
        ..BatchShape::default()
    };
    let shapes = vec![shape; pool.shape.ranks() as usize];
    backend.iteration_ns(&shapes, true, pool.overlap).total_ns
}

/// The shortest prefill of a `prompt`-token request on `pool`: its tokens in one
/// forward, with half the one-chunk attention (chunks attend less).
fn prefill_ns(backend: &AnalyticBackend, prompt: u64, pool: &Pool) -> u64 {
    let tokens = u32::try_from(prompt).unwrap_or(u32::MAX);
    let shape = BatchShape {
        ctx_requests: 1,
        ctx_tokens: tokens,
        ctx_attention: prompt * prompt / 2,
        ..BatchShape::default()
    };
    backend.iteration_ns(&[shape], true, pool.overlap).total_ns
}
