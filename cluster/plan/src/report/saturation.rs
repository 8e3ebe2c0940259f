//! Whether a run's fleet kept up with its offered load: an open-loop workload offers a
//! rate whatever the fleet does; when the fleet completes clearly fewer requests per
//! second, the queue grows with the run and so do its latencies.

use crate::workload::{WorkloadConfig, WorkloadKind};

use super::schema::{Report, TimeBase};

/// Below this share of the offered rate a fleet is called saturated.
pub const SATURATED_BELOW: f64 = 0.9;

/// One line for the text report when an open-loop run achieved less than
/// [`SATURATED_BELOW`] of its offered rate: `None` when it kept up, when nothing was
/// offered at a fixed rate (closed loop, a trace, conversations, a ramp), or when the
/// run modeled no time (the zero-cost backend).
pub fn saturation_note(report: &Report, workload: Option<&WorkloadConfig>) -> Option<String> {
    let w = workload?;
    if w.kind != WorkloadKind::OpenLoop
        || w.conversation.is_some()
        || w.ramp_s > 0.0
        || report.time_base == TimeBase::ZeroCost
        || report.requests.completed == 0
    {
        return None;
    }
    let offered = w.rate?;
    let achieved = report.throughput.requests_per_s;
    if offered.is_nan() || offered <= 0.0 || achieved >= SATURATED_BELOW * offered {
        return None;
    }
    Some(format!(
        "offered {offered:.1} req/s, achieved {achieved:.1}: the fleet is saturated; requests queue and latencies grow with the run's length"
    ))
}
