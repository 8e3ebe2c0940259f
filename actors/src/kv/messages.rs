//! The KV manager's interface shaped as messages: one [`KvCommand`] through
//! [`KvManager::handle`], answered by one [`KvReply`] or a [`KvError`] that changed
//! nothing. It only dispatches to the typed methods (the executor calls those directly),
//! so tests and models that drive the manager as a stream of commands exercise the same
//! code. Reads (free blocks, a sequence's blocks, prefix matches) stay plain queries.

use crate::ids::ReqId;

use super::{Freed, KvError, KvManager, TentativeDummyKv};

/// A change asked of the KV manager.
#[derive(Debug)]
pub enum KvCommand<'a> {
    /// Start a sequence: an index slot, and the cached blocks of the prompt's prefix.
    AddSequence {
        /// The request.
        id: ReqId,
        /// Its prompt's block hashes (empty: no prefix reuse).
        block_hashes: &'a [u64],
        /// Its prompt length.
        prompt_len: u32,
    },
    /// Grow a sequence to hold `tokens` tokens (never shrinks).
    EnsureTokens {
        /// The request.
        id: ReqId,
        /// Tokens it must hold.
        tokens: u32,
    },
    /// Make the computed full prompt blocks reusable under their prefix keys.
    RegisterPrefix {
        /// The request.
        id: ReqId,
        /// Its prompt's block hashes.
        block_hashes: &'a [u64],
        /// Prompt tokens computed so far.
        computed_tokens: u32,
    },
    /// Free a sequence's slot and blocks.
    FreeSequence {
        /// The request.
        id: ReqId,
    },
    /// The dummy transaction (§6), step 1: check, then allocate tentatively.
    AllocateDummy {
        /// Tokens the dummy holds.
        tokens: u32,
    },
    /// The dummy transaction: keep the tentative dummy (the vote accepted).
    CommitDummy(TentativeDummyKv),
    /// The dummy transaction: free exactly the tentative dummy's slot and blocks (the
    /// vote vetoed). A cached block its allocation evicted stays evicted: no eviction is
    /// undone.
    RollbackDummy(TentativeDummyKv),
}

/// The KV manager's answer to a command that succeeded.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a tentative dummy in the reply must be committed or rolled back"]
pub enum KvReply {
    /// Done; nothing to report.
    Done,
    /// The sequence started; this many prompt tokens were found cached.
    Added {
        /// Reused prompt tokens (whole blocks).
        reused_tokens: u32,
    },
    /// The dummy's tentative allocation, to commit or roll back after the vote.
    Dummy(TentativeDummyKv),
}

impl KvReply {
    /// The dummy of an `AllocateDummy` reply.
    pub fn into_dummy(self) -> Option<TentativeDummyKv> {
        match self {
            KvReply::Dummy(d) => Some(d),
            KvReply::Done | KvReply::Added { .. } => None,
        }
    }

    /// The reused prompt tokens of an `AddSequence` reply (0 for any other).
    pub fn reused_tokens(&self) -> u32 {
        match self {
            KvReply::Added { reused_tokens } => *reused_tokens,
            KvReply::Done | KvReply::Dummy(_) => 0,
        }
    }
}

impl KvManager {
    /// Applies one command. An error changed nothing (except the deferral counter of a
    /// refused `AddSequence`).
    pub fn handle(&mut self, command: KvCommand<'_>) -> Result<KvReply, KvError> {
        match command {
            KvCommand::AddSequence {
                id,
                block_hashes,
                prompt_len,
            } => self
                .add_sequence(id, block_hashes, prompt_len)
                .map(|reused_tokens| KvReply::Added { reused_tokens }),
            KvCommand::EnsureTokens { id, tokens } => {
                self.ensure_tokens(id, tokens).map(|()| KvReply::Done)
            }
            KvCommand::RegisterPrefix {
                id,
                block_hashes,
                computed_tokens,
            } => self
                .register_prefix(id, block_hashes, computed_tokens)
                .map(|()| KvReply::Done),
            // As a message, freeing an unknown id is refused: a command stream that frees
            // what it never added is wrong, and the reply says so.
            KvCommand::FreeSequence { id } => match self.free_sequence(id) {
                Freed::Sequence { .. } => Ok(KvReply::Done),
                Freed::NothingHeld => Err(KvError::UnknownSequence(id)),
            },
            KvCommand::AllocateDummy { tokens } => self.allocate_dummy(tokens).map(KvReply::Dummy),
            KvCommand::CommitDummy(dummy) => {
                self.commit_dummy(dummy);
                Ok(KvReply::Done)
            }
            // Rolling back a dummy the stream already freed is still a rollback (the
            // counter moves); there is nothing left to undo, which is not a refusal.
            KvCommand::RollbackDummy(dummy) => match self.rollback_dummy(dummy) {
                Freed::Sequence { .. } | Freed::NothingHeld => Ok(KvReply::Done),
            },
        }
    }
}
