//! `--model DIR`: a real model behind the ranks of `sim`, `run` and `serve`.
//!
//! Loading happens once per process; every rank gets its own paged K/V pool over the
//! shared weights. On a disaggregated server each rank's transceiver reads (ctx) or
//! writes (gen) that pool through a [`KvCodec::Model`], so a gen rank decodes from the
//! K/V its ctx rank computed. What the model backend cannot run yet is refused at
//! startup, naming the server and the setting: speculative decoding, and a pool too
//! large.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use lockstep_actors::config::Role;
use lockstep_actors::group::TokenSource;
use lockstep_actors::transceiver::KvCodec;
use lockstep_gpu::kv_contents;
use lockstep_gpu::model::{Model, ModelError, SamplingParams, TextTokenizer};
use lockstep_gpu::model_tokens::{ModelSampling, ModelTokens, RankModel};

use crate::fleet::{Fleet, PlannedServer};
use crate::workload::Workload;

/// Why `--model` cannot serve this scenario.
#[derive(Debug, thiserror::Error)]
pub enum ModelBackendError {
    /// The model directory could not be loaded.
    #[error("--model {}: {source}", dir.display())]
    Load {
        /// The directory.
        dir: PathBuf,
        /// Why.
        source: ModelError,
    },
    /// A request of the workload could take more positions than the model has.
    #[error(
        "--model {}: the workload's requests take up to {longest} positions (prompt + output tokens), more than the model's {max} (max_position_embeddings): shorten workload.input_len / workload.output_len or use a model with more positions",
        dir.display()
    )]
    Positions {
        /// The directory.
        dir: PathBuf,
        /// The most positions one request can take.
        longest: u64,
        /// The model's `max_position_embeddings`.
        max: u64,
    },
    /// A server the model backend cannot run.
    #[error("--model: server {server}: {why}")]
    Unsupported {
        /// The server's name.
        server: String,
        /// What it asks for.
        why: String,
    },
}

/// A loaded model and how its ranks sample.
#[derive(Clone)]
pub struct ModelBackend {
    /// Where it was loaded from.
    pub dir: PathBuf,
    /// The model, shared by every rank of the process.
    pub model: Arc<Model>,
    /// Its tokenizer, when the directory has one (`serve` needs it).
    pub tokenizer: Option<Arc<TextTokenizer>>,
    /// Sampling of every request.
    pub sampling: ModelSampling,
}

impl std::fmt::Debug for ModelBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelBackend")
            .field("dir", &self.dir)
            .field("model", &self.model.config.summary())
            .field("sampling", &self.sampling)
            .finish()
    }
}

impl ModelBackend {
    /// Loads `dir` (config, weights, and the tokenizer when there is one).
    pub fn load(dir: &Path, params: SamplingParams, seed: u64) -> Result<Self, ModelBackendError> {
        let err = |source| ModelBackendError::Load {
            dir: dir.to_path_buf(),
            source,
        };
        let model = Model::load(dir).map_err(err)?;
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Arc::new(TextTokenizer::load(dir).map_err(err)?))
        } else {
            None
        };
        let sampling = ModelSampling { params, seed };
        sampling.check().map_err(err)?;
        Ok(ModelBackend {
            dir: dir.to_path_buf(),
            model: Arc::new(model),
            tokenizer,
            sampling,
        })
    }

    /// Refuses a fleet the backend cannot run, before anything starts.
    pub fn check(&self, fleet: &Fleet<'_>) -> Result<(), ModelBackendError> {
        for p in &fleet.servers {
            let unsupported = |why: String| ModelBackendError::Unsupported {
                server: p.config.name.clone(),
                why,
            };
            if p.sizes.draft_len > 0 {
                return Err(unsupported(format!(
                    "draft_len {}: the model backend does not run speculative decoding",
                    p.sizes.draft_len
                )));
            }
            ModelTokens::check_pool(
                &self.model,
                p.sizes.kv_blocks_per_rank,
                p.sizes.tokens_per_block,
            )
            .map_err(unsupported)?;
        }
        Ok(())
    }

    /// Refuses a workload one of whose requests could take more positions than the
    /// model has (as `serve` refuses such a request), before anything starts.
    pub fn check_workload(&self, workload: &Workload) -> Result<(), ModelBackendError> {
        check_positions(
            &self.dir,
            self.model.config.max_position_embeddings,
            workload,
        )
    }

    /// A real driver's rank of server `p`: its device thread's half of the model and,
    /// on a ctx or gen server, its transceiver's codec over the same pool.
    pub fn rank_model(&self, p: &PlannedServer<'_>) -> (RankModel, Option<KvCodec>) {
        let rank = RankModel::new(self.model.clone(), self.sampling);
        let codec = codec_of(&rank, p);
        (rank, codec)
    }

    /// The simulator's token source for server `p` (inline, every rank) and, on a ctx
    /// or gen server, each rank's transceiver codec over that rank's pool.
    pub fn sim_server(&self, p: &PlannedServer<'_>) -> (Box<dyn TokenSource>, Vec<KvCodec>) {
        let mut tokens = ModelTokens::new(self.model.clone(), self.sampling);
        let codecs = (0..p.sizes.dp as usize)
            .filter_map(|r| codec_of(tokens.rank(r), p))
            .collect();
        (Box::new(tokens), codecs)
    }
}

/// On a ctx or gen server, the transceiver's codec over `rank`'s memory: the model's own
/// K/V, checksummed (a ctx rank stages each finished prefill for it).
fn codec_of(rank: &RankModel, p: &PlannedServer<'_>) -> Option<KvCodec> {
    (p.config.role != Role::Agg).then(|| KvCodec::Model {
        store: rank.kv_store(
            p.sizes.kv_blocks_per_rank,
            p.sizes.tokens_per_block,
            p.config.role == Role::Ctx,
        ),
        checksum: kv_contents::checksum,
    })
}

/// [`ModelBackend::check_workload`] with only the model's `max_position_embeddings`
/// (the MPI launcher checks without loading the weights).
pub fn check_positions(
    dir: &Path,
    max_positions: usize,
    workload: &Workload,
) -> Result<(), ModelBackendError> {
    let longest = workload.longest_request();
    if !lockstep_gpu::model::ModelConfig::holds_positions(max_positions, longest) {
        return Err(ModelBackendError::Positions {
            dir: dir.to_path_buf(),
            longest,
            max: max_positions as u64,
        });
    }
    Ok(())
}
