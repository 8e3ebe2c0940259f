//! Two KV transceivers, a ctx side and a gen side, driven only through their message
//! interface (`handle`, `handle_timeout`, `poll_event`, `poll_transmit`, `poll_timeout`;
//! mechanisms.md §8). The test is the network: it carries each transmitted message to
//! its addressee by hand, and can lose, corrupt or delay it.

use lockstep_actors::ids::{RankId, ReqId};
use lockstep_actors::transceiver::{
    KvBlock, KvCodec, KvPayload, Outgoing, PeerMessage, Transceiver, TransceiverIn,
};
use lockstep_actors::vocab::KvAddress;
use lockstep_actors::vocab::{
    AbortCause, Failure, TransferCommand, TransferEvent, TransferFailure, TransferOutcome,
};

const MS: u64 = 1_000_000;
const TIMEOUT_MS: u64 = 100;
/// How long the ctx side holds KV nobody has pulled.
const PULL_TIMEOUT_MS: u64 = 250;
const BLOCK_BYTES: usize = 32;

/// What the ctx rank's KV holds: block `index` of `request`.
fn fill(request: u64, index: u32, out: &mut [u8]) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = (request as u8).wrapping_mul(7) ^ (index as u8).wrapping_mul(13) ^ (i as u8);
    }
}

/// FNV-1a.
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

const CODEC: KvCodec = KvCodec::Real {
    block_bytes: BLOCK_BYTES,
    model_block_bytes: BLOCK_BYTES as u64,
    fill,
    checksum,
};

const CTX: KvAddress = KvAddress {
    server: 0,
    rank: RankId(1),
};
const GEN: KvAddress = KvAddress {
    server: 1,
    rank: RankId(0),
};

fn pair() -> (Transceiver, Transceiver) {
    (
        Transceiver::new(CTX, TIMEOUT_MS, CODEC).with_pull_timeout_ms(PULL_TIMEOUT_MS),
        Transceiver::new(GEN, TIMEOUT_MS, CODEC).with_pull_timeout_ms(PULL_TIMEOUT_MS),
    )
}

fn send(id: u64, blocks: u32) -> TransceiverIn {
    TransceiverIn::Command(TransferCommand::Send {
        id: ReqId(id),
        blocks,
    })
}

fn receive(id: u64, blocks: u32) -> TransceiverIn {
    TransceiverIn::Command(TransferCommand::Receive {
        id: ReqId(id),
        blocks,
        from: Some(CTX),
        block_ids: vec![],
    })
}

fn abort(id: u64, cause: AbortCause) -> TransceiverIn {
    TransceiverIn::Command(TransferCommand::Abort {
        id: ReqId(id),
        cause,
    })
}

/// The abort of a request that failed with `why` on its executor's side.
fn failed_there(why: &str) -> AbortCause {
    AbortCause::Failed(Box::new(Failure::Deadlocked(why.into())))
}

/// Everything `side` has to transmit, in order.
fn transmitted(side: &mut Transceiver) -> Vec<Outgoing> {
    std::iter::from_fn(|| side.poll_transmit()).collect()
}

/// Everything `side` has for its executor, in order.
fn events(side: &mut Transceiver) -> Vec<TransferEvent> {
    std::iter::from_fn(|| side.poll_event()).collect()
}

/// Delivers `out` to `to` (which must be the addressee) at `now`.
fn deliver(now: u64, out: Vec<Outgoing>, to: &mut Transceiver) {
    for o in out {
        assert_eq!(o.to, to.address(), "{:?} misaddressed", o.message);
        to.handle(now, TransceiverIn::Message(o.message));
    }
}

fn done(id: u64) -> Vec<TransferEvent> {
    vec![TransferEvent {
        id: ReqId(id),
        outcome: TransferOutcome::Done,
    }]
}

fn failed(id: u64, reason: TransferFailure) -> Vec<TransferEvent> {
    vec![TransferEvent {
        id: ReqId(id),
        outcome: TransferOutcome::Failed(reason),
    }]
}

