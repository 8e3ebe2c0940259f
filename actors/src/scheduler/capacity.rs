//! The capacity scheduler (§4): GUARANTEED_NO_EVICT, MAX_UTILIZATION (pause-and-reset),
//! STATIC_BATCH; switches `admission.charge_retiring` (window end) and
//! `gne.count_transfers_as_requests`.

use serde::{Deserialize, Serialize};

use crate::config::{CapacitySchedulerPolicy, context_can_run};
use crate::kv::KvView;
use crate::request::{Request, RequestState, SchedulableWindow};

/// How a capacity scheduler is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityConfig {
    /// Policy.
    pub policy: CapacitySchedulerPolicy,
    /// Logical request cap per rank (`M`).
    pub max_num_requests: u32,
    /// The published window.
    pub window: SchedulableWindow,
    /// Legacy `admission.charge_retiring`: the window ends at GENERATION_COMPLETE, so
    /// retiring requests take request slots (but are never put in a batch).
    pub window_ends_at_complete: bool,
    /// Legacy `gne.count_transfers_as_requests`.
    pub count_transfers_as_requests: bool,
    /// MAX_UTILIZATION: which requests may be paused.
    pub pause: PauseRule,
}

/// MAX_UTILIZATION: which requests may be paused (§4). A paused request is recomputed
/// later as a context of its prompt and what it generated; a request whose recompute
/// could never run on this server is never chosen to pause. Its blocks to completion
/// stay reserved instead, from its admission on, as GUARANTEED_NO_EVICT reserves them,
/// so it never needs a pause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseRule {
    /// T: a context runs whole within it, or in chunks of whole blocks with chunked
    /// prefill.
    pub max_num_tokens: u32,
    /// Chunked prefill on.
    pub chunked_prefill: bool,
    /// A ctx server: a request there produces only its first token, so a pause
    /// recomputes its prompt alone.
    pub prefill_only: bool,
}

impl PauseRule {
    /// Every recompute can run: any request may be paused.
    pub const ANY: PauseRule = PauseRule {
        max_num_tokens: u32::MAX,
        chunked_prefill: true,
        prefill_only: false,
    };

    /// Whether `r` may be paused: the longest context a pause could leave it to
    /// recompute (its prompt and all but its last output token, or on a ctx server its
    /// prompt) can run here.
    pub fn may_pause(&self, r: &Request, tokens_per_block: u32) -> bool {
        let longest = if self.prefill_only {
            r.spec.prompt_len
        } else {
            r.spec
                .prompt_len
                .saturating_add(r.spec.max_new_tokens.saturating_sub(1))
        };
        context_can_run(
            longest,
            r.spec.draft_len,
            self.max_num_tokens,
            self.chunked_prefill,
            tokens_per_block,
        )
    }
}

/// What the capacity scheduler decided. Indices point into the `active` slice given.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CapacityOutput {
    /// Requests that may run this iteration (in `active` order). Never contains retiring
    /// or transfer-state requests.
    pub fitting: Vec<usize>,
    /// DISAGG_GENERATION_INIT requests whose blocks to completion fit: the executor
    /// reserves their KV and starts their receive.
    pub disagg_gen_init: Vec<usize>,
    /// MAX_UTILIZATION: started requests paused (reset to context, KV freed).
    pub paused: Vec<usize>,
}

/// The capacity scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityScheduler {
    config: CapacityConfig,
}

impl CapacityScheduler {
    /// A scheduler.
    pub fn new(config: CapacityConfig) -> CapacityScheduler {
        CapacityScheduler { config }
    }

    /// Its policy.
    pub fn policy(&self) -> CapacitySchedulerPolicy {
        self.config.policy
    }

    /// The published window.
    pub fn window(&self) -> SchedulableWindow {
        self.config.window
    }

    /// For a host that runs a stretch of steady decode at once (every request in
    /// progress, one token a step, nothing paused: `executor::stretch`): the blocks
    /// kept back beyond the free ones, and per request of `active` (into `limited`)
    /// whether its steps draw on what is left. Under MAX_UTILIZATION the requests
    /// that may not be paused keep their blocks to completion reserved
    /// ([`reserve_unpausable`]), so only the others' steps draw on the rest; the
    /// other policies take every step from the free blocks. A stretch in which the
    /// limited requests' blocks stay within `free − reserved` pauses nothing.
    pub fn steady_reserve(
        &self,
        active: &[Request],
        kv: &impl KvView,
        limited: &mut Vec<bool>,
    ) -> u64 {
        limited.clear();
        if self.config.policy != CapacitySchedulerPolicy::MaxUtilization {
            limited.resize(active.len(), true);
            return 0;
        }
        let tpb = kv.tokens_per_block();
        let mut reserved = 0;
        for r in active {
            let pausable = self.config.pause.may_pause(r, tpb);
            if !pausable {
                reserved += u64::from(kv.blocks_needed(r.id(), reserved_tokens(r)));
            }
            limited.push(pausable);
        }
        reserved
    }

