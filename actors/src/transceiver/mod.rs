//! The per-rank KV transceiver of a disaggregated deployment (mechanisms.md §8): it owns
//! this rank's transfers in flight, turns its executor's [`TransferCommand`]s and its
//! peers' messages into [`TransferEvent`]s for the executor and messages for the peers,
//! and times transfers out. Pure: no I/O, no clock (times come in as `now_ns`), no
//! threads; a driver moves the messages.
//!
//! Protocol (pull, as production disaggregated servers do):
//!
//! 1. ctx rank: the prefill is done, its executor emits `Send { id }` and keeps the KV.
//! 2. The front tells the gen side where the KV lives (`KvAddress` of the ctx rank).
//! 3. gen rank: its transport budget admits the request, its executor emits
//!    `Receive { id, blocks }`; the transceiver sends [`PeerMessage::Pull`] to the ctx rank.
//! 4. ctx rank: once it has both the `Send` command and the pull (either order), it sends
//!    [`PeerMessage::KvBlocks`].
//! 5. gen rank: checks every block's checksum, emits `Done` (or `Failed`) for its executor
//!    and answers [`PeerMessage::Ack`] (or [`PeerMessage::Abort`]).
//! 6. ctx rank: on the ack, emits `Done` (its executor frees the KV).
//!
//! Each side has a deadline of `timeout_ms` from the start of its part of the transfer
//! (the `Receive` command on the gen side, the pull on the ctx side). A transfer not
//! finished by then fails on that side with `"kv transfer timed out after N ms"`, and the
//! counterpart, when known, is sent an abort so it fails too: KV is freed on both sides.
//! Before the pull, a ctx rank only holds the KV while the request waits in the gen
//! server's queue; that wait is bounded separately, by `pull_timeout_ms` (`"kv not pulled
//! within N ms"`), so a queue longer than the transfer timeout fails nothing while a gen
//! side that never pulls cannot pin the ctx rank's blocks forever. Messages for a
//! transfer that already ended here are ignored (a late pull for a failed send is
//! answered with an abort).
//!
//! Inputs go through one funnel, [`Transceiver::handle`] (commands and messages, with
//! `now`), plus [`Transceiver::handle_timeout`]; outputs are drained with
//! [`Transceiver::poll_event`] (for the executor) and [`Transceiver::poll_transmit`] (for
//! the network); [`Transceiver::poll_timeout`] says when the next deadline falls, so a
//! host sleeps until then or until a message arrives, whichever comes first.
//!
//! What a block carries depends on the [`KvCodec`]: real bytes with a checksum (the real
//! drivers, where the bytes stand for the model's KV), or only its size (the simulator,
//! which models the wire time from it), or — with a model behind the ranks — the model's
//! own K/V, read from the ctx rank's pool and written into the gen rank's through a
//! [`KvStore`], with the request's token ids so far (the gen rank continues the sequence
//! from them). The store is the one place the transceiver touches rank memory, as a
//! transfer engine reads and writes registered device memory; what it reads is fixed by
//! the forwards before the `Send` command, so a transfer's contents stay deterministic.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::ids::ReqId;
use crate::vocab::{
    AbortCause, DEFAULT_PULL_TIMEOUT_MS, KvAddress, TransferCommand, TransferEvent,
    TransferFailure, TransferOutcome,
};

/// Fault injection (`[faults] lost_transfer_every = n`): the KV blocks of request `id`
/// are lost on the wire when `id` is a multiple of `n`. Keyed by the request, not by the
/// order messages happen to be sent in, so every driver loses the same requests.
pub fn lost_on_the_wire(id: ReqId, every: Option<u64>) -> bool {
    every.is_some_and(|n| n > 0 && id.0.is_multiple_of(n))
}

/// A request's KV in transit: real blocks, or (in the simulator) only how much of it
/// there is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvPayload {
    /// Blocks with their bytes and checksums, in order.
    Blocks(Vec<KvBlock>),
    /// A model's K/V: its blocks, checksummed, and the token ids of the sequence so far
    /// (the prompt and the tokens sampled on the ctx rank).
    Sequence {
        /// Blocks, in order.
        blocks: Vec<KvBlock>,
        /// Token ids.
        tokens: Vec<u32>,
    },
    /// `blocks` blocks of `bytes` bytes in all, modeled, not materialised.
    Modeled {
        /// Blocks.
        blocks: u32,
        /// Bytes in all.
        bytes: u64,
    },
}