const TIMED_OUT: TransferFailure = TransferFailure::TimedOut { after_ms: 100 };
const NOT_PULLED: TransferFailure = TransferFailure::NotPulled { within_ms: 250 };

/// The blocks of a `KvBlocks` message, in order.
fn blocks_of(out: &[Outgoing]) -> &[KvBlock] {
    match out {
        [
            Outgoing {
                message:
                    PeerMessage::KvBlocks {
                        payload: KvPayload::Blocks(blocks),
                        ..
                    },
                ..
            },
        ] => blocks,
        other => panic!("expected one KvBlocks message, got {other:?}"),
    }
}

#[test]
fn a_clean_transfer_completes_on_both_sides_with_matching_checksums() {
    for pull_first in [false, true] {
        let (mut ctx, mut gen_side) = pair();
        if !pull_first {
            ctx.handle(0, send(5, 3));
            assert_eq!(transmitted(&mut ctx), vec![], "nobody has pulled yet");
            assert_eq!(
                ctx.poll_timeout(),
                Some(PULL_TIMEOUT_MS * MS),
                "unpulled: held up to the pull timeout"
            );
        }
        gen_side.handle(MS, receive(5, 3));
        assert_eq!(gen_side.poll_timeout(), Some((1 + TIMEOUT_MS) * MS));
        let pull = transmitted(&mut gen_side);
        assert_eq!(
            pull,
            vec![Outgoing {
                to: CTX,
                message: PeerMessage::Pull {
                    id: ReqId(5),
                    puller: GEN,
                    blocks: 3,
                },
            }]
        );
        deliver(2 * MS, pull, &mut ctx);
        if pull_first {
            assert_eq!(transmitted(&mut ctx), vec![], "no send command yet");
            assert_eq!(ctx.poll_timeout(), None, "a pull alone sets no deadline");
            ctx.handle(3 * MS, send(5, 3));
        }
        let kv = transmitted(&mut ctx);
        assert_eq!(kv.len(), 1);
        assert_eq!(kv[0].to, GEN);
        let blocks = blocks_of(&kv);
        assert_eq!(blocks.len(), 3);
        for (i, b) in blocks.iter().enumerate() {
            let mut want = vec![0u8; BLOCK_BYTES];
            fill(5, i as u32, &mut want);
            assert_eq!(b.index, i as u32);
            assert_eq!(b.bytes, want, "block {i} carries the ctx rank's KV");
            assert_eq!(b.checksum, checksum(&want), "block {i}'s checksum");
        }
        assert_eq!(kv[0].message.wire_bytes(), 64 + 3 * BLOCK_BYTES as u64);
        assert_eq!(events(&mut ctx), vec![], "the ctx side waits for the ack");

        deliver(4 * MS, kv, &mut gen_side);
        assert_eq!(events(&mut gen_side), done(5));
        let ack = transmitted(&mut gen_side);
        assert_eq!(
            ack,
            vec![Outgoing {
                to: CTX,
                message: PeerMessage::Ack { id: ReqId(5) },
            }]
        );
        deliver(5 * MS, ack, &mut ctx);
        assert_eq!(events(&mut ctx), done(5));
        for side in [&mut ctx, &mut gen_side] {
            assert_eq!(side.stats().completed, 1);
            assert_eq!(side.stats().failed + side.stats().timed_out, 0);
            assert_eq!(side.stats().bytes, 3 * BLOCK_BYTES as u64);
            assert_eq!(side.in_flight(), 0);
            assert_eq!(side.poll_timeout(), None);
            assert_eq!(side.poll_transmit(), None);
        }
        assert_eq!(gen_side.stats().durations_ns, vec![3 * MS]);
        // The ctx side's transfer starts when it has both the pull and the command.
        let ctx_started = if pull_first { 3 } else { 2 };
        assert_eq!(ctx.stats().durations_ns, vec![(5 - ctx_started) * MS]);

        // Nothing fires later: the deadlines went with the transfer.
        ctx.handle_timeout(1_000 * MS);
        gen_side.handle_timeout(1_000 * MS);
        assert_eq!(events(&mut ctx), vec![]);
        assert_eq!(events(&mut gen_side), vec![]);
    }
}

