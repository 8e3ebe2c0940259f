//! One rank as every real backend builds it and ends it: the executor, the transceiver of
//! a ctx or gen rank, the device, the fault switches, the rank host's options, and the
//! end of the rank (its summary to the front). The backends add only what differs: the
//! threads the hosts run on, the collective, and the `Net` and inboxes.

use std::time::Duration;

use lockstep_actors::config::Role;
use lockstep_actors::executor::RankExecutor;
use lockstep_actors::transceiver::Transceiver;
use lockstep_actors::vocab::KvAddress;
use lockstep_plan::fleet::{Fleet, WireModel};

use crate::device::DeviceHandle;
use crate::rank_host::{Pacing, RankOptions, RankRun, rank_summary};
use crate::status::STATUS_EVERY;
use crate::transceiver_host::TransceiverEnd;
use crate::{Endpoint, Envelope, Net, RealOptions, RuntimeError};

/// What one rank is built from.
pub struct RankParts {
    /// The rank's executor.
    pub exec: RankExecutor,
    /// Its transceiver, when the server moves KV (ctx or gen).
    pub transceiver: Option<Transceiver>,
    /// Its device: a real model's thread, modeled time, or zero cost.
    pub device: DeviceHandle,
    /// The iteration at which this rank sends a mis-tagged collective (a fault).
    pub mistag: Option<u64>,
    /// Every how many KV messages the wire loses one (a fault).
    pub lose: Option<u64>,
    /// Modeled time on the wire, when time is modeled.
    pub wire: Option<WireModel>,
}

/// Builds the rank at `at`; a real model's device thread is named `device_thread`.
pub fn build_rank(
    fleet: &Fleet<'_>,
    at: KvAddress,
    opts: &RealOptions,
    device_thread: String,
) -> RankParts {
    let s = at.server as usize;
    let p = &fleet.servers[s];
    let mut exec = RankExecutor::new(at.rank, p.config, &p.sizes, fleet.scenario.policy);
    let (rank_model, model_codec) = match &opts.model {
        Some(m) => {
            let (rank, codec) = m.rank_model(p);
            (Some(rank), codec)
        }
        None => (None, None),
    };
    let transceiver = (p.config.role != Role::Agg)
        .then(|| p.transceiver(at, model_codec.unwrap_or_else(|| fleet.real_codec())));
    let device = match rank_model {
        Some(rank_model) => DeviceHandle::real(
            rank_model,
            device_thread,
            opts.collective_timeout,
            opts.forward_log.clone().map(|l| (l, s, at.rank.0)),
        ),
        None if opts.time_scale > 0.0 => DeviceHandle::modeled(),
        None => DeviceHandle::zero_cost(),
    };
    // A real model reads each launched batch's block tables and prompts.
    exec.set_forward_inputs(device.reads_forward_inputs());
    let mistag = opts
        .mismatch_tag_at
        .and_then(|(rank, it)| (s == 0 && rank == at.rank.index()).then_some(it));
    RankParts {
        exec,
        transceiver,
        device,
        mistag,
        lose: opts
            .lose_kv_blocks_every
            .or(fleet.scenario.faults.lost_transfer_every),
        // An ordered run's time is modeled, at scale 1.
        wire: fleet.wire_model(if opts.ordered { 1.0 } else { opts.time_scale }),
    }
}

/// How every rank host of a run runs. A waiting rank 0 says it is alive every
/// `keep_alive_every`; `publish_status` for `lockstep serve`'s `/metrics`.
pub fn rank_options(
    fleet: &Fleet<'_>,
    server: usize,
    opts: &RealOptions,
    keep_alive_every: Duration,
    publish_status: bool,
) -> RankOptions {
    RankOptions {
        stall_bound: opts.stall_bound,
        keep_alive_every,
        // A real model's forwards take their own time.
        pacing: (opts.time_scale > 0.0 && opts.model.is_none()).then_some(Pacing {
            backend: fleet.backend(server),
            time_scale: opts.time_scale,
        }),
        status_every: publish_status.then_some(STATUS_EVERY),
        ..RankOptions::default()
    }
}

/// The end of a rank, whatever happened: rank 0 first says its server stopped (after its
/// last responses: one channel, in order), then every rank sends its summary.
pub fn end_rank(
    net: &dyn Net,
    server: usize,
    exec: &RankExecutor,
    outcome: Result<RankRun, RuntimeError>,
    transfers: TransceiverEnd,
) {
    let summary = rank_summary(server, exec, outcome, transfers);
    // A front that is gone has nobody to tell; the run's report says it was lost.
    if exec.rank().0 == 0 {
        let _ = net.send(
            Endpoint::Front,
            Envelope::ServerStopped {
                server: server as u32,
            },
        );
    }
    let _ = net.send(Endpoint::Front, Envelope::RankEnded(Box::new(summary)));
}