impl KvPayload {
    /// Bytes on the wire.
    pub fn bytes(&self) -> u64 {
        match self {
            KvPayload::Blocks(blocks) => blocks.iter().map(|b| b.bytes.len() as u64).sum(),
            KvPayload::Sequence { blocks, tokens } => {
                blocks.iter().map(|b| b.bytes.len() as u64).sum::<u64>() + 4 * tokens.len() as u64
            }
            KvPayload::Modeled { bytes, .. } => *bytes,
        }
    }

    /// Blocks carried.
    pub fn blocks(&self) -> u32 {
        match self {
            KvPayload::Blocks(blocks) | KvPayload::Sequence { blocks, .. } => blocks.len() as u32,
            KvPayload::Modeled { blocks, .. } => *blocks,
        }
    }
}

/// One block of KV cache in transit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvBlock {
    /// Block index inside the request's sequence, from 0.
    pub index: u32,
    /// Contents.
    pub bytes: Vec<u8>,
    /// Checksum of `bytes` computed by the sender.
    pub checksum: u64,
}

/// What transceivers (and the front) tell each other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerMessage {
    /// gen → ctx: send me the KV of `id` (`blocks` blocks are reserved here).
    Pull {
        /// Request.
        id: ReqId,
        /// Who pulls.
        puller: KvAddress,
        /// Blocks reserved on the gen rank.
        blocks: u32,
    },
    /// ctx → gen: the KV of `id`.
    KvBlocks {
        /// Request.
        id: ReqId,
        /// The blocks.
        payload: KvPayload,
    },
    /// gen → ctx: the KV of `id` arrived intact; free yours.
    Ack {
        /// Request.
        id: ReqId,
    },
    /// Either side (or the front): the transfer of `id` failed; fail and free yours.
    Abort {
        /// Request.
        id: ReqId,
        /// Why, as the side that ended it says.
        cause: TransferFailure,
    },
    /// front → ctx: nobody will pull `id` (its only output token is out); free the KV.
    Release {
        /// Request.
        id: ReqId,
    },
}

impl PeerMessage {
    /// Bytes this message puts on the wire (a fixed header, plus the KV it carries).
    pub fn wire_bytes(&self) -> u64 {
        const HEADER: u64 = 64;
        match self {
            PeerMessage::KvBlocks { payload, .. } => HEADER + payload.bytes(),
            _ => HEADER,
        }
    }

    /// The request the message is about.
    pub fn id(&self) -> ReqId {
        match self {
            PeerMessage::Pull { id, .. }
            | PeerMessage::KvBlocks { id, .. }
            | PeerMessage::Ack { id }
            | PeerMessage::Abort { id, .. }
            | PeerMessage::Release { id } => *id,
        }
    }
}

/// A message for another rank's transceiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// Destination.
    pub to: KvAddress,
    /// Message.
    pub message: PeerMessage,
}

/// A request's K/V as a store hands it over: each block's bytes, in sequence order, and
/// the token ids of its sequence so far.
pub type SequenceKv = (Vec<Vec<u8>>, Vec<u32>);

/// Where a model backend keeps one rank's K/V: the ctx side takes a request's blocks from
/// it, the gen side puts them in (the driver plugs in the backend's: the transceiver
/// stays independent of any backend crate).
pub trait KvStore: Send + Sync {
    /// Bytes of one block.
    fn block_bytes(&self) -> u64;
    /// ctx side: the contents of `id`'s first `blocks` blocks, in sequence order, and the
    /// token ids of its sequence so far. Taken: a second export of `id` fails.
    fn export(&self, id: ReqId, blocks: u32) -> Result<SequenceKv, String>;
    /// gen side: writes `blocks` into `block_ids` (in order) and takes `tokens` as `id`'s
    /// sequence so far. An error writes nothing a request reads.
    fn import(
        &self,
        id: ReqId,
        block_ids: &[u32],
        blocks: &[KvBlock],
        tokens: &[u32],
    ) -> Result<(), String>;
}

