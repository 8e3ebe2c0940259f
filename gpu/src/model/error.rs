//! Everything that can go wrong loading or running the CPU model, as one error type.

use std::path::PathBuf;

/// An error of the CPU model backend. Errors about a model directory name the file (and
/// the tensor, where one is at fault) so a user can fix the directory without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON, or lacks a field the model needs.
    #[error("{}: {message}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// `config.json` names an architecture this backend does not implement.
    #[error(
        "{}: unsupported architecture {found:?} (supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)",
        path.display()
    )]
    UnsupportedArchitecture {
        /// The config file.
        path: PathBuf,
        /// The architecture it names.
        found: String,
    },
    /// `config.json` holds values no model can have (zero heads, heads not dividing, ...).
    #[error("{}: invalid config: {message}", path.display())]
    InvalidConfig {
        /// The config file.
        path: PathBuf,
        /// What is inconsistent.
        message: String,
    },
    /// A safetensors file could not be parsed.
    #[error("{}: not a valid safetensors file: {message}", path.display())]
    Safetensors {
        /// The weights file.
        path: PathBuf,
        /// The parser's reason.
        message: String,
    },
    /// A tensor the architecture needs is not in the weights.
    #[error("{}: missing tensor {tensor}", path.display())]
    MissingTensor {
        /// The weights file (or the index that should have listed the tensor).
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
    },
    /// A tensor has a shape other than the config implies.
    #[error("{}: tensor {tensor} has shape {found:?}, config.json implies {expected:?}", path.display())]
    ShapeMismatch {
        /// The weights file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor is stored in an element type this backend does not read.
    #[error("{}: tensor {tensor} has unsupported dtype {dtype} (supported: F32, F16, BF16)", path.display())]
    UnsupportedDtype {
        /// The weights file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The dtype in the file.
        dtype: String,
    },
    /// `tokenizer.json` could not be loaded, or text could not be encoded or decoded.
    #[error("{}: tokenizer: {message}", path.display())]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokenizers crate's reason.
        message: String,
    },
    /// The chat template does not compile, or a conversation makes it fail.
    #[error("{}: chat template: {message}", path.display())]
    ChatTemplate {
        /// The file the template came from.
        path: PathBuf,
        /// What went wrong (the template's own message when it raised one).
        message: String,
    },
    /// A forward was asked for something the cache or the model cannot hold.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// Sampling parameters out of range (a negative temperature, top-p outside (0, 1]).
    #[error("invalid sampling parameters: {0}")]
    InvalidSampling(String),
    /// A tensor operation failed (a bug, or a shape the checks above missed).
    #[error("tensor operation: {0}")]
    Tensor(#[from] candle_core::Error),
}

/// The result of the model backend's operations.
pub type Result<T> = std::result::Result<T, ModelError>;