    /// Decides which of `active` may run, given the KV pool. Pure.
    ///
    /// Slots already taken by requests that cannot be batched (retiring requests under
    /// legacy `window_ends_at_complete`, receives in flight under legacy
    /// `count_transfers_as_requests`) are charged before anything is placed: they hold
    /// their resources whatever this iteration decides, so they come off the cap first
    /// (§2, §4). `fitting`, `disagg_gen_init` and `paused` are in `active` order.
    pub fn schedule(&self, active: &[Request], kv: &impl KvView) -> CapacityOutput {
        let mut out = CapacityOutput::default();
        self.schedule_with(active, kv, &mut Classes::default(), &mut out);
        out
    }

    /// [`CapacityScheduler::schedule`] into buffers the caller keeps across iterations
    /// (cleared here), so the executor's per-iteration step allocates nothing.
    pub(crate) fn schedule_with(
        &self,
        active: &[Request],
        kv: &impl KvView,
        classes: &mut Classes,
        out: &mut CapacityOutput,
    ) {
        self.classify(active, kv, classes);
        let classes = &*classes;
        let cap = (self.config.max_num_requests as usize).saturating_sub(classes.charged_slots);
        out.fitting.clear();
        out.disagg_gen_init.clear();
        out.paused.clear();
        let out = &mut *out;
        match self.config.policy {
            CapacitySchedulerPolicy::GuaranteedNoEvict => {
                let mut avail = i64::from(kv.free_blocks());
                reserve_receiving(active, kv, classes, &mut avail);
                reserve_in_progress(active, kv, classes, cap, &mut avail, out);
                admit_new_to_completion(active, kv, classes, cap, &mut avail, out);
                admit_disagg_gen_init(active, kv, classes, &mut avail, out);
            }
            CapacitySchedulerPolicy::MaxUtilization => {
                let pause = &self.config.pause;
                let mut avail = i64::from(kv.free_blocks());
                reserve_unpausable(active, kv, classes, pause, &mut avail);
                step_in_progress_or_pause(active, kv, classes, pause, cap, &mut avail, out);
                admit_new_prompt(active, kv, classes, pause, cap, &mut avail, out);
                admit_disagg_gen_init(active, kv, classes, &mut avail, out);
            }
            CapacitySchedulerPolicy::StaticBatch => {
                let mut avail = i64::from(kv.free_blocks());
                reserve_receiving(active, kv, classes, &mut avail);
                // Requests still receiving their KV belong to the batch in progress.
                if classes.in_progress.is_empty() && classes.receiving.is_empty() {
                    // Nothing in progress: a new static batch may form. A gen-side arrival
                    // (DISAGG_GENERATION_INIT) is new work too, so it waits with the rest.
                    admit_new_to_completion(active, kv, classes, cap, &mut avail, out);
                    admit_disagg_gen_init(active, kv, classes, &mut avail, out);
                } else {
                    reserve_in_progress(active, kv, classes, cap, &mut avail, out);
                }
            }
        }
        out.fitting.sort_unstable();
        out.paused.sort_unstable();
    }

    /// Sorts `active` into the groups the policies walk (each list in `active` order).
    fn classify(&self, active: &[Request], kv: &impl KvView, c: &mut Classes) {
        c.in_progress.clear();
        c.new_contexts.clear();
        c.disagg_gen_init.clear();
        c.receiving.clear();
        c.charged_slots = 0;
        for (i, r) in active.iter().enumerate() {
            match r.state {
                // Passes the window gate separately: it needs blocks to completion (§4, §8).
                RequestState::DisaggGenerationInit => c.disagg_gen_init.push(i),
                // A receive in flight keeps its blocks to completion reserved (§4); under
                // legacy `gne.count_transfers_as_requests` it also takes a request slot.
                RequestState::DisaggGenerationTransInProgress => {
                    c.receiving.push(i);
                    if self.config.count_transfers_as_requests {
                        c.charged_slots += 1;
                    }
                }
                // Legacy `admission.charge_retiring`: the window ends at GENERATION_COMPLETE,
                // so a retiring request takes a slot; its KV is already held, and it can
                // never be batched (§2). Under the fixed window it is ignored.
                RequestState::GenerationToComplete
                    if self.config.window_ends_at_complete
                        || self.config.window.contains(r.state) =>
                {
                    c.charged_slots += 1;
                }
                s if self.config.window.contains(s) && !r.awaiting_encoder_output => {
                    if r.is_generation() {
                        c.in_progress.push(i);
                    } else if r.is_context() {
                        // A context holding a sequence is a started chunked prefill: its
                        // blocks were granted when it was admitted, so it is in progress.
                        if kv.has_sequence(r.id()) {
                            c.in_progress.push(i);
                        } else {
                            c.new_contexts.push(i);
                        }
                    }
                }
                _ => {}
            }
        }
    }
}