/// How block contents are produced and checked (the driver plugs in the backend's: the
/// transceiver stays independent of any backend crate).
#[derive(Clone)]
pub enum KvCodec {
    /// Real bytes, written by `fill` and checked on arrival.
    Real {
        /// Bytes per block on the wire (the model's block, capped: see `kv_contents`).
        block_bytes: usize,
        /// Bytes of the model's block: what the transfer stands for, and what the
        /// counters report.
        model_block_bytes: u64,
        /// Writes block `index` of request `request` into the slice (the ctx side's KV).
        fill: fn(request: u64, index: u32, out: &mut [u8]),
        /// Checksum of a block's bytes.
        checksum: fn(&[u8]) -> u64,
    },
    /// Sizes only (the simulator): nothing is materialised, the wire time is modeled
    /// from `block_bytes` per block.
    Modeled {
        /// Bytes per block.
        block_bytes: u64,
    },
    /// A model's own K/V (`--model`, every driver): read from and written to the rank's
    /// pool through `store`, checked on arrival.
    Model {
        /// This rank's pool.
        store: Arc<dyn KvStore>,
        /// Checksum of a block's bytes.
        checksum: fn(&[u8]) -> u64,
    },
}

impl std::fmt::Debug for KvCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvCodec::Real {
                block_bytes,
                model_block_bytes,
                ..
            } => f
                .debug_struct("Real")
                .field("block_bytes", block_bytes)
                .field("model_block_bytes", model_block_bytes)
                .finish_non_exhaustive(),
            KvCodec::Modeled { block_bytes } => f
                .debug_struct("Modeled")
                .field("block_bytes", block_bytes)
                .finish(),
            KvCodec::Model { store, .. } => f
                .debug_struct("Model")
                .field("block_bytes", &store.block_bytes())
                .finish_non_exhaustive(),
        }
    }
}

impl KvCodec {
    /// The model's bytes for `blocks` blocks (what a transfer stands for, whatever the
    /// wire carried).
    pub fn model_bytes(&self, blocks: u32) -> u64 {
        let per_block = match self {
            KvCodec::Real {
                model_block_bytes, ..
            } => *model_block_bytes,
            KvCodec::Modeled { block_bytes } => *block_bytes,
            KvCodec::Model { store, .. } => store.block_bytes(),
        };
        u64::from(blocks) * per_block
    }
}

/// Counters of one transceiver, for the report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferStats {
    /// Transfers completed on this side.
    pub completed: u64,
    /// The model's KV bytes moved by completed transfers (the real drivers put capped
    /// blocks on the wire; this counts what they stand for).
    pub bytes: u64,
    /// Transfers this side timed out.
    pub timed_out: u64,
    /// Transfers failed for another reason (a peer's abort, a checksum mismatch).
    pub failed: u64,
    /// Transfers failed because a block's checksum did not match.
    pub checksum_failures: u64,
    /// ctx side: sends released without a pull (single-token outputs).
    pub released: u64,
    /// Duration of each completed transfer, in ns (gen: receive to verified; ctx:
    /// send command to ack).
    pub durations_ns: Vec<u64>,
}

/// The ctx side of one transfer.
#[derive(Debug, Clone, Default)]
struct Sending {
    /// From the `Send` command: blocks held and when it started.
    command: Option<(u32, u64)>,
    /// From the pull: who pulls and how many blocks it reserved.
    pull: Option<(KvAddress, u32)>,
    /// When the pull arrived: the transfer's own deadline counts from here.
    pulled_ns: Option<u64>,
    /// The front said nobody will pull.
    released: bool,
    /// A peer failed the transfer before the `Send` command arrived.
    aborted: Option<TransferFailure>,
    /// Blocks are on the wire: bytes sent, awaiting the ack.
    sent_bytes: Option<u64>,
}

impl Sending {
    /// When the transfer itself started: once both the `Send` command and the pull are
    /// here (before that the KV only waits for its gen server).
    fn transfer_started(&self) -> Option<u64> {
        let (_, commanded) = self.command?;
        Some(self.pulled_ns?.max(commanded))
    }
}

/// The gen side of one transfer.
#[derive(Debug, Clone)]
struct Receiving {
    from: KvAddress,
    blocks: u32,
    block_ids: Vec<u32>,
    started_ns: u64,
}

/// An input of the transceiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransceiverIn {
    /// A command of this rank's executor.
    Command(TransferCommand),
    /// A message from a peer transceiver or the front.
    Message(PeerMessage),
}