#[test]
fn a_lost_pull_times_out_on_each_side_exactly_at_its_announced_deadline() {
    let (mut ctx, mut gen_side) = pair();
    ctx.handle(0, send(7, 2));
    gen_side.handle(10 * MS, receive(7, 2));
    let lost = transmitted(&mut gen_side);
    assert_eq!(lost.len(), 1, "the pull, which the network loses");

    let ctx_deadline = ctx.poll_timeout().expect("the send is open");
    let gen_deadline = gen_side.poll_timeout().expect("the receive is open");
    assert_eq!(gen_deadline, (10 + TIMEOUT_MS) * MS, "the transfer timeout");
    assert_eq!(
        ctx_deadline,
        PULL_TIMEOUT_MS * MS,
        "never pulled: the pull timeout"
    );

    // One nanosecond early: nothing on either side.
    ctx.handle_timeout(gen_deadline - 1);
    gen_side.handle_timeout(gen_deadline - 1);
    assert_eq!(events(&mut ctx), vec![]);
    assert_eq!(events(&mut gen_side), vec![]);
    assert_eq!(ctx.in_flight() + gen_side.in_flight(), 2);

    // The gen side's deadline: it fails and tells the ctx side, which the network
    // loses too.
    gen_side.handle_timeout(gen_deadline);
    assert_eq!(events(&mut gen_side), failed(7, TIMED_OUT));
    let told = transmitted(&mut gen_side);
    assert_eq!(
        told,
        vec![Outgoing {
            to: CTX,
            message: PeerMessage::Abort {
                id: ReqId(7),
                cause: TIMED_OUT,
            },
        }]
    );
    assert_eq!(gen_side.poll_timeout(), None);

    // The ctx side holds the KV until its own deadline, then fails; it never heard of
    // the puller, so it tells nobody.
    ctx.handle_timeout(ctx_deadline - 1);
    assert_eq!(events(&mut ctx), vec![]);
    ctx.handle_timeout(ctx_deadline);
    assert_eq!(events(&mut ctx), failed(7, NOT_PULLED));
    assert_eq!(transmitted(&mut ctx), vec![]);
    assert_eq!(ctx.poll_timeout(), None);
    assert_eq!(ctx.stats().timed_out, 1);

    // The abort turns up late: it changes nothing there.
    deliver(ctx_deadline + MS, told, &mut ctx);
    assert_eq!(events(&mut ctx), vec![]);
    assert_eq!(ctx.stats().failed + ctx.stats().timed_out, 1);

    // The lost pull turns up late: the ctx side answers it with an abort at once.
    deliver(ctx_deadline + 2 * MS, lost, &mut ctx);
    assert_eq!(
        transmitted(&mut ctx),
        vec![Outgoing {
            to: GEN,
            message: PeerMessage::Abort {
                id: ReqId(7),
                cause: NOT_PULLED,
            },
        }]
    );
    assert_eq!((ctx.in_flight(), gen_side.in_flight()), (0, 0));
}

