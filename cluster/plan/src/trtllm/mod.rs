//! TensorRT-LLM's YAML in and out: `lockstep import trtllm` reads an
//! `extra-llm-api-config.yml` (one aggregated server) or a disaggregated serving YAML
//! (`context_servers` / `generation_servers`, each with `num_instances` and its
//! server keys) plus the model and GPU, and writes a scenario `lockstep sim` runs;
//! `lockstep export trtllm` writes a scenario back as that YAML. Keys lockstep does not
//! model are listed, never dropped silently.
//!
//! YAML is read with `serde_norway`, a maintained fork of the archived `serde_yaml`
//! built on the maintained `unsafe-libyaml-norway` (the other fork, `serde_yaml_ng`,
//! still depends on the archived `unsafe-libyaml`).

mod export;
mod import;
mod server;

pub use export::{Exported, export};
pub use import::{ImportOptions, Imported, WorkloadOptions, import};
pub use server::ServerYaml;

use crate::model::ModelError;

/// What is wrong with a TensorRT-LLM YAML, or with a scenario to write as one.
#[derive(Debug, thiserror::Error)]
pub enum TrtllmError {
    /// A file that cannot be read or written.
    #[error("{file}: {message}")]
    Io {
        /// The file.
        file: String,
        /// The operating system's words.
        message: String,
    },
    /// Not YAML.
    #[error("{file}: not valid YAML: {message}")]
    Yaml {
        /// The file.
        file: String,
        /// The parser's words (line and column).
        message: String,
    },
    /// A key with a value of the wrong type or out of range.
    #[error("{file}: {key}: {message}")]
    Key {
        /// The file.
        file: String,
        /// The dotted key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A `*_servers` table of a role TensorRT-LLM does not have.
    #[error(
        "{file}: {key}: unknown server role; a disaggregated YAML has context_servers and generation_servers"
    )]
    UnknownRole {
        /// The file.
        file: String,
        /// The key.
        key: String,
    },
    /// No model: neither `model:` resolving to a `config.json` nor `--hf-config`.
    #[error("{file}: {why}")]
    MissingModel {
        /// The file.
        file: String,
        /// What was looked for.
        why: String,
    },
    /// The model and GPU do not make a deployment for a server.
    #[error("{file}: {server}: {source}")]
    Model {
        /// The file.
        file: String,
        /// The server (its YAML key).
        server: String,
        /// What is wrong (boxed: a model error is large and errors are rare).
        source: Box<ModelError>,
    },
    /// The scenario to export cannot be loaded.
    #[error(transparent)]
    Scenario(Box<crate::scenario::ScenarioError>),
    /// A scenario TensorRT-LLM's YAML cannot describe.
    #[error("export trtllm: {0}")]
    Export(String),
}

impl From<crate::scenario::ScenarioError> for TrtllmError {
    fn from(e: crate::scenario::ScenarioError) -> Self {
        TrtllmError::Scenario(Box::new(e))
    }
}