/// A per-rank transceiver. See the module documentation for the protocol.
#[derive(Debug)]
pub struct Transceiver {
    me: KvAddress,
    timeout_ns: u64,
    timeout_ms: u64,
    pull_timeout_ns: u64,
    pull_timeout_ms: u64,
    codec: KvCodec,
    sending: BTreeMap<ReqId, Sending>,
    receiving: BTreeMap<ReqId, Receiving>,
    /// Transfers that ended here: id → failure reason if failed. Late messages about
    /// them are ignored; entries are forgotten after two timeouts (no message can be
    /// that late).
    ended: BTreeMap<ReqId, Option<TransferFailure>>,
    ended_order: VecDeque<(u64, ReqId)>,
    events: std::collections::VecDeque<TransferEvent>,
    outgoing: std::collections::VecDeque<Outgoing>,
    stats: TransferStats,
}

impl Transceiver {
    /// The transceiver of rank `me`, timing transfers out after `timeout_ms` (at least 1)
    /// and sends nobody pulls after [`DEFAULT_PULL_TIMEOUT_MS`].
    pub fn new(me: KvAddress, timeout_ms: u64, codec: KvCodec) -> Transceiver {
        let timeout_ms = timeout_ms.max(1);
        Transceiver {
            me,
            timeout_ns: timeout_ms.saturating_mul(1_000_000),
            timeout_ms,
            pull_timeout_ns: DEFAULT_PULL_TIMEOUT_MS.saturating_mul(1_000_000),
            pull_timeout_ms: DEFAULT_PULL_TIMEOUT_MS,
            codec,
            sending: BTreeMap::new(),
            receiving: BTreeMap::new(),
            ended: BTreeMap::new(),
            ended_order: VecDeque::new(),
            events: Default::default(),
            outgoing: Default::default(),
            stats: TransferStats::default(),
        }
    }

    /// The same, giving up on a send nobody pulled after `pull_timeout_ms` (at least 1).
    #[must_use]
    pub fn with_pull_timeout_ms(mut self, pull_timeout_ms: u64) -> Transceiver {
        self.pull_timeout_ms = pull_timeout_ms.max(1);
        self.pull_timeout_ns = self.pull_timeout_ms.saturating_mul(1_000_000);
        self
    }

    /// This rank.
    pub fn address(&self) -> KvAddress {
        self.me
    }

    /// Counters so far.
    pub fn stats(&self) -> &TransferStats {
        &self.stats
    }

    /// Transfers not yet ended on this side.
    pub fn in_flight(&self) -> usize {
        self.sending.len() + self.receiving.len()
    }

    /// Events for the executor since the last call.
    pub fn take_events(&mut self) -> Vec<TransferEvent> {
        self.events.drain(..).collect()
    }

    /// Messages for peers since the last call.
    pub fn take_outgoing(&mut self) -> Vec<Outgoing> {
        self.outgoing.drain(..).collect()
    }

    /// The one funnel for inputs: a command of this rank's executor or a message.
    pub fn handle(&mut self, now_ns: u64, input: TransceiverIn) {
        match input {
            TransceiverIn::Command(c) => self.on_command(now_ns, &c),
            TransceiverIn::Message(m) => self.on_message(now_ns, m),
        }
    }

    /// Fires what is overdue at `now_ns` (spurious calls are harmless).
    pub fn handle_timeout(&mut self, now_ns: u64) {
        self.on_tick(now_ns);
    }