#[test]
fn lost_blocks_fail_the_gen_side_at_its_deadline_and_its_abort_fails_the_ctx_side() {
    let (mut ctx, mut gen_side) = pair();
    gen_side.handle(0, receive(8, 2));
    deliver(MS, transmitted(&mut gen_side), &mut ctx);
    ctx.handle(20 * MS, send(8, 2));
    let lost = transmitted(&mut ctx);
    assert_eq!(
        blocks_of(&lost).len(),
        2,
        "the blocks, which the network loses"
    );

    // The gen side's deadline (100 ms) comes before the ctx side's (120 ms).
    assert_eq!(gen_side.poll_timeout(), Some(TIMEOUT_MS * MS));
    assert_eq!(ctx.poll_timeout(), Some((20 + TIMEOUT_MS) * MS));
    gen_side.handle_timeout(TIMEOUT_MS * MS - 1);
    assert_eq!(events(&mut gen_side), vec![]);
    gen_side.handle_timeout(TIMEOUT_MS * MS);
    assert_eq!(events(&mut gen_side), failed(8, TIMED_OUT));
    assert_eq!(gen_side.stats().timed_out, 1);

    // Its abort reaches the ctx side before the ctx deadline and ends the send there.
    deliver(TIMEOUT_MS * MS, transmitted(&mut gen_side), &mut ctx);
    assert_eq!(events(&mut ctx), failed(8, TIMED_OUT));
    assert_eq!(
        ctx.stats().timed_out,
        0,
        "failed by the peer, not by its clock"
    );
    assert_eq!(ctx.stats().failed, 1);
    assert_eq!(ctx.poll_timeout(), None);

    // The blocks arrive after all: ignored, no ack.
    deliver(TIMEOUT_MS * MS + 1, lost, &mut gen_side);
    assert_eq!(events(&mut gen_side), vec![]);
    assert_eq!(transmitted(&mut gen_side), vec![]);
    assert_eq!(gen_side.stats().completed, 0);
}

#[test]
fn a_lost_ack_times_the_ctx_side_out_after_the_gen_side_succeeded() {
    let (mut ctx, mut gen_side) = pair();
    ctx.handle(0, send(9, 1));
    gen_side.handle(0, receive(9, 1));
    deliver(0, transmitted(&mut gen_side), &mut ctx);
    deliver(MS, transmitted(&mut ctx), &mut gen_side);
    assert_eq!(events(&mut gen_side), done(9));
    let lost_ack = transmitted(&mut gen_side);
    assert_eq!(lost_ack.len(), 1);

    let deadline = ctx.poll_timeout().expect("still awaiting the ack");
    assert_eq!(deadline, TIMEOUT_MS * MS);
    ctx.handle_timeout(deadline - 1);
    assert_eq!(events(&mut ctx), vec![]);
    ctx.handle_timeout(deadline);
    assert_eq!(events(&mut ctx), failed(9, TIMED_OUT));
    // It tells the gen side, which finished already and ignores it.
    deliver(deadline, transmitted(&mut ctx), &mut gen_side);
    assert_eq!(events(&mut gen_side), vec![]);
    assert_eq!(gen_side.stats().completed, 1);
    // The ack, late, changes nothing either.
    deliver(deadline + 1, lost_ack, &mut ctx);
    assert_eq!(events(&mut ctx), vec![]);
    assert_eq!(ctx.stats().completed, 0);
}

#[test]
fn an_abort_command_on_the_gen_side_ends_the_transfer_on_both_sides() {
    let (mut ctx, mut gen_side) = pair();
    ctx.handle(0, send(6, 2));
    gen_side.handle(0, receive(6, 2));
    deliver(0, transmitted(&mut gen_side), &mut ctx);
    let in_transit = transmitted(&mut ctx);

    gen_side.handle(MS, abort(6, AbortCause::Cancelled));
    assert_eq!(
        events(&mut gen_side),
        vec![],
        "its executor already dropped it"
    );
    assert_eq!(gen_side.in_flight(), 0);
    assert_eq!(gen_side.poll_timeout(), None);
    let told = transmitted(&mut gen_side);
    assert_eq!(
        told,
        vec![Outgoing {
            to: CTX,
            message: PeerMessage::Abort {
                id: ReqId(6),
                cause: TransferFailure::Aborted(AbortCause::Cancelled),
            },
        }]
    );
    // The blocks in transit arrive: ignored.
    deliver(2 * MS, in_transit, &mut gen_side);
    assert_eq!(events(&mut gen_side), vec![]);
    assert_eq!(transmitted(&mut gen_side), vec![]);

    deliver(2 * MS, told, &mut ctx);
    assert_eq!(
        events(&mut ctx),
        failed(6, TransferFailure::Aborted(AbortCause::Cancelled))
    );
    assert_eq!(ctx.in_flight(), 0);
    assert_eq!(ctx.poll_timeout(), None);
    // No deadline fires later on either side.
    ctx.handle_timeout(500 * MS);
    gen_side.handle_timeout(500 * MS);
    assert_eq!(events(&mut ctx), vec![]);
    assert_eq!(events(&mut gen_side), vec![]);
}

