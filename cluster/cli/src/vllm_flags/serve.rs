//! `vllm serve`'s engine flags on `lockstep serve`, as shorthands over the scenario:
//! each becomes a `--set` on every server (the scenario's own checks then name the
//! field and the value, and the error names the flag).

use lockstep_plan::scenario::Scenario;

/// vLLM's engine flags (`serve`).
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct ServeShorthands {
    /// vLLM's --max-model-len: the most prompt plus max_tokens tokens one request may
    /// take (a 400 `context_length_exceeded` past it; /v1/models's `max_model_len`);
    /// also caps --max-prompt-tokens.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_model_len: Option<u32>,
    /// vLLM's --max-num-seqs: `--set server.max_batch_size=N` on every server (B,
    /// requests in one rank's forward).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    max_num_seqs: Option<i64>,
    /// vLLM's --max-num-batched-tokens: `--set server.max_num_tokens=N` on every
    /// server (T, tokens in one rank's forward).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    max_num_batched_tokens: Option<i64>,
    /// vLLM's --tensor-parallel-size: one attention batch over N ranks
    /// (`tensor_parallel_size=N`, `enable_attention_dp=false`). One-server scenarios
    /// only; with --data-parallel-size one of the two must be 1.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    tensor_parallel_size: Option<i64>,
    /// vLLM's --data-parallel-size: N attention-DP ranks, each its own batch
    /// (`tensor_parallel_size=N`, `enable_attention_dp=true`). One-server scenarios
    /// only.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    data_parallel_size: Option<i64>,
    /// vLLM's --enable-chunked-prefill[=true|false]: `--set
    /// server.enable_chunked_prefill=…` on every server.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    enable_chunked_prefill: Option<bool>,
    /// vLLM's --no-enable-chunked-prefill: chunked prefill off on every server.
    #[arg(long, conflicts_with = "enable_chunked_prefill")]
    no_enable_chunked_prefill: bool,
}

impl ServeShorthands {
    /// The `--set` assignments these flags stand for, each with the flag as given.
    fn assignments(&self, scenario: &Scenario) -> anyhow::Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        let mut set = |flag: String, key: &str, value: String| {
            out.push((flag, format!("server.{key}={value}")));
        };
        if let Some(n) = self.max_num_seqs {
            set(
                format!("--max-num-seqs {n}"),
                "max_batch_size",
                n.to_string(),
            );
        }
        if let Some(n) = self.max_num_batched_tokens {
            set(
                format!("--max-num-batched-tokens {n}"),
                "max_num_tokens",
                n.to_string(),
            );
        }
        let chunked = match (self.enable_chunked_prefill, self.no_enable_chunked_prefill) {
            (_, true) => Some(("--no-enable-chunked-prefill".to_string(), false)),
            (Some(b), false) => Some((format!("--enable-chunked-prefill={b}"), b)),
            (None, false) => None,
        };
        if let Some((flag, b)) = chunked {
            set(flag, "enable_chunked_prefill", b.to_string());
        }
        let (tp, dp) = (self.tensor_parallel_size, self.data_parallel_size);
        if tp.is_some() || dp.is_some() {
            let flags = [
                tp.map(|n| format!("--tensor-parallel-size {n}")),
                dp.map(|n| format!("--data-parallel-size {n}")),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(" ");
            if scenario.servers.len() != 1 {
                anyhow::bail!(
                    "{flags}: the scenario has {} servers ({}); which one's parallelism is meant is ambiguous, so these flags take one-server scenarios only: use --set server.NAME.tensor_parallel_size=N and --set server.NAME.enable_attention_dp=true|false",
                    scenario.servers.len(),
                    scenario
                        .servers
                        .iter()
                        .map(|s| s.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            let (ranks, adp) = match (tp.unwrap_or(1), dp.unwrap_or(1)) {
                (t, 1) if dp.is_none() => (t, false),
                (1, d) => (d, true),
                (t, 1) => (t, false),
                (t, d) => anyhow::bail!(
                    "{flags}: lockstep's ranks are either one attention batch over the tensor-parallel group or attention-DP ranks each with its own batch (TensorRT-LLM's enable_attention_dp), not both; got tensor parallel {t} and data parallel {d}: one of the two must be 1"
                ),
            };
            set(flags.clone(), "tensor_parallel_size", ranks.to_string());
            set(flags.clone(), "enable_attention_dp", adp.to_string());
            // A server that names its ranks must keep them equal to tp × pp.
            let server = &scenario.servers[0];
            if server.ranks.is_some() {
                set(
                    flags,
                    "ranks",
                    ranks
                        .saturating_mul(server.pipeline_parallel_size)
                        .to_string(),
                );
            }
        }
        Ok(out)
    }

    /// Applies the flags to `scenario`; an error names the flag, the key it set and
    /// what the scenario's checks say.
    pub(crate) fn apply(&self, scenario: &mut Scenario) -> anyhow::Result<()> {
        let assignments = self.assignments(scenario)?;
        for (flag, set) in &assignments {
            scenario
                .apply_set(set)
                .map_err(|e| anyhow::anyhow!("{flag} (--set {set}): {e}"))?;
        }
        if !assignments.is_empty() {
            let flags: Vec<&str> = assignments.iter().map(|(f, _)| f.as_str()).collect();
            let mut flags = flags;
            flags.dedup();
            if let Err(e) = scenario.derive_all() {
                anyhow::bail!("{}: {e}", flags.join(" "));
            }
        }
        Ok(())
    }
}
