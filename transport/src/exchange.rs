//! Runs one step of the iteration protocol's collectives over any [`Collective`]: the
//! one place an [`Exchange`] becomes a transport call (its kind follows from its
//! phase), so hosts never build a tag or encode a payload by hand.

use lockstep_actors::executor::{
    BatchVote, Exchange, FetchBatch, Input, PrefixMatches, RankResponses, RankState,
    ResponsesAndStatus, TransferStatus,
};
use lockstep_actors::vocab::PadIntent;

use crate::collective::{Collective, CollectiveError};

/// The result of an exchange, owned, to hand back to the executor with
/// [`Exchanged::input`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exchanged {
    /// Every rank's state.
    States(Vec<RankState>),
    /// Rank 0's ingress read.
    Fetch(FetchBatch),
    /// Every rank's prefix matches.
    PrefixMatches(Vec<PrefixMatches>),
    /// The combined intent.
    PadIntent(PadIntent),
    /// Every rank's vote.
    Votes(Vec<BatchVote>),
    /// Every rank's responses at rank 0 (`None` elsewhere).
    Responses(Option<Vec<RankResponses>>),
    /// Every rank's transfer status, and every rank's responses at rank 0 (`None`
    /// elsewhere: the other ranks drop theirs).
    TransferStatus {
        /// Every rank's transfer status.
        status: Vec<TransferStatus>,
        /// Every rank's responses, at rank 0.
        responses: Option<Vec<RankResponses>>,
    },
}

impl Exchanged {
    /// The executor's input for this result.
    pub fn input(&self) -> Input<'_> {
        match self {
            Exchanged::States(v) => Input::States(v),
            Exchanged::Fetch(f) => Input::Fetch(f),
            Exchanged::PrefixMatches(v) => Input::PrefixMatches(v),
            Exchanged::PadIntent(i) => Input::PadIntent(*i),
            Exchanged::Votes(v) => Input::Votes(v),
            Exchanged::Responses(_) => Input::ResponsesGathered,
            Exchanged::TransferStatus { status, .. } => Input::TransferStatus(status),
        }
    }
}

/// Runs `x` over `c`: allgather, broadcast from rank 0, allreduce MAX or gather to rank
/// 0, with the executor's tag. The responses move out of the executor's buffer (it
/// clears them afterwards anyway).
pub fn exchange<C: Collective + ?Sized>(
    c: &mut C,
    x: Exchange<'_>,
) -> Result<Exchanged, CollectiveError> {
    Ok(match x {
        Exchange::States { tag, mine } => Exchanged::States(c.allgather(tag, mine)?),
        Exchange::Fetch { tag, mine } => Exchanged::Fetch(c.broadcast(tag, 0, mine)?),
        Exchange::PrefixMatches { tag, mine } => Exchanged::PrefixMatches(c.allgather(tag, mine)?),
        Exchange::PadIntent { tag, mine } => {
            Exchanged::PadIntent(PadIntent::from_u64(c.allreduce_max(tag, mine.as_u64())?))
        }
        Exchange::Votes { tag, mine } => Exchanged::Votes(c.allgather(tag, mine)?),
        Exchange::Responses { tag, mine } => Exchanged::Responses(c.gather(tag, 0, &*mine)?),
        Exchange::TransferStatus {
            tag,
            mine,
            responses,
        } => {
            let both = ResponsesAndStatus {
                responses: RankResponses {
                    rank: responses.rank,
                    responses: std::mem::take(&mut responses.responses),
                },
                status: mine.clone(),
            };
            let all = c.allgather(tag, &both)?;
            let at_root = c.rank() == 0;
            let (responses, status): (Vec<RankResponses>, Vec<TransferStatus>) =
                all.into_iter().map(|b| (b.responses, b.status)).unzip();
            Exchanged::TransferStatus {
                status,
                responses: at_root.then_some(responses),
            }
        }
    })
}
