//! What the real drivers are asked to do, and the report they assemble from what the
//! front and the client saw.

use std::time::{Duration, Instant};

use crate::client::ClientResult;
use crate::front_host::FrontEnd;
use lockstep_plan::fleet::Fleet;
use lockstep_plan::report::{
    ClientLog, Outcome, RankSummary, Report, TimeBase, assemble_report, run_outcome, server_report,
};

/// Options of the real drivers.
#[derive(Clone)]
pub struct RealOptions {
    /// Seed of the workload (a seed in the scenario wins).
    pub seed: u64,
    /// Wall seconds per modeled second (0: the zero-cost backend, no sleeping).
    pub time_scale: f64,
    /// A collective that waits longer fails naming the missing ranks (threads); no sign
    /// of life for this long aborts the job (mpi's watchdog).
    pub collective_timeout: Duration,
    /// A server's ingress queue bound.
    pub ingress_capacity: usize,
    /// Deliver every request before the ranks start (arrivals at iteration boundaries:
    /// the schedule is then independent of thread timing, for cross-driver equality).
    pub preload: bool,
    /// Run the hosts in the simulator's order of events, in modeled time
    /// ([`crate::ordered`]; threads only, with `preload`, unpaced).
    pub ordered: bool,
    /// Fault injection (tests): this rank of the first server tags its gather wrongly at
    /// this iteration.
    pub mismatch_tag_at: Option<(usize, u64)>,
    /// Fault injection (tests): overrides `[faults] lost_transfer_every`.
    pub lose_kv_blocks_every: Option<u64>,
    /// A server whose iterations change nothing while work remains and nothing is in
    /// flight for this long is deadlocked.
    pub stall_bound: Duration,
    /// A real model runs every forward (`--model`); the ranks' time is then its own,
    /// and `time_scale` paces only the arrivals.
    pub model: Option<lockstep_plan::model_backend::ModelBackend>,
    /// With `model`: each forward's shape and measured time, one JSON line each.
    pub forward_log: Option<crate::device::ForwardLog>,
}

impl std::fmt::Debug for RealOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealOptions")
            .field("seed", &self.seed)
            .field("time_scale", &self.time_scale)
            .field("collective_timeout", &self.collective_timeout)
            .field("preload", &self.preload)
            .field("stall_bound", &self.stall_bound)
            .field("model", &self.model)
            .field("forward_log", &self.forward_log.is_some())
            .finish_non_exhaustive()
    }
}

impl Default for RealOptions {
    fn default() -> Self {
        RealOptions {
            seed: 0,
            time_scale: 0.0,
            collective_timeout: Duration::from_secs(30),
            ingress_capacity: 1 << 16,
            preload: false,
            ordered: false,
            mismatch_tag_at: None,
            lose_kv_blocks_every: None,
            stall_bound: Duration::from_secs(10),
            model: None,
            forward_log: None,
        }
    }
}

/// The report of a real run: the client's records and one section per server, from
/// every rank's summary (in any order). A run whose front lost contact with part of the
/// fleet ([`FrontEnd::lost`](crate::front_host::FrontEnd)) ends `failed` with
/// that reason, whatever the summaries that did arrive say.
///
/// With modeled time (`time_scale > 0`) every time is converted to modeled time (wall ÷
/// time scale), so the report compares with the simulator's; with the zero-cost backend
/// the times stay wall times and the report says so; with a real model they stay wall
/// times too (the model's forwards are not modeled).
pub(crate) fn real_report(
    fleet: &Fleet<'_>,
    end: FrontEnd,
    mut result: ClientResult,
    started: Instant,
    opts: &RealOptions,
) -> Report {
    let time_scale = opts.time_scale;
    let FrontEnd {
        mut summaries,
        lost,
    } = end;
    summaries.sort_by_key(|s| (s.server, s.rank));
    let time_base = TimeBase::of_real_run(opts.model.is_some(), time_scale);
    if let TimeBase::Modeled { time_scale } = time_base {
        let modeled = |ns: u64| (ns as f64 / time_scale).round() as u64;
        for r in &mut result.records {
            r.map_client_times(modeled);
        }
        result.end_ns = modeled(result.end_ns);
        result.itl.set_time_scale(time_scale);
        for s in &mut summaries {
            for (_, ns) in &mut s.first_scheduled {
                *ns = modeled(*ns);
            }
            for p in &mut s.series.points {
                p.t_ns = modeled(p.t_ns);
            }
            s.series.balance.map_times(modeled);
        }
    }
    let end_s = result.end_ns as f64 / 1e9;
    let first_scheduled: Vec<(u64, u64)> = summaries
        .iter()
        .flat_map(|s| s.first_scheduled.iter().copied())
        .collect();
    let mut by_server: Vec<Vec<RankSummary>> = fleet.servers.iter().map(|_| Vec::new()).collect();
    for s in summaries {
        if let Some(v) = by_server.get_mut(s.server as usize) {
            v.push(s);
        }
    }
    let outcome = match lost {
        Some(why) => Some((Outcome::Failed, why)),
        None => run_outcome(
            fleet
                .servers
                .iter()
                .zip(&by_server)
                .map(|(p, ranks)| (p.config.name.as_str(), &ranks[..])),
        ),
    };
    let servers = fleet
        .servers
        .iter()
        .zip(&by_server)
        .map(|(p, ranks)| {
            server_report(
                &p.config.name,
                p.config.role,
                p.sizes.max_batch_size,
                ranks,
                end_s,
            )
        })
        .collect();
    let mut report = assemble_report(
        fleet.scenario,
        fleet.seed,
        ClientLog {
            records: result.records,
            itl: result.itl,
            end_ns: result.end_ns,
            frontend: result.frontend,
        },
        first_scheduled,
        started.elapsed().as_secs_f64(),
        servers,
        outcome,
    );
    report.time_base = time_base;
    report
}