    /// The next event for the executor, in the order they happened.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<TransferEvent> {
        self.events.pop_front()
    }

    /// The next message for the network, in the order they were made.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Outgoing> {
        self.outgoing.pop_front()
    }

    /// When the next deadline falls (a transfer's timeout), if any transfer is open.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        let receives = self
            .receiving
            .values()
            .map(|r| r.started_ns.saturating_add(self.timeout_ns));
        let sends = self.sending.values().filter_map(|s| self.send_deadline(s));
        receives.chain(sends).min()
    }

    /// A send's deadline: the transfer timeout from when both the command and the pull
    /// are here, or the pull timeout from
    /// the `Send` command while nobody has pulled.
    fn send_deadline(&self, s: &Sending) -> Option<u64> {
        let (_, commanded) = s.command?;
        Some(match s.transfer_started() {
            Some(started) => started.saturating_add(self.timeout_ns),
            None => commanded.saturating_add(self.pull_timeout_ns),
        })
    }

    fn timed_out(&self) -> TransferFailure {
        TransferFailure::TimedOut {
            after_ms: self.timeout_ms,
        }
    }

    fn not_pulled(&self) -> TransferFailure {
        TransferFailure::NotPulled {
            within_ms: self.pull_timeout_ms,
        }
    }

    /// One command of this rank's executor. A `Receive` pulls from where its request's KV
    /// lives (`from`: the request's `kv_source`, set by the front); without it the
    /// receive fails at once.
    pub fn on_command(&mut self, now_ns: u64, command: &TransferCommand) {
        match *command {
            TransferCommand::Send { id, blocks } => {
                if self.ended.contains_key(&id) {
                    return;
                }
                let s = self.sending.entry(id).or_default();
                s.command = Some((blocks, now_ns));
                self.advance_send(now_ns, id);
            }
            TransferCommand::Receive {
                id,
                blocks,
                from,
                ref block_ids,
            } => {
                if self.ended.contains_key(&id) || self.receiving.contains_key(&id) {
                    return;
                }
                let Some(from) = from else {
                    self.fail_here(
                        now_ns,
                        id,
                        TransferFailure::Mismatch(format!("no KV location known for request {id}")),
                        None,
                    );
                    return;
                };
                self.receiving.insert(
                    id,
                    Receiving {
                        from,
                        blocks,
                        block_ids: block_ids.clone(),
                        started_ns: now_ns,
                    },
                );
                self.outgoing.push_back(Outgoing {
                    to: from,
                    message: PeerMessage::Pull {
                        id,
                        puller: self.me,
                        blocks,
                    },
                });
            }
            TransferCommand::Abort { id, ref cause } => self.abort_here(now_ns, id, cause),
        }
    }

    /// The executor dropped `id` (cancelled, or failed with its server): end the
    /// transfer here without an event (the executor holds nothing to apply it to) and
    /// tell the counterpart, if known, so it frees its side.
    fn abort_here(&mut self, now_ns: u64, id: ReqId, cause: &AbortCause) {
        let peer = if let Some(r) = self.receiving.remove(&id) {
            Some(r.from)
        } else if let Some(s) = self.sending.remove(&id) {
            s.pull.map(|(puller, _)| puller)
        } else {
            return;
        };
        self.stats.failed += 1;
        let failure = TransferFailure::Aborted(cause.clone());
        if let Some(to) = peer {
            self.outgoing.push_back(Outgoing {
                to,
                message: PeerMessage::Abort {
                    id,
                    cause: failure.clone(),
                },
            });
        }
        self.ended.insert(id, Some(failure));
        self.ended_order.push_back((now_ns, id));
    }

    /// A message from a peer or the front.
    pub fn on_message(&mut self, now_ns: u64, message: PeerMessage) {
        let id = message.id();
        if let Some(failure) = self.ended.get(&id) {
            // A pull for a send that already failed here: tell the puller at once
            // rather than let it wait for its own timeout.
            if let (PeerMessage::Pull { puller, .. }, Some(cause)) = (&message, failure) {
                self.outgoing.push_back(Outgoing {
                    to: *puller,
                    message: PeerMessage::Abort {
                        id,
                        cause: cause.clone(),
                    },
                });
            }
            return;
        }
        match message {
            PeerMessage::Pull { id, puller, blocks } => {
                let s = self.sending.entry(id).or_default();
                s.pull = Some((puller, blocks));
                s.pulled_ns.get_or_insert(now_ns);
                self.advance_send(now_ns, id);
            }
            PeerMessage::Release { id } => {
                self.sending.entry(id).or_default().released = true;
                self.advance_send(now_ns, id);
            }
            PeerMessage::Ack { id } => {
                let Some(s) = self.sending.get(&id) else {
                    return;
                };
                // The transfer's own time, not the wait in the gen server's queue.
                let (Some(bytes), Some(started)) = (s.sent_bytes, s.transfer_started()) else {
                    return;
                };
                self.sending.remove(&id);
                self.stats.completed += 1;
                self.stats.bytes += bytes;
                self.stats.durations_ns.push(now_ns.saturating_sub(started));
                self.end(now_ns, id, TransferOutcome::Done);
            }
            PeerMessage::KvBlocks { id, payload } => self.on_blocks(now_ns, id, payload),
            PeerMessage::Abort { id, cause: reason } => {
                if self.receiving.remove(&id).is_some() {
                    self.stats.failed += 1;
                    self.end(now_ns, id, TransferOutcome::Failed(reason));
                } else if let Some(s) = self.sending.get_mut(&id) {
                    if s.command.is_some() {
                        self.sending.remove(&id);
                        self.stats.failed += 1;
                        self.end(now_ns, id, TransferOutcome::Failed(reason));
                    } else {
                        // The executor has not asked to send yet: fail it when it does.
                        s.aborted = Some(reason);
                    }
                } else {
                    // Nothing here yet (the abort overtook the send command).
                    self.sending.entry(id).or_default().aborted = Some(reason);
                }
            }
        }
    }

    /// Times out what is overdue.
    pub fn on_tick(&mut self, now_ns: u64) {
        let overdue_receives: Vec<ReqId> = self
            .receiving
            .iter()
            .filter(|(_, r)| now_ns.saturating_sub(r.started_ns) >= self.timeout_ns)
            .map(|(id, _)| *id)
            .collect();
        for id in overdue_receives {
            let peer = self.receiving.remove(&id).map(|r| r.from);
            self.stats.timed_out += 1;
            let reason = self.timed_out();
            self.fail_here(now_ns, id, reason, peer);
        }
        let overdue_sends: Vec<ReqId> = self
            .sending
            .iter()
            .filter(|(_, s)| self.send_deadline(s).is_some_and(|d| now_ns >= d))
            .map(|(id, _)| *id)
            .collect();
        for id in overdue_sends {
            let Some(s) = self.sending.remove(&id) else {
                continue;
            };
            self.stats.timed_out += 1;
            let reason = if s.pulled_ns.is_some() {
                self.timed_out()
            } else {
                self.not_pulled()
            };
            self.fail_here(now_ns, id, reason, s.pull.map(|(g, _)| g));
        }
        // No message about a transfer can arrive later than its longest deadline.
        let forget_after = self.timeout_ns.max(self.pull_timeout_ns).saturating_mul(2);
        while let Some(&(at, id)) = self.ended_order.front() {
            if now_ns.saturating_sub(at) < forget_after {
                break;
            }
            self.ended_order.pop_front();
            self.ended.remove(&id);
        }
    }

    /// ctx side: act once enough is known (command plus pull, release or abort).
    fn advance_send(&mut self, now_ns: u64, id: ReqId) {
        let Some(s) = self.sending.get(&id) else {
            return;
        };
        let Some((held, _)) = s.command else {
            return;
        };
        if let Some(reason) = s.aborted.clone() {
            self.sending.remove(&id);
            self.stats.failed += 1;
            self.end(now_ns, id, TransferOutcome::Failed(reason));
            return;
        }
        if s.released {
            self.sending.remove(&id);
            self.stats.released += 1;
            self.end(now_ns, id, TransferOutcome::Done);
            return;
        }
        let Some((puller, wanted)) = s.pull else {
            return;
        };
        if s.sent_bytes.is_some() {
            return;
        }
        if wanted > held {
            let reason = TransferFailure::Mismatch(format!(
                "gen rank reserved {wanted} KV blocks, ctx rank holds {held}"
            ));
            self.sending.remove(&id);
            self.stats.failed += 1;
            self.fail_here(now_ns, id, reason, Some(puller));
            return;
        }
        // Send what the gen rank reserved: the prompt's blocks (the ctx rank may hold
        // one more for the sampled token, whose KV the gen rank computes itself).
        let payload = match &self.codec {
            &KvCodec::Real {
                block_bytes,
                fill,
                checksum,
                ..
            } => KvPayload::Blocks(
                (0..wanted)
                    .map(|index| {
                        let mut bytes = vec![0u8; block_bytes];
                        fill(id.0, index, &mut bytes);
                        KvBlock {
                            index,
                            checksum: checksum(&bytes),
                            bytes,
                        }
                    })
                    .collect(),
            ),
            &KvCodec::Modeled { block_bytes } => KvPayload::Modeled {
                blocks: wanted,
                bytes: u64::from(wanted) * block_bytes,
            },
            KvCodec::Model { store, checksum } => match store.export(id, wanted) {
                Ok((blocks, tokens)) => KvPayload::Sequence {
                    blocks: blocks
                        .into_iter()
                        .zip(0..)
                        .map(|(bytes, index)| KvBlock {
                            index,
                            checksum: checksum(&bytes),
                            bytes,
                        })
                        .collect(),
                    tokens,
                },
                Err(why) => {
                    let reason = TransferFailure::Store(format!(
                        "kv of request {id} could not be read: {why}"
                    ));
                    self.sending.remove(&id);
                    self.stats.failed += 1;
                    self.fail_here(now_ns, id, reason, Some(puller));
                    return;
                }
            },
        };
        if let Some(s) = self.sending.get_mut(&id) {
            s.sent_bytes = Some(self.codec.model_bytes(payload.blocks()));
        }
        self.outgoing.push_back(Outgoing {
            to: puller,
            message: PeerMessage::KvBlocks { id, payload },
        });
    }

    /// gen side: verify what arrived, then done and ack, or failed and abort.
    fn on_blocks(&mut self, now_ns: u64, id: ReqId, payload: KvPayload) {
        let Some(r) = self.receiving.remove(&id) else {
            return;
        };
        let problem = match &payload {
            KvPayload::Blocks(blocks) => self.check_blocks(blocks, r.blocks),
            KvPayload::Sequence { blocks, tokens } => {
                self.check_blocks(blocks, r.blocks).or_else(|| {
                    let KvCodec::Model { store, .. } = &self.codec else {
                        return Some(TransferFailure::Mismatch(
                            "a model's kv reached a transceiver without a model".into(),
                        ));
                    };
                    store
                        .import(id, &r.block_ids, blocks, tokens)
                        .err()
                        .map(|why| {
                            TransferFailure::Store(format!(
                                "kv of request {id} could not be written: {why}"
                            ))
                        })
                })
            }
            KvPayload::Modeled { blocks, .. } => (*blocks != r.blocks).then(|| {
                TransferFailure::Mismatch(format!(
                    "kv transfer brought {blocks} blocks, {} expected",
                    r.blocks
                ))
            }),
        };
        if let Some(reason) = problem {
            if matches!(reason, TransferFailure::Checksum { .. }) {
                self.stats.checksum_failures += 1;
            }
            self.stats.failed += 1;
            self.fail_here(now_ns, id, reason, Some(r.from));
            return;
        }
        self.stats.completed += 1;
        self.stats.bytes += self.codec.model_bytes(payload.blocks());
        self.stats
            .durations_ns
            .push(now_ns.saturating_sub(r.started_ns));
        self.outgoing.push_back(Outgoing {
            to: r.from,
            message: PeerMessage::Ack { id },
        });
        self.end(now_ns, id, TransferOutcome::Done);
    }

    /// What is wrong with real blocks, if anything: count, order, checksums.
    fn check_blocks(&self, blocks: &[KvBlock], expected: u32) -> Option<TransferFailure> {
        let checksum = match &self.codec {
            KvCodec::Real { checksum, .. } | KvCodec::Model { checksum, .. } => *checksum,
            KvCodec::Modeled { .. } => {
                return Some(TransferFailure::Mismatch(
                    "real kv blocks reached a modeled transceiver".into(),
                ));
            }
        };
        if blocks.len() != expected as usize {
            Some(TransferFailure::Mismatch(format!(
                "kv transfer brought {} blocks, {} expected",
                blocks.len(),
                expected
            )))
        } else {
            blocks.iter().enumerate().find_map(|(i, b)| {
                if b.index as usize != i {
                    Some(TransferFailure::Mismatch(format!(
                        "kv block {i} arrived as block {}",
                        b.index
                    )))
                } else if checksum(&b.bytes) != b.checksum {
                    Some(TransferFailure::Checksum { block: b.index })
                } else {
                    None
                }
            })
        }
    }

    /// Fails `id` here and, if known, tells the counterpart.
    fn fail_here(
        &mut self,
        now_ns: u64,
        id: ReqId,
        reason: TransferFailure,
        peer: Option<KvAddress>,
    ) {
        if let Some(to) = peer {
            self.outgoing.push_back(Outgoing {
                to,
                message: PeerMessage::Abort {
                    id,
                    cause: reason.clone(),
                },
            });
        }
        self.end(now_ns, id, TransferOutcome::Failed(reason));
    }

    fn end(&mut self, now_ns: u64, id: ReqId, outcome: TransferOutcome) {
        let failure = match &outcome {
            TransferOutcome::Done => None,
            TransferOutcome::Failed(reason) => Some(reason.clone()),
        };
        self.ended.insert(id, failure);
        self.ended_order.push_back((now_ns, id));
        self.events.push_back(TransferEvent { id, outcome });
    }
}

#[cfg(test)]
mod tests;
