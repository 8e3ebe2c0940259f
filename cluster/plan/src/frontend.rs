//! `[frontend]`: the serving front door in front of the executor — the HTTP server that
//! parses each request, tokenizes its prompt and hands it to the executor's queue, and
//! that detokenizes and streams every output token back. Its processes serve one job at
//! a time, so thousands of clients connecting at once reach the executor spaced by its
//! service time, not all at once (the host that runs it: `lockstep_hosts::frontend`).
//!
//! A preset gives every number; a key set beside it overrides that one number.

use serde::{Deserialize, Serialize};

/// Where a preset's figures come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FrontendPreset {
    /// The Python front doors users run (TensorRT-LLM's `trtllm-serve`, vLLM's API
    /// server at its default `--api-server-count 1`): one process; the figures are an
    /// estimate, each one's reasoning at [`FrontendCosts::PYTHON`].
    #[default]
    Python,
    /// lockstep's own `lockstep serve` with `--model` (actix-web, the model's
    /// tokenizer), measured: [`FrontendCosts::SERVE`].
    Serve,
    /// No front door: requests reach the executor the instant they are sent, tokens the
    /// client the instant they are made.
    None,
}

/// The front door's costs, resolved from a preset and its overrides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FrontendCosts {
    /// Processes serving jobs (each one job at a time); a request and its output tokens
    /// stay on the process that took it, as a connection does.
    pub processes: u32,
    /// A request's fixed cost (µs): HTTP parse, validation, the hand-off to the
    /// executor's queue.
    pub request_us: f64,
    /// Cost per prompt token (ns): tokenization.
    pub prompt_token_ns: f64,
    /// Cost per output token (ns): detokenization and streaming it to the client; it
    /// competes with new requests for the same process.
    pub output_token_ns: f64,
}

impl FrontendCosts {
    /// The Python front doors (an estimate, not a measurement of them):
    /// - one process: `trtllm-serve` runs one; vLLM's API server defaults to one
    ///   (`--api-server-count`, added because one process limits high-concurrency
    ///   serving);
    /// - 500 µs a request: a FastAPI/pydantic request parse and validation, the asyncio
    ///   hand-off and the pickled message to the engine's queue, each a few hundred µs
    ///   of Python at most;
    /// - 100 ns a prompt token: Hugging Face's `tokenizers` (Rust, what both call)
    ///   encodes on the order of a million tokens a second on one core, and the front
    ///   doors run it off their event loop on several threads, so an 8k-token prompt
    ///   costs under a millisecond;
    /// - 10 µs an output token: incremental detokenization and one server-sent event
    ///   in Python per token.
    ///
    /// An 8k-token request's service is then about 1.3 ms. What checks the estimate is
    /// not a measurement of the front doors' own time but what it predicts: with it the
    /// ladder GPU runs measured at 512–4,096 clients appears (README, "What the fixed
    /// control plane changes"); with a free front door it does not.
    pub const PYTHON: FrontendCosts = FrontendCosts {
        processes: 1,
        request_us: 500.0,
        prompt_token_ns: 100.0,
        output_token_ns: 10_000.0,
    };

    /// `lockstep serve --model` as its own front-door accounting measured it
    /// (`/metrics`: `lockstep_front_service_seconds`, `lockstep_front_output_seconds`;
    /// `scripts/bench-serve.sh frontend`, one client at a time, on a 2-core machine,
    /// 2026-12-04; README "The serving front door" has the run):
    /// - two processes: serve's default `--workers 2`;
    /// - 214 µs a request: a chat request's read, parse, template and hand-off (38 µs
    ///   for a request of token ids without a model);
    /// - 858 ns a prompt token: the tiny random model's tokenizer (`lockstep model
    ///   init`), a line fitted through prompts of 164 and 2,453 tokens;
    /// - 22.7 µs an output token: detokenize, look for stop strings, build the event.
    pub const SERVE: FrontendCosts = FrontendCosts {
        processes: 2,
        request_us: 214.0,
        prompt_token_ns: 858.0,
        output_token_ns: 22_700.0,
    };

    /// No cost at all.
    pub const NONE: FrontendCosts = FrontendCosts {
        processes: 1,
        request_us: 0.0,
        prompt_token_ns: 0.0,
        output_token_ns: 0.0,
    };

    /// A request's service (ns) for a prompt of `prompt_len` tokens.
    pub fn request_ns(&self, prompt_len: u32) -> f64 {
        self.request_us * 1_000.0 + self.prompt_token_ns * f64::from(prompt_len)
    }