#[test]
fn an_abort_command_on_the_ctx_side_ends_the_transfer_on_both_sides() {
    let (mut ctx, mut gen_side) = pair();
    gen_side.handle(0, receive(3, 1));
    deliver(0, transmitted(&mut gen_side), &mut ctx);
    // Pulled, but the send command never came: the ctx executor drops the request.
    ctx.handle(MS, abort(3, failed_there("server failed")));
    assert_eq!(events(&mut ctx), vec![]);
    assert_eq!(ctx.in_flight(), 0);
    deliver(2 * MS, transmitted(&mut ctx), &mut gen_side);
    assert_eq!(
        events(&mut gen_side),
        failed(3, TransferFailure::Aborted(failed_there("server failed")))
    );
    assert_eq!((gen_side.in_flight(), gen_side.poll_timeout()), (0, None));
    // A send command for it afterwards starts nothing.
    ctx.handle(3 * MS, send(3, 1));
    assert_eq!(transmitted(&mut ctx), vec![]);
    assert_eq!(ctx.poll_timeout(), None);
}

#[test]
fn an_abort_that_overtakes_the_send_command_fails_the_send_when_it_comes() {
    let (mut ctx, mut gen_side) = pair();
    gen_side.handle(0, receive(4, 1));
    let _lost_pull = transmitted(&mut gen_side);
    gen_side.handle(MS, abort(4, AbortCause::Cancelled));
    deliver(MS, transmitted(&mut gen_side), &mut ctx);
    assert_eq!(events(&mut ctx), vec![]);
    ctx.handle(2 * MS, send(4, 1));
    assert_eq!(
        events(&mut ctx),
        failed(4, TransferFailure::Aborted(AbortCause::Cancelled))
    );
    assert_eq!(transmitted(&mut ctx), vec![]);
    assert_eq!(ctx.in_flight(), 0);
}

#[test]
fn a_corrupted_block_fails_both_sides_naming_the_block() {
    let (mut ctx, mut gen_side) = pair();
    ctx.handle(0, send(11, 3));
    gen_side.handle(0, receive(11, 3));
    deliver(0, transmitted(&mut gen_side), &mut ctx);
    let mut kv = transmitted(&mut ctx);
    if let PeerMessage::KvBlocks {
        payload: KvPayload::Blocks(blocks),
        ..
    } = &mut kv[0].message
    {
        blocks[2].bytes[0] ^= 0x5A;
    }
    deliver(MS, kv, &mut gen_side);
    assert_eq!(
        events(&mut gen_side),
        failed(11, TransferFailure::Checksum { block: 2 })
    );
    assert_eq!(gen_side.stats().checksum_failures, 1);
    assert_eq!(gen_side.stats().completed, 0);
    deliver(MS, transmitted(&mut gen_side), &mut ctx);
    assert_eq!(
        events(&mut ctx),
        failed(11, TransferFailure::Checksum { block: 2 })
    );
    assert_eq!((ctx.in_flight(), gen_side.in_flight()), (0, 0));
}

#[test]
fn a_pull_for_more_blocks_than_the_ctx_side_holds_fails_both_sides() {
    let (mut ctx, mut gen_side) = pair();
    ctx.handle(0, send(12, 2));
    gen_side.handle(0, receive(12, 3));
    deliver(0, transmitted(&mut gen_side), &mut ctx);
    let why = TransferFailure::Mismatch("gen rank reserved 3 KV blocks, ctx rank holds 2".into());
    assert_eq!(events(&mut ctx), failed(12, why.clone()));
    deliver(0, transmitted(&mut ctx), &mut gen_side);
    assert_eq!(events(&mut gen_side), failed(12, why));
}