/// The groups a policy walks, as indices into `active`.
#[derive(Debug, Default)]
pub(crate) struct Classes {
    /// Generation steps and started prefills.
    in_progress: Vec<usize>,
    /// Contexts without a KV sequence.
    new_contexts: Vec<usize>,
    /// DISAGG_GENERATION_INIT arrivals.
    disagg_gen_init: Vec<usize>,
    /// DISAGG_GENERATION_TRANS_IN_PROGRESS: receiving their KV. They hold only the
    /// prompt's blocks so far, but were admitted for their blocks to completion.
    receiving: Vec<usize>,
    /// Request slots taken by requests that are never batched (legacy switches).
    charged_slots: usize,
}

/// GNE and STATIC_BATCH: the blocks to completion of requests still receiving their KV stay reserved
/// (they were admitted for them), so new work cannot be admitted into blocks they will
/// need to decode (§4).
fn reserve_receiving(active: &[Request], kv: &impl KvView, classes: &Classes, avail: &mut i64) {
    for &i in &classes.receiving {
        let r = &active[i];
        *avail -= i64::from(kv.blocks_needed(r.id(), completion_tokens(r)));
    }
}

/// GNE / STATIC_BATCH first loop: every in-progress request while the cap allows,
/// reserving its blocks to completion. Scheduled even when the reservation exceeds what
/// is free: its blocks were guaranteed when it was admitted (§4).
fn reserve_in_progress(
    active: &[Request],
    kv: &impl KvView,
    classes: &Classes,
    cap: usize,
    avail: &mut i64,
    out: &mut CapacityOutput,
) {
    // The blocks left over matter only to new work admitted after this walk; with none
    // waiting (steady-state decode) the per-request KV lookups are skipped.
    let count_blocks = !classes.new_contexts.is_empty() || !classes.disagg_gen_init.is_empty();
    for &i in &classes.in_progress {
        if out.fitting.len() >= cap {
            break;
        }
        if count_blocks {
            let r = &active[i];
            *avail -= i64::from(kv.blocks_needed(r.id(), completion_tokens(r)));
        }
        out.fitting.push(i);
    }
}

/// GNE / STATIC_BATCH: new contexts FCFS while the cap allows and their blocks to
/// completion fit; the first that does not fit stops the walk (head-of-line, §4).
fn admit_new_to_completion(
    active: &[Request],
    kv: &impl KvView,
    classes: &Classes,
    cap: usize,
    avail: &mut i64,
    out: &mut CapacityOutput,
) {
    for &i in &classes.new_contexts {
        if out.fitting.len() >= cap {
            break;
        }
        let r = &active[i];
        let need = i64::from(kv.blocks_needed(r.id(), completion_tokens(r)));
        if need > *avail {
            break;
        }
        *avail -= need;
        out.fitting.push(i);
    }
}

/// MAX_UTILIZATION: new contexts FCFS while the cap allows and their context fits (one
/// that may not be paused: its blocks to completion); the first that does not fit stops
/// the walk.
fn admit_new_prompt(
    active: &[Request],
    kv: &impl KvView,
    classes: &Classes,
    pause: &PauseRule,
    cap: usize,
    avail: &mut i64,
    out: &mut CapacityOutput,
) {
    let tpb = kv.tokens_per_block();
    for &i in &classes.new_contexts {
        if out.fitting.len() >= cap {
            break;
        }
        let r = &active[i];
        // The context to compute: the prompt, or after a pause the prompt plus what was
        // generated (it is recomputed). A request that may not be paused is admitted
        // only for its blocks to completion, which stay reserved.
        let need = if pause.may_pause(r, tpb) {
            i64::from(kv.blocks_needed(r.id(), r.context_len))
        } else {
            i64::from(kv.blocks_needed(r.id(), reserved_tokens(r)))
        };
        if need > *avail {
            break;
        }
        *avail -= need;
        out.fitting.push(i);
    }
}

