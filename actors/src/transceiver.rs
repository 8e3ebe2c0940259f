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
//! Each side has a deadline of `timeout_ms` from the start of its part (the `Send`
//! command on the ctx side, the `Receive` command on the gen side, as production's
//! `kv_transfer_timeout_ms` counts). A transfer not finished by then fails on that side
//! with `"kv transfer timed out after N ms"`, and the counterpart, when known, is sent an
//! abort so it fails too: KV is freed on both sides. Messages for a transfer that already
//! ended here are ignored (a late pull for a failed send is answered with an abort).

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::executor::{TransferCommand, TransferEvent, TransferOutcome};
use crate::ids::{RankId, ReqId};

/// Where a rank is: the server's index in the scenario and the rank inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct KvAddress {
    /// Server index (scenario order).
    pub server: u32,
    /// DP rank inside that server.
    pub rank: RankId,
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
        /// Blocks, in order.
        blocks: Vec<KvBlock>,
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
        /// Why.
        reason: String,
    },
    /// front → ctx: nobody will pull `id` (its only output token is out); free the KV.
    Release {
        /// Request.
        id: ReqId,
    },
}

impl PeerMessage {
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

/// How block contents are produced and checked (the driver plugs in the backend's: the
/// transceiver stays independent of any backend crate).
#[derive(Debug, Clone, Copy)]
pub struct KvCodec {
    /// Bytes per block on the wire.
    pub block_bytes: usize,
    /// Writes block `index` of request `request` into the slice (the ctx side's KV).
    pub fill: fn(request: u64, index: u32, out: &mut [u8]),
    /// Checksum of a block's bytes.
    pub checksum: fn(&[u8]) -> u64,
}

/// Counters of one transceiver, for the report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferStats {
    /// Transfers completed on this side.
    pub completed: u64,
    /// Bytes moved by completed transfers.
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
    /// The front said nobody will pull.
    released: bool,
    /// A peer failed the transfer before the `Send` command arrived.
    aborted: Option<String>,
    /// Blocks are on the wire: bytes sent, awaiting the ack.
    sent_bytes: Option<u64>,
}

/// The gen side of one transfer.
#[derive(Debug, Clone)]
struct Receiving {
    from: KvAddress,
    blocks: u32,
    started_ns: u64,
}

/// A per-rank transceiver. See the module documentation for the protocol.
#[derive(Debug)]
pub struct Transceiver {
    me: KvAddress,
    timeout_ns: u64,
    timeout_ms: u64,
    codec: KvCodec,
    sending: BTreeMap<ReqId, Sending>,
    receiving: BTreeMap<ReqId, Receiving>,
    /// Transfers that ended here: id → failure reason if failed. Late messages about
    /// them are ignored; entries are forgotten after two timeouts (no message can be
    /// that late).
    ended: BTreeMap<ReqId, Option<String>>,
    ended_order: VecDeque<(u64, ReqId)>,
    events: Vec<TransferEvent>,
    outgoing: Vec<Outgoing>,
    stats: TransferStats,
}

impl Transceiver {
    /// The transceiver of rank `me`, timing transfers out after `timeout_ms` (at least 1).
    pub fn new(me: KvAddress, timeout_ms: u64, codec: KvCodec) -> Transceiver {
        let timeout_ms = timeout_ms.max(1);
        Transceiver {
            me,
            timeout_ns: timeout_ms.saturating_mul(1_000_000),
            timeout_ms,
            codec,
            sending: BTreeMap::new(),
            receiving: BTreeMap::new(),
            ended: BTreeMap::new(),
            ended_order: VecDeque::new(),
            events: Vec::new(),
            outgoing: Vec::new(),
            stats: TransferStats::default(),
        }
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
        std::mem::take(&mut self.events)
    }