#[test]
fn a_release_from_the_front_frees_the_send_without_any_pull() {
    let (mut ctx, _) = pair();
    ctx.handle(
        0,
        TransceiverIn::Message(PeerMessage::Release { id: ReqId(2) }),
    );
    assert_eq!(events(&mut ctx), vec![]);
    ctx.handle(MS, send(2, 4));
    assert_eq!(events(&mut ctx), done(2));
    assert_eq!(transmitted(&mut ctx), vec![]);
    assert_eq!(ctx.stats().released, 1);
    assert_eq!(ctx.stats().completed, 0);
    assert_eq!(ctx.poll_timeout(), None);
}

#[test]
fn a_receive_without_a_kv_location_fails_at_once_and_pulls_nothing() {
    let (_, mut gen_side) = pair();
    gen_side.handle(
        0,
        TransceiverIn::Command(TransferCommand::Receive {
            id: ReqId(1),
            blocks: 1,
            from: None,
            block_ids: vec![],
        }),
    );
    assert_eq!(
        events(&mut gen_side),
        failed(
            1,
            TransferFailure::Mismatch("no KV location known for request 1".into())
        )
    );
    assert_eq!(transmitted(&mut gen_side), vec![]);
    assert_eq!(gen_side.poll_timeout(), None);
}

#[test]
fn poll_timeout_reports_the_earliest_open_deadline_as_transfers_come_and_go() {
    let (mut ctx, mut gen_side) = pair();
    assert_eq!(ctx.poll_timeout(), None);
    ctx.handle(30 * MS, send(1, 1));
    ctx.handle(10 * MS, send(2, 1));
    ctx.handle(20 * MS, send(3, 1));
    assert_eq!(
        ctx.poll_timeout(),
        Some(260 * MS),
        "unpulled: the pull timeout"
    );
    // Request 1 is pulled: its deadline becomes the transfer timeout from the pull.
    gen_side.handle(45 * MS, receive(1, 1));
    deliver(45 * MS, transmitted(&mut gen_side), &mut ctx);
    let lost = transmitted(&mut ctx);
    assert_eq!(lost.len(), 1, "request 1's blocks, which the network loses");
    assert_eq!(ctx.poll_timeout(), Some(145 * MS));
    // Request 2 completes.
    gen_side.handle(40 * MS, receive(2, 1));
    deliver(40 * MS, transmitted(&mut gen_side), &mut ctx);
    deliver(41 * MS, transmitted(&mut ctx), &mut gen_side);
    deliver(42 * MS, transmitted(&mut gen_side), &mut ctx);
    assert_eq!(events(&mut ctx), done(2));
    // Firing request 1's leaves request 3's.
    ctx.handle_timeout(145 * MS);
    assert_eq!(events(&mut ctx), failed(1, TIMED_OUT));
    assert_eq!(ctx.poll_timeout(), Some(270 * MS));
    ctx.handle_timeout(270 * MS);
    assert_eq!(events(&mut ctx), failed(3, NOT_PULLED));
    assert_eq!(ctx.poll_timeout(), None);
}

#[test]
fn a_modeled_transfer_carries_sizes_only_and_completes_on_both_sides() {
    let codec = KvCodec::Modeled { block_bytes: 4096 };
    let mut ctx = Transceiver::new(CTX, TIMEOUT_MS, codec.clone());
    let mut gen_side = Transceiver::new(GEN, TIMEOUT_MS, codec);
    ctx.handle(0, send(13, 5));
    gen_side.handle(0, receive(13, 5));
    deliver(0, transmitted(&mut gen_side), &mut ctx);
    let kv = transmitted(&mut ctx);
    assert_eq!(
        kv,
        vec![Outgoing {
            to: GEN,
            message: PeerMessage::KvBlocks {
                id: ReqId(13),
                payload: KvPayload::Modeled {
                    blocks: 5,
                    bytes: 5 * 4096,
                },
            },
        }]
    );
    deliver(MS, kv, &mut gen_side);
    assert_eq!(events(&mut gen_side), done(13));
    deliver(MS, transmitted(&mut gen_side), &mut ctx);
    assert_eq!(events(&mut ctx), done(13));
    assert_eq!(ctx.stats().bytes, 5 * 4096);
}
