//! The transceiver driven by scripted messages.

use super::*;
use crate::ids::RankId;

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

const CODEC: KvCodec = KvCodec::Real {
    block_bytes: 64,
    model_block_bytes: 64,
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
        Transceiver::new(addr(0, 1), 100, CODEC).with_pull_timeout_ms(300),
        Transceiver::new(addr(1, 2), 100, CODEC).with_pull_timeout_ms(300),
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
                block_ids: vec![],
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
            block_ids: vec![],
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
    let why = TransferFailure::TimedOut { after_ms: 100 };
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
fn the_ctx_side_holds_an_unpulled_send_up_to_the_pull_timeout_and_aborts_a_later_pull() {
    let (mut ctx, mut gen_side) = pair();
    let id = ReqId(3);
    ctx.on_command(0, &TransferCommand::Send { id, blocks: 1 });
    // Waiting in the gen server's queue longer than the transfer timeout fails nothing.
    ctx.on_tick(299 * MS);
    assert!(ctx.take_events().is_empty());
    assert_eq!(ctx.in_flight(), 1);
    ctx.on_tick(300 * MS);
    assert!(matches!(
        &ctx.take_events()[..],
        [TransferEvent { outcome: TransferOutcome::Failed(r), .. }]
            if *r == TransferFailure::NotPulled { within_ms: 300 }
    ));
    gen_side.on_command(
        350 * MS,
        &TransferCommand::Receive {
            id,
            blocks: 1,
            from: Some(addr(0, 1)),
            block_ids: vec![],
        },
    );
    pump(350 * MS, &mut gen_side, &mut ctx);
    pump(350 * MS, &mut ctx, &mut gen_side);
    assert!(matches!(
        &gen_side.take_events()[..],
        [TransferEvent { outcome: TransferOutcome::Failed(r), .. }]
            if matches!(r, TransferFailure::NotPulled { .. })
    ));
}

#[test]
fn the_ctx_side_times_out_from_the_pull_when_the_ack_never_comes() {
    let (mut ctx, mut gen_side) = pair();
    let id = ReqId(8);
    ctx.on_command(0, &TransferCommand::Send { id, blocks: 1 });
    gen_side.on_command(
        250 * MS,
        &TransferCommand::Receive {
            id,
            blocks: 1,
            from: Some(addr(0, 1)),
            block_ids: vec![],
        },
    );
    pump(250 * MS, &mut gen_side, &mut ctx);
    assert_eq!(
        ctx.poll_timeout(),
        Some(350 * MS),
        "the pull restarts the clock"
    );
    assert_eq!(
        ctx.take_outgoing().len(),
        1,
        "the blocks leave; the ack is lost"
    );
    ctx.on_tick(349 * MS);
    assert!(ctx.take_events().is_empty());
    ctx.on_tick(350 * MS);
    assert!(matches!(
        &ctx.take_events()[..],
        [TransferEvent { outcome: TransferOutcome::Failed(r), .. }]
            if *r == TransferFailure::TimedOut { after_ms: 100 }
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
            block_ids: vec![],
        },
    );
    pump(0, &mut gen_side, &mut ctx);
    for mut o in ctx.take_outgoing() {
        if let PeerMessage::KvBlocks {
            payload: KvPayload::Blocks(blocks),
            ..
        } = &mut o.message
        {
            blocks[1].bytes[10] ^= 0xFF;
        }
        gen_side.on_message(MS, o.message);
    }
    assert_eq!(
        gen_side.take_events(),
        vec![TransferEvent {
            id,
            outcome: TransferOutcome::Failed(TransferFailure::Checksum { block: 1 })
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
            block_ids: vec![],
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

#[test]
fn the_next_deadline_is_the_oldest_open_transfer_plus_the_timeout() {
    let (mut ctx, mut gen_side) = pair();
    assert_eq!(ctx.poll_timeout(), None, "nothing open");
    ctx.handle(
        5 * MS,
        TransceiverIn::Command(TransferCommand::Send {
            id: ReqId(1),
            blocks: 1,
        }),
    );
    ctx.handle(
        9 * MS,
        TransceiverIn::Command(TransferCommand::Send {
            id: ReqId(2),
            blocks: 1,
        }),
    );
    assert_eq!(
        ctx.poll_timeout(),
        Some(305 * MS),
        "unpulled: the pull timeout"
    );
    // A pull alone (no command yet) sets no deadline on the ctx side.
    gen_side.handle(
        7 * MS,
        TransceiverIn::Command(TransferCommand::Receive {
            id: ReqId(3),
            blocks: 1,
            from: Some(addr(0, 1)),
            block_ids: vec![],
        }),
    );
    assert_eq!(gen_side.poll_timeout(), Some(107 * MS));
    pump(7 * MS, &mut gen_side, &mut ctx);
    assert_eq!(ctx.poll_timeout(), Some(305 * MS));
    // Firing the earliest deadline leaves the next one.
    ctx.handle_timeout(305 * MS);
    assert_eq!(ctx.poll_timeout(), Some(309 * MS));
    assert!(matches!(
        ctx.poll_event(),
        Some(TransferEvent {
            id: ReqId(1),
            outcome: TransferOutcome::Failed(_)
        })
    ));
    assert_eq!(ctx.poll_event(), None);
}

#[test]
fn an_abort_command_ends_the_transfer_without_an_event_and_tells_the_peer() {
    let (mut ctx, mut gen_side) = pair();
    let id = ReqId(6);
    ctx.on_command(0, &TransferCommand::Send { id, blocks: 2 });
    gen_side.on_command(
        0,
        &TransferCommand::Receive {
            id,
            blocks: 2,
            from: Some(addr(0, 1)),
            block_ids: vec![],
        },
    );
    pump(0, &mut gen_side, &mut ctx);
    // The ctx side sent its blocks; the gen executor cancels before they arrive.
    let blocks = ctx.take_outgoing();
    gen_side.handle(
        MS,
        TransceiverIn::Command(TransferCommand::Abort {
            id,
            cause: AbortCause::Cancelled,
        }),
    );
    assert!(
        gen_side.take_events().is_empty(),
        "the executor dropped it already"
    );
    assert_eq!(gen_side.in_flight(), 0);
    assert_eq!(gen_side.poll_timeout(), None);
    // The blocks arrive late and are ignored; the ctx side hears of the abort.
    for o in blocks {
        gen_side.on_message(2 * MS, o.message);
    }
    assert_eq!(pump(2 * MS, &mut gen_side, &mut ctx), 1);
    assert_eq!(
        ctx.take_events(),
        vec![TransferEvent {
            id,
            outcome: TransferOutcome::Failed(TransferFailure::Aborted(AbortCause::Cancelled))
        }]
    );
    assert_eq!((ctx.in_flight(), gen_side.in_flight()), (0, 0));
}

#[test]
fn a_modeled_transfer_carries_its_size_and_no_bytes() {
    let modeled = KvCodec::Modeled { block_bytes: 1000 };
    let mut ctx = Transceiver::new(addr(0, 1), 100, modeled.clone());
    let mut gen_side = Transceiver::new(addr(1, 2), 100, modeled);
    let id = ReqId(8);
    ctx.on_command(0, &TransferCommand::Send { id, blocks: 3 });
    gen_side.on_command(
        0,
        &TransferCommand::Receive {
            id,
            blocks: 3,
            from: Some(addr(0, 1)),
            block_ids: vec![],
        },
    );
    pump(0, &mut gen_side, &mut ctx);
    let out = ctx.poll_transmit().expect("the blocks");
    assert_eq!(
        out.message,
        PeerMessage::KvBlocks {
            id,
            payload: KvPayload::Modeled {
                blocks: 3,
                bytes: 3000
            }
        }
    );
    assert_eq!(out.message.wire_bytes(), 3064);
    gen_side.on_message(MS, out.message);
    assert_eq!(gen_side.take_events(), done(8));
    pump(MS, &mut gen_side, &mut ctx);
    assert_eq!(ctx.take_events(), done(8));
    assert_eq!(ctx.stats().bytes, 3000);
}

#[test]
fn the_wire_loses_the_same_requests_whatever_the_order() {
    let lost: Vec<u64> = (1..=20)
        .filter(|&id| lost_on_the_wire(ReqId(id), Some(7)))
        .collect();
    assert_eq!(lost, vec![7, 14]);
    assert!(!lost_on_the_wire(ReqId(7), None));
    assert!(!lost_on_the_wire(ReqId(7), Some(0)));
}

/// A rank's memory as a model backend keeps it. ctx: each request's staged blocks and
/// tokens; gen: block id → bytes and request → tokens, as written.
#[derive(Default)]
struct Memory {
    staged: std::sync::Mutex<BTreeMap<ReqId, SequenceKv>>,
    blocks: std::sync::Mutex<BTreeMap<u32, Vec<u8>>>,
    tokens: std::sync::Mutex<BTreeMap<ReqId, Vec<u32>>>,
    refuse_imports: bool,
}

impl KvStore for Memory {
    fn block_bytes(&self) -> u64 {
        8
    }

    fn export(&self, id: ReqId, blocks: u32) -> Result<SequenceKv, String> {
        let (mut contents, tokens) = self
            .staged
            .lock()
            .unwrap()
            .remove(&id)
            .ok_or(format!("nothing staged for request {id}"))?;
        contents.truncate(blocks as usize);
        Ok((contents, tokens))
    }

    fn import(
        &self,
        id: ReqId,
        block_ids: &[u32],
        blocks: &[KvBlock],
        tokens: &[u32],
    ) -> Result<(), String> {
        if self.refuse_imports {
            return Err("a K/V block of this model is 16 bytes, 8 arrived".into());
        }
        let mut memory = self.blocks.lock().unwrap();
        for (&to, b) in block_ids.iter().zip(blocks) {
            memory.insert(to, b.bytes.clone());
        }
        self.tokens.lock().unwrap().insert(id, tokens.to_vec());
        Ok(())
    }
}

fn model_pair(gen_memory: Memory) -> (Transceiver, Transceiver, Arc<Memory>, Arc<Memory>) {
    let ctx_memory = Arc::new(Memory::default());
    let gen_memory = Arc::new(gen_memory);
    let codec = |store: Arc<Memory>| KvCodec::Model {
        store,
        checksum: sum,
    };
    (
        Transceiver::new(addr(0, 1), 100, codec(ctx_memory.clone())),
        Transceiver::new(addr(1, 2), 100, codec(gen_memory.clone())),
        ctx_memory,
        gen_memory,
    )
}

/// Stages request 4's K/V on the ctx side: three blocks (the third for the first
/// token) filled with `fills`, and its tokens.
fn stage(ctx_memory: &Memory, fills: [u8; 3], tokens: Vec<u32>) {
    let blocks = fills.iter().map(|&f| vec![f; 8]).collect();
    ctx_memory
        .staged
        .lock()
        .unwrap()
        .insert(ReqId(4), (blocks, tokens));
}

/// Runs one transfer of request 4: the ctx rank holds 3 blocks, the gen rank reserved
/// 0 and 5 for the prompt's 2.
fn move_model_kv(ctx: &mut Transceiver, gen_side: &mut Transceiver, corrupt: bool) {
    let id = ReqId(4);
    ctx.on_command(0, &TransferCommand::Send { id, blocks: 3 });
    gen_side.on_command(
        0,
        &TransferCommand::Receive {
            id,
            blocks: 2,
            from: Some(addr(0, 1)),
            block_ids: vec![0, 5],
        },
    );
    pump(MS, gen_side, ctx);
    for mut o in ctx.take_outgoing() {
        if corrupt
            && let PeerMessage::KvBlocks {
                payload: KvPayload::Sequence { blocks, .. },
                ..
            } = &mut o.message
        {
            blocks[1].bytes[0] ^= 1;
        }
        gen_side.on_message(2 * MS, o.message);
    }
}

#[test]
fn a_models_kv_moves_from_the_ctx_ranks_blocks_into_the_gen_ranks_with_its_tokens() {
    let (mut ctx, mut gen_side, ctx_memory, gen_memory) = model_pair(Memory::default());
    stage(&ctx_memory, [1, 2, 3], vec![10, 11, 12]);
    move_model_kv(&mut ctx, &mut gen_side, false);
    assert_eq!(gen_side.take_events(), done(4));
    let arrived = gen_memory.blocks.lock().unwrap().clone();
    assert_eq!(
        arrived,
        BTreeMap::from([(0, vec![1u8; 8]), (5, vec![2u8; 8])]),
        "the prompt's blocks, in order, into the reserved ids"
    );
    assert_eq!(
        gen_memory.tokens.lock().unwrap()[&ReqId(4)],
        vec![10, 11, 12]
    );
    pump(3 * MS, &mut gen_side, &mut ctx);
    assert_eq!(ctx.take_events(), done(4));
    assert_eq!(gen_side.stats().bytes, 16, "the store's block size");
    assert!(
        ctx_memory.staged.lock().unwrap().is_empty(),
        "the export took the staged K/V"
    );
}

#[test]
fn a_models_kv_that_changed_on_the_wire_or_cannot_be_written_fails_both_sides() {
    for refuse in [false, true] {
        let gen_memory = Memory {
            refuse_imports: refuse,
            ..Memory::default()
        };
        let (mut ctx, mut gen_side, ctx_memory, gen_memory) = model_pair(gen_memory);
        stage(&ctx_memory, [6; 3], vec![1]);
        move_model_kv(&mut ctx, &mut gen_side, !refuse);
        let events = gen_side.take_events();
        let TransferOutcome::Failed(why) = &events[0].outcome else {
            panic!("{events:?}");
        };
        let expected = if refuse {
            "could not be written: a K/V block of this model is 16 bytes"
        } else {
            "kv block 1 checksum mismatch"
        };
        assert!(why.to_string().contains(expected), "{why}");
        assert!(
            gen_memory.blocks.lock().unwrap().is_empty(),
            "nothing written"
        );
        pump(3 * MS, &mut gen_side, &mut ctx);
        assert!(matches!(
            ctx.take_events()[..],
            [TransferEvent {
                outcome: TransferOutcome::Failed(_),
                ..
            }]
        ));
    }
}

#[test]
fn a_ctx_rank_that_cannot_read_a_models_kv_fails_the_transfer_naming_why() {
    // Nothing staged on the ctx rank.
    let (mut ctx, mut gen_side, _, _) = model_pair(Memory::default());
    move_model_kv(&mut ctx, &mut gen_side, false);
    let events = ctx.take_events();
    let TransferOutcome::Failed(why) = &events[0].outcome else {
        panic!("{events:?}");
    };
    assert!(
        why.to_string()
            .contains("kv of request 4 could not be read: nothing staged for request 4"),
        "{why}"
    );
    let events = gen_side.take_events();
    assert!(matches!(events[0].outcome, TransferOutcome::Failed(_)));
}