    /// Messages for peers since the last call.
    pub fn take_outgoing(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.outgoing)
    }

    fn timed_out_reason(&self) -> String {
        format!("kv transfer timed out after {} ms", self.timeout_ms)
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
            TransferCommand::Receive { id, blocks, from } => {
                if self.ended.contains_key(&id) || self.receiving.contains_key(&id) {
                    return;
                }
                let Some(from) = from else {
                    self.fail_here(
                        now_ns,
                        id,
                        format!("no KV location known for request {id}"),
                        None,
                    );
                    return;
                };
                self.receiving.insert(
                    id,
                    Receiving {
                        from,
                        blocks,
                        started_ns: now_ns,
                    },
                );
                self.outgoing.push(Outgoing {
                    to: from,
                    message: PeerMessage::Pull {
                        id,
                        puller: self.me,
                        blocks,
                    },
                });
            }
        }
    }

    /// A message from a peer or the front.
    pub fn on_message(&mut self, now_ns: u64, message: PeerMessage) {
        let id = message.id();
        if let Some(failure) = self.ended.get(&id) {
            // A pull for a send that already failed here: tell the puller at once
            // rather than let it wait for its own timeout.
            if let (PeerMessage::Pull { puller, .. }, Some(reason)) = (&message, failure) {
                self.outgoing.push(Outgoing {
                    to: *puller,
                    message: PeerMessage::Abort {
                        id,
                        reason: reason.clone(),
                    },
                });
            }
            return;
        }
        match message {
            PeerMessage::Pull { id, puller, blocks } => {
                self.sending.entry(id).or_default().pull = Some((puller, blocks));
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
                let (Some(bytes), Some((_, started))) = (s.sent_bytes, s.command) else {
                    return;
                };
                self.sending.remove(&id);
                self.stats.completed += 1;
                self.stats.bytes += bytes;
                self.stats.durations_ns.push(now_ns.saturating_sub(started));
                self.end(now_ns, id, TransferOutcome::Done);
            }
            PeerMessage::KvBlocks { id, blocks } => self.on_blocks(now_ns, id, blocks),
            PeerMessage::Abort { id, reason } => {
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
            let reason = self.timed_out_reason();
            self.fail_here(now_ns, id, reason, peer);
        }
        let overdue_sends: Vec<ReqId> = self
            .sending
            .iter()
            .filter(|(_, s)| {
                s.command
                    .is_some_and(|(_, started)| now_ns.saturating_sub(started) >= self.timeout_ns)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in overdue_sends {
            let peer = self
                .sending
                .remove(&id)
                .and_then(|s| s.pull.map(|(g, _)| g));
            self.stats.timed_out += 1;
            let reason = self.timed_out_reason();
            self.fail_here(now_ns, id, reason, peer);
        }
        while let Some(&(at, id)) = self.ended_order.front() {
            if now_ns.saturating_sub(at) < self.timeout_ns.saturating_mul(2) {
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
            let reason = format!("gen rank reserved {wanted} KV blocks, ctx rank holds {held}");
            self.sending.remove(&id);
            self.stats.failed += 1;
            self.fail_here(now_ns, id, reason, Some(puller));
            return;
        }
        // Send what the gen rank reserved: the prompt's blocks (the ctx rank may hold
        // one more for the sampled token, whose KV the gen rank computes itself).
        let mut blocks = Vec::with_capacity(wanted as usize);
        for index in 0..wanted {
            let mut bytes = vec![0u8; self.codec.block_bytes];
            (self.codec.fill)(id.0, index, &mut bytes);
            let checksum = (self.codec.checksum)(&bytes);
            blocks.push(KvBlock {
                index,
                bytes,
                checksum,
            });
        }
        let sent = u64::from(wanted) * self.codec.block_bytes as u64;
        if let Some(s) = self.sending.get_mut(&id) {
            s.sent_bytes = Some(sent);
        }
        self.outgoing.push(Outgoing {
            to: puller,
            message: PeerMessage::KvBlocks { id, blocks },
        });
    }

    /// gen side: verify what arrived, then done and ack, or failed and abort.
    fn on_blocks(&mut self, now_ns: u64, id: ReqId, blocks: Vec<KvBlock>) {
        let Some(r) = self.receiving.remove(&id) else {
            return;
        };
        let problem = if blocks.len() != r.blocks as usize {
            Some(format!(
                "kv transfer brought {} blocks, {} expected",
                blocks.len(),
                r.blocks
            ))
        } else {
            blocks.iter().enumerate().find_map(|(i, b)| {
                if b.index as usize != i {
                    Some(format!("kv block {i} arrived as block {}", b.index))
                } else if (self.codec.checksum)(&b.bytes) != b.checksum {
                    Some(format!("kv block {} checksum mismatch", b.index))
                } else {
                    None
                }
            })
        };
        if let Some(reason) = problem {
            if reason.contains("checksum") {
                self.stats.checksum_failures += 1;
            }
            self.stats.failed += 1;
            self.fail_here(now_ns, id, reason, Some(r.from));
            return;
        }
        self.stats.completed += 1;
        self.stats.bytes += blocks.iter().map(|b| b.bytes.len() as u64).sum::<u64>();
        self.stats
            .durations_ns
            .push(now_ns.saturating_sub(r.started_ns));
        self.outgoing.push(Outgoing {
            to: r.from,
            message: PeerMessage::Ack { id },
        });
        self.end(now_ns, id, TransferOutcome::Done);
    }

    /// Fails `id` here and, if known, tells the counterpart.
    fn fail_here(&mut self, now_ns: u64, id: ReqId, reason: String, peer: Option<KvAddress>) {
        if let Some(to) = peer {
            self.outgoing.push(Outgoing {
                to,
                message: PeerMessage::Abort {
                    id,
                    reason: reason.clone(),
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
        self.events.push(TransferEvent { id, outcome });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(request: u64, index: u32, out: &mut [u8]) {
        for (i, b) in out.iter_mut().enumerate() {
            *b = (request as u8) ^ (index as u8) ^ (i as u8);
        }
    }

    fn sum(bytes: &[u8]) -> u64 {
        bytes
            .iter()
            .fold(17u64, |h, &b| h.wrapping_mul(31) ^ u64::from(b))
    }

    const CODEC: KvCodec = KvCodec {
        block_bytes: 64,
        fill,
        checksum: sum,
    };
    const MS: u64 = 1_000_000;

    fn addr(server: u32, rank: u32) -> KvAddress {
        KvAddress {
            server,
            rank: RankId(rank),
        }
    }

    fn pair() -> (Transceiver, Transceiver) {
        (
            Transceiver::new(addr(0, 1), 100, CODEC),
            Transceiver::new(addr(1, 2), 100, CODEC),
        )
    }

    /// Delivers everything `from` has for `to`; returns how many messages moved.
    fn pump(now: u64, from: &mut Transceiver, to: &mut Transceiver) -> usize {
        let out = from.take_outgoing();
        let n = out.len();
        for o in out {
            assert_eq!(o.to, to.address());
            to.on_message(now, o.message);
        }
        n
    }

    fn done(id: u64) -> Vec<TransferEvent> {
        vec![TransferEvent {
            id: ReqId(id),
            outcome: TransferOutcome::Done,
        }]
    }

    #[test]
    fn a_pull_moves_checked_blocks_and_both_sides_finish() {
        for pull_first in [false, true] {
            let (mut ctx, mut gen_side) = pair();
            let id = ReqId(5);
            let send = TransferCommand::Send { id, blocks: 3 };
            if !pull_first {
                ctx.on_command(0, &send);
            }
            gen_side.on_command(
                MS,
                &TransferCommand::Receive {
                    id,
                    blocks: 3,
                    from: Some(addr(0, 1)),
                },
            );
            assert_eq!(pump(MS, &mut gen_side, &mut ctx), 1, "the pull");
            if pull_first {
                ctx.on_command(2 * MS, &send);
            }
            assert_eq!(pump(3 * MS, &mut ctx, &mut gen_side), 1, "the blocks");
            assert_eq!(gen_side.take_events(), done(5));
            assert_eq!(pump(4 * MS, &mut gen_side, &mut ctx), 1, "the ack");
            assert_eq!(ctx.take_events(), done(5));
            for side in [&ctx, &gen_side] {
                assert_eq!(side.stats().completed, 1);
                assert_eq!(side.stats().bytes, 3 * 64);
                assert_eq!(side.in_flight(), 0);
            }
            assert_eq!(gen_side.stats().durations_ns, vec![2 * MS]);
        }
    }

    #[test]
    fn a_release_frees_the_send_without_a_pull() {
        let (mut ctx, _) = pair();
        let id = ReqId(9);
        ctx.on_message(0, PeerMessage::Release { id });
        assert!(ctx.take_events().is_empty());
        ctx.on_command(MS, &TransferCommand::Send { id, blocks: 2 });
        assert_eq!(ctx.take_events(), done(9));
        assert_eq!(ctx.stats().released, 1);
        assert_eq!(ctx.stats().completed, 0);
    }

    #[test]
    fn lost_blocks_time_out_on_both_sides_and_late_blocks_are_ignored() {
        let (mut ctx, mut gen_side) = pair();
        let id = ReqId(7);
        ctx.on_command(0, &TransferCommand::Send { id, blocks: 2 });
        gen_side.on_command(
            MS,
            &TransferCommand::Receive {
                id,
                blocks: 2,
                from: Some(addr(0, 1)),
            },
        );
        pump(MS, &mut gen_side, &mut ctx);
        // The network loses the blocks.
        let lost = ctx.take_outgoing();
        assert!(matches!(
            lost[..],
            [Outgoing {
                message: PeerMessage::KvBlocks { .. },
                ..
            }]
        ));
        gen_side.on_tick(100 * MS);
        assert!(gen_side.take_events().is_empty(), "not overdue yet");
        gen_side.on_tick(101 * MS);
        let why = "kv transfer timed out after 100 ms".to_string();
        assert_eq!(
            gen_side.take_events(),
            vec![TransferEvent {
                id,
                outcome: TransferOutcome::Failed(why.clone())
            }]
        );
        assert_eq!(gen_side.stats().timed_out, 1);
        // The ctx side is told and fails too (KV freed on both sides).
        pump(101 * MS, &mut gen_side, &mut ctx);
        assert_eq!(
            ctx.take_events(),
            vec![TransferEvent {
                id,
                outcome: TransferOutcome::Failed(why)
            }]
        );
        // The blocks turn up late: ignored, nothing sent back.
        for m in lost {
            gen_side.on_message(102 * MS, m.message);
        }
        assert!(gen_side.take_events().is_empty());
        assert!(gen_side.take_outgoing().is_empty());
        assert_eq!(gen_side.stats().completed, 0);
        assert_eq!((ctx.in_flight(), gen_side.in_flight()), (0, 0));
    }

    #[test]
    fn the_ctx_side_times_out_from_its_send_and_aborts_a_later_pull() {
        let (mut ctx, mut gen_side) = pair();
        let id = ReqId(3);
        ctx.on_command(0, &TransferCommand::Send { id, blocks: 1 });
        ctx.on_tick(100 * MS);
        assert!(matches!(
            &ctx.take_events()[..],
            [TransferEvent {
                outcome: TransferOutcome::Failed(_),
                ..
            }]
        ));
        gen_side.on_command(
            150 * MS,
            &TransferCommand::Receive {
                id,
                blocks: 1,
                from: Some(addr(0, 1)),
            },
        );
        pump(150 * MS, &mut gen_side, &mut ctx);
        pump(150 * MS, &mut ctx, &mut gen_side);
        assert!(matches!(
            &gen_side.take_events()[..],
            [TransferEvent { outcome: TransferOutcome::Failed(r), .. }] if r.contains("timed out")
        ));
    }

    #[test]
    fn a_corrupted_block_fails_the_transfer_naming_the_block() {
        let (mut ctx, mut gen_side) = pair();
        let id = ReqId(4);
        ctx.on_command(0, &TransferCommand::Send { id, blocks: 3 });
        gen_side.on_command(
            0,
            &TransferCommand::Receive {
                id,
                blocks: 3,
                from: Some(addr(0, 1)),
            },
        );
        pump(0, &mut gen_side, &mut ctx);
        for mut o in ctx.take_outgoing() {
            if let PeerMessage::KvBlocks { blocks, .. } = &mut o.message {
                blocks[1].bytes[10] ^= 0xFF;
            }
            gen_side.on_message(MS, o.message);
        }
        assert_eq!(
            gen_side.take_events(),
            vec![TransferEvent {
                id,
                outcome: TransferOutcome::Failed("kv block 1 checksum mismatch".into())
            }]
        );
        assert_eq!(gen_side.stats().checksum_failures, 1);
        pump(MS, &mut gen_side, &mut ctx);
        assert!(matches!(
            &ctx.take_events()[..],
            [TransferEvent {
                outcome: TransferOutcome::Failed(_),
                ..
            }]
        ));
    }

    #[test]
    fn a_receive_without_a_kv_location_fails_at_once() {
        let (_, mut gen_side) = pair();
        gen_side.on_command(
            0,
            &TransferCommand::Receive {
                id: ReqId(1),
                blocks: 1,
                from: None,
            },
        );
        assert!(matches!(
            &gen_side.take_events()[..],
            [TransferEvent {
                outcome: TransferOutcome::Failed(_),
                ..
            }]
        ));
    }
}