    /// The service (ns) of `tokens` output tokens.
    pub fn output_ns(&self, tokens: u64) -> f64 {
        self.output_token_ns * tokens as f64
    }
}

/// `[frontend]` as written: a preset, and any number it overrides.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, try_from = "RawFrontend")]
pub struct FrontendConfig {
    /// The preset (default `python`).
    #[serde(default)]
    pub preset: FrontendPreset,
    /// Overrides `processes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processes: Option<u32>,
    /// Overrides `request_us`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_us: Option<f64>,
    /// Overrides `prompt_token_ns`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ns: Option<f64>,
    /// Overrides `output_token_ns`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_token_ns: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFrontend {
    #[serde(default)]
    preset: FrontendPreset,
    #[serde(default)]
    processes: Option<u32>,
    #[serde(default)]
    request_us: Option<f64>,
    #[serde(default)]
    prompt_token_ns: Option<f64>,
    #[serde(default)]
    output_token_ns: Option<f64>,
}

/// A `[frontend]` value out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("frontend.{field}: {why}, got {value}")]
pub struct FrontendError {
    /// The key.
    pub field: &'static str,
    /// The value given.
    pub value: String,
    /// What it must be.
    pub why: &'static str,
}

impl TryFrom<RawFrontend> for FrontendConfig {
    type Error = FrontendError;

    fn try_from(raw: RawFrontend) -> Result<FrontendConfig, FrontendError> {
        if raw.processes == Some(0) {
            return Err(FrontendError {
                field: "processes",
                value: "0".into(),
                why: "a front door needs at least one process",
            });
        }
        for (field, v) in [
            ("request_us", raw.request_us),
            ("prompt_token_ns", raw.prompt_token_ns),
            ("output_token_ns", raw.output_token_ns),
        ] {
            if let Some(v) = v
                && !(v.is_finite() && v >= 0.0)
            {
                return Err(FrontendError {
                    field,
                    value: v.to_string(),
                    why: "must be a finite number >= 0",
                });
            }
        }
        Ok(FrontendConfig {
            preset: raw.preset,
            processes: raw.processes,
            request_us: raw.request_us,
            prompt_token_ns: raw.prompt_token_ns,
            output_token_ns: raw.output_token_ns,
        })
    }
}

impl FrontendConfig {
    /// The preset's figures with the overrides applied.
    pub fn costs(&self) -> FrontendCosts {
        let base = match self.preset {
            FrontendPreset::Python => FrontendCosts::PYTHON,
            FrontendPreset::Serve => FrontendCosts::SERVE,
            FrontendPreset::None => FrontendCosts::NONE,
        };
        FrontendCosts {
            processes: self.processes.unwrap_or(base.processes),
            request_us: self.request_us.unwrap_or(base.request_us),
            prompt_token_ns: self.prompt_token_ns.unwrap_or(base.prompt_token_ns),
            output_token_ns: self.output_token_ns.unwrap_or(base.output_token_ns),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<FrontendConfig, String> {
        toml::from_str(text).map_err(|e: toml::de::Error| e.to_string())
    }

    #[test]
    fn a_preset_gives_every_number_and_a_key_overrides_one() {
        assert_eq!(parse("").unwrap().costs(), FrontendCosts::PYTHON);
        let c = parse("prompt_token_ns = 7.5\n").unwrap().costs();
        assert_eq!(c.prompt_token_ns, 7.5);
        assert_eq!(c.request_us, FrontendCosts::PYTHON.request_us);
        let c = parse("preset = \"none\"\nrequest_us = 3.0\n")
            .unwrap()
            .costs();
        assert_eq!((c.request_us, c.prompt_token_ns), (3.0, 0.0));
        assert_eq!(
            parse("preset = \"none\"").unwrap().costs(),
            FrontendCosts::NONE
        );
        assert_eq!(
            parse("preset = \"serve\"").unwrap().costs(),
            FrontendCosts::SERVE
        );
        assert_eq!(
            FrontendCosts::PYTHON.request_ns(8192),
            500_000.0 + 819_200.0
        );
    }

    #[test]
    fn bad_values_are_refused_naming_the_key_and_the_value() {
        let e = parse("processes = 0").unwrap_err();
        assert!(
            e.contains("frontend.processes") && e.contains("got 0"),
            "{e}"
        );
        let e = parse("request_us = -3.0").unwrap_err();
        assert!(e.contains("frontend.request_us") && e.contains("-3"), "{e}");
        let e = parse("preset = \"fast\"").unwrap_err();
        assert!(e.contains("fast") && e.contains("python"), "{e}");
        let e = parse("tokens = 1").unwrap_err();
        assert!(e.contains("tokens"), "{e}");
    }
}