/// DISAGG_GENERATION_INIT arrivals, in order, whose blocks to completion fit in what is
/// left; the first that does not fit stops the walk. They do not take a request slot:
/// they are not batched until their KV has arrived (§4, §8).
fn admit_disagg_gen_init(
    active: &[Request],
    kv: &impl KvView,
    classes: &Classes,
    avail: &mut i64,
    out: &mut CapacityOutput,
) {
    for &i in &classes.disagg_gen_init {
        let r = &active[i];
        let need = i64::from(kv.blocks_needed(r.id(), completion_tokens(r)));
        if need > *avail {
            break;
        }
        *avail -= need;
        out.disagg_gen_init.push(i);
    }
}

/// Prompt plus output tokens ([`Request::tokens_at_completion`]), saturating so that no
/// input makes the scheduler panic.
fn completion_tokens(r: &Request) -> u32 {
    r.spec.prompt_len.saturating_add(r.spec.max_new_tokens)
}

/// Blocks an in-progress request needs for its next step under MAX_UTILIZATION. A
/// generation step writes `1 + draft` more tokens; a started prefill may be given the
/// rest of its context by the micro-batch scheduler, so it needs the whole context (the
/// prompt, plus the generated tokens of a paused request).
fn one_step_blocks(r: &Request, kv: &impl KvView) -> u32 {
    let step = r
        .tokens_in_cache()
        .saturating_add(r.spec.draft_len)
        .saturating_add(1);
    let tokens = if r.is_context() {
        r.context_len.max(step)
    } else {
        step
    };
    kv.blocks_needed(r.id(), tokens)
}

/// Tokens a request that may not be paused keeps reserved: its completion, or its next
/// step when a draft runs past it.
fn reserved_tokens(r: &Request) -> u32 {
    let step = r
        .tokens_in_cache()
        .saturating_add(r.spec.draft_len)
        .saturating_add(1);
    completion_tokens(r).max(step)
}

/// MAX_UTILIZATION: the blocks to completion of in-progress requests (and receives in
/// flight) that may not be paused stay reserved before anything else is placed, so that
/// no step of theirs ever needs a pause (§4).
fn reserve_unpausable(
    active: &[Request],
    kv: &impl KvView,
    classes: &Classes,
    pause: &PauseRule,
    avail: &mut i64,
) {
    let tpb = kv.tokens_per_block();
    for &i in classes.in_progress.iter().chain(&classes.receiving) {
        let r = &active[i];
        if !pause.may_pause(r, tpb) {
            *avail -= i64::from(kv.blocks_needed(r.id(), reserved_tokens(r)));
        }
    }
}

/// MAX_UTILIZATION: schedule in-progress requests while one more step fits; when it does
/// not, pause the most recently started scheduled request that may be paused (the last
/// one placed), giving back the blocks it holds and the step it had reserved, and retry;
/// with nothing left to pause, pause the request itself (§4: pause-and-reset, the
/// executor frees its KV). A request that may not be paused runs within the blocks
/// reserved for it; one whose reservation is short of free blocks (they are held by
/// requests still retiring) first makes the others pause, and otherwise waits a step.
fn step_in_progress_or_pause(
    active: &[Request],
    kv: &impl KvView,
    classes: &Classes,
    pause: &PauseRule,
    cap: usize,
    avail: &mut i64,
    out: &mut CapacityOutput,
) {
    let tpb = kv.tokens_per_block();
    // (index, blocks reserved for its step) of the pausable ones, most recently started
    // last; the unpausable ones scheduled.
    let mut started: Vec<(usize, i64)> = Vec::new();
    let mut reserved: Vec<usize> = Vec::new();
    for &i in &classes.in_progress {
        if started.len() + reserved.len() >= cap {
            break;
        }
        let r = &active[i];
        if !pause.may_pause(r, tpb) {
            // Its step is within its reservation; the reservation itself must be backed
            // by free blocks, which pausing the others gives back.
            while *avail < 0 {
                let Some((victim, held)) = started.pop() else {
                    break;
                };
                *avail += held + i64::from(kv.blocks_of(active[victim].id()));
                out.paused.push(victim);
            }
            if *avail >= 0 {
                reserved.push(i);
            }
            continue;
        }
        let need = i64::from(one_step_blocks(r, kv));
        loop {
            if need <= *avail {
                *avail -= need;
                started.push((i, need));
                break;
            }
            match started.pop() {
                Some((victim, held)) => {
                    *avail += held + i64::from(kv.blocks_of(active[victim].id()));
                    out.paused.push(victim);
                }
                None => {
                    *avail += i64::from(kv.blocks_of(r.id()));
                    out.paused.push(i);
                    break;
                }
            }
        }
    }
    out.fitting.extend(started.into_iter().map(|(i, _)| i));
    out.fitting.extend(reserved);
}
