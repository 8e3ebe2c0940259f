//! `vllm bench serve`'s flags on `lockstep bench`: vLLM's datasets and arrival
//! process in place of the scenario's `[workload]`, its concurrency cap, its
//! percentile lines and its result JSON.

use std::path::PathBuf;

use anyhow::Context;

use crate::stdout::out;
use lockstep_bench::{BenchOptions, BenchRun};
use lockstep_plan::scenario::Scenario;

/// `--request-rate`: requests per second, a finite number > 0 or `inf`.
fn request_rate(text: &str) -> Result<f64, String> {
    let v: f64 = text.trim().parse().map_err(|_| {
        format!("expected requests per second (a number > 0, or inf), got `{text}`")
    })?;
    if v > 0.0 && !v.is_nan() {
        Ok(v)
    } else {
        Err(format!(
            "must be requests per second > 0, or inf (all at once), got {text}"
        ))
    }
}

/// A finite number > 0.
fn finite_positive(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("expected a number, got `{text}`"))?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a finite number > 0, got {text}"))
    }
}

/// In [0, 1).
fn range_ratio(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("expected a number, got `{text}`"))?;
    if (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("must be in [0, 1), got {text}"))
    }
}

/// `vllm bench serve`'s flags (`bench`).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchShorthands {
    /// vLLM's --dataset-name: the requests come from `random` lengths or a `sharegpt`
    /// file (--dataset-path) instead of the scenario's `[workload]` (the scenario is
    /// then optional).
    #[arg(long, value_parser = ["random", "sharegpt"])]
    dataset_name: Option<String>,
    /// ShareGPT's JSON (e.g. ShareGPT_V3_unfiltered_cleaned_split.json).
    #[arg(long, value_name = "FILE")]
    dataset_path: Option<PathBuf>,
    /// Requests of the dataset (default 1000).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    num_prompts: Option<u64>,
    /// Random: prompt tokens (default 1024).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    random_input_len: Option<u32>,
    /// Random: output tokens (default 128).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    random_output_len: Option<u32>,
    /// Random: lengths uniform in [len·(1−r), len·(1+r)] (default 0).
    #[arg(long, value_name = "R", value_parser = range_ratio)]
    random_range_ratio: Option<f64>,
    /// ShareGPT: every output this many tokens instead of the answer's length.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    sharegpt_output_len: Option<u32>,
    /// Requests per second: `inf` (the default) sends all at once; otherwise gaps
    /// are gamma-distributed with mean 1/rate (Poisson at --burstiness 1).
    #[arg(long, value_name = "RATE", value_parser = request_rate, allow_negative_numbers = true)]
    request_rate: Option<f64>,
    /// The arrival gaps' gamma shape: 1 is Poisson, below 1 burstier, above 1 steadier
    /// (default 1).
    #[arg(long, value_name = "B", value_parser = finite_positive, allow_negative_numbers = true)]
    burstiness: Option<f64>,
    /// Requests in flight at most; an arrival past it waits for one to end (any
    /// workload, scenario or dataset).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_concurrency: Option<u64>,
    /// Metrics whose percentiles are printed and saved: a comma-separated subset of
    /// ttft, tpot, itl, e2el (default ttft,tpot,itl, as vLLM).
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = lockstep_bench::vllm_result::parse_metric)]
    percentile_metrics: Option<Vec<String>>,
    /// Which percentiles: comma-separated, e.g. 50,90,99 (default 99, as vLLM).
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = lockstep_bench::vllm_result::parse_percentile)]
    metric_percentiles: Option<Vec<f64>>,
    /// Write vLLM's result JSON (beside --json's report).
    #[arg(long)]
    save_result: bool,
    /// --save-result's file name (default vLLM's:
    /// `{backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json`).
    #[arg(long, value_name = "NAME", requires = "save_result")]
    result_filename: Option<String>,
    /// --save-result's folder (default the current one).
    #[arg(long, value_name = "DIR", requires = "save_result")]
    result_dir: Option<PathBuf>,
}

/// `bench --model` names the model sent in requests (vLLM's `bench serve --model`),
/// while `--model` is a model directory everywhere else: a value that is a model
/// directory (one holding `config.json` or `tokenizer.json`) is refused rather than
/// sent as a name no server knows.
pub(crate) fn refuse_model_directory(model: &str) -> anyhow::Result<()> {
    let dir = std::path::Path::new(model);
    if dir.join("config.json").is_file() || dir.join("tokenizer.json").is_file() {
        anyhow::bail!(
            "bench --model {model}: is a model directory, but bench's --model is the model name sent in requests (as vLLM's bench serve --model); give --tokenizer {model} to draw prompts from its tokenizer and --served-model-name NAME (or --model NAME) for the served name, or leave both out to take the first of GET /v1/models"
        );
    }
    Ok(())
}

/// The dataset a bench plays instead of the scenario's workload.
#[derive(Debug, Clone)]
pub(crate) struct DatasetWorkload {
    dataset: lockstep_bench::dataset::Dataset,
}

/// A trace file removed when dropped.
pub(crate) struct TempTrace(PathBuf);

impl Drop for TempTrace {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl DatasetWorkload {
    /// Puts the dataset's requests in `scenario` as its `[workload]`: a trace file in
    /// the temporary folder, removed when the returned guard drops.
    pub(crate) fn install(
        &self,
        scenario: &mut Scenario,
        tokenizer: Option<&std::path::Path>,
    ) -> anyhow::Result<TempTrace> {
        use lockstep_plan::workload::{
            LenSpec, TraceConfig, TraceFormat, WorkloadConfig, WorkloadKind,
        };
        let tok = match tokenizer {
            Some(p) => Some(lockstep_bench::request::load_tokenizer(p)?),
            None => None,
        };
        let requests = lockstep_bench::dataset::requests(&self.dataset, tok.as_ref())?;
        let block = lockstep_plan::fleet::Fleet::plan(scenario, 0)?.tokens_per_block;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = std::env::temp_dir().join(format!(
            "lockstep-bench-{}-{nanos}.jsonl",
            std::process::id()
        ));
        lockstep_bench::dataset::write_trace(&requests, block, &path)?;
        let guard = TempTrace(path.clone());
        scenario.workload = Some(WorkloadConfig {
            kind: WorkloadKind::Trace,
            num_requests: None,
            concurrency: None,
            rate: None,
            input_len: LenSpec::Fixed(1),
            output_len: LenSpec::Fixed(1),
            think_time_ms: 0.0,
            shared_prefix_tokens: 0,
            conversation: None,
            trace: Some(TraceConfig {
                path: path.display().to_string(),
                format: TraceFormat::Mooncake,
                time_scale: 1.0,
                block_tokens: Some(block),
                skip: 0,
            }),
            seed: None,
            warmup_requests: 0,
            ramp_s: 0.0,
        });
        Ok(guard)
    }
}

/// The scenario `bench --dataset-name` plays without a scenario file: one aggregated
/// server, not run, whose sizes refuse no request (16-token blocks, as vLLM's).
pub(crate) fn default_bench_scenario() -> anyhow::Result<Scenario> {
    Ok(Scenario::parse(
        r#"
name = "bench"

[[server]]
name = "server"
role = "agg"
tensor_parallel_size = 1
max_batch_size = 1024
max_num_tokens = 65536
enable_chunked_prefill = true

[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 16777216

[model]
profile = "llama3-8b-h100-bf16"
"#,
        "bench",
    )?)
}

impl BenchShorthands {
    /// The dataset, if --dataset-name was given; an error when a dataset flag comes
    /// without it, or neither it nor a scenario is given.
    pub(crate) fn dataset(
        &self,
        has_scenario: bool,
        seed: u64,
    ) -> anyhow::Result<Option<DatasetWorkload>> {
        use lockstep_bench::dataset::{Dataset, DatasetName};
        let Some(name) = &self.dataset_name else {
            let given = [
                ("--dataset-path", self.dataset_path.is_some()),
                ("--num-prompts", self.num_prompts.is_some()),
                ("--random-input-len", self.random_input_len.is_some()),
                ("--random-output-len", self.random_output_len.is_some()),
                ("--random-range-ratio", self.random_range_ratio.is_some()),
                ("--sharegpt-output-len", self.sharegpt_output_len.is_some()),
                ("--request-rate", self.request_rate.is_some()),
                ("--burstiness", self.burstiness.is_some()),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
                anyhow::bail!(
                    "{flag} shapes a dataset's requests: give --dataset-name random|sharegpt (its requests replace the scenario's [workload]), or change the scenario's with --set workload.KEY=VALUE"
                );
            }
            if !has_scenario {
                anyhow::bail!(
                    "give a SCENARIO file whose [workload] is played, or --dataset-name random|sharegpt (vLLM's datasets)"
                );
            }
            return Ok(None);
        };
        let name = if name == "sharegpt" {
            DatasetName::ShareGpt
        } else {
            DatasetName::Random
        };
        if name == DatasetName::ShareGpt && self.dataset_path.is_none() {
            anyhow::bail!(
                "--dataset-name sharegpt needs --dataset-path FILE (ShareGPT's JSON, e.g. ShareGPT_V3_unfiltered_cleaned_split.json)"
            );
        }
        if name == DatasetName::Random && self.dataset_path.is_some() {
            anyhow::bail!("--dataset-path is read by --dataset-name sharegpt, not random");
        }
        Ok(Some(DatasetWorkload {
            dataset: Dataset {
                name,
                path: self.dataset_path.clone(),
                num_prompts: self.num_prompts.unwrap_or(1000),
                random_input_len: self.random_input_len.unwrap_or(1024),
                random_output_len: self.random_output_len.unwrap_or(128),
                random_range_ratio: self.random_range_ratio.unwrap_or(0.0),
                sharegpt_output_len: self.sharegpt_output_len,
                request_rate: self.request_rate.unwrap_or(f64::INFINITY),
                burstiness: self.burstiness.unwrap_or(1.0),
                seed,
            },
        }))
    }

    /// After the run: prints the percentiles asked for, writes vLLM's result JSON.
    pub(crate) fn finish(
        &self,
        run: &BenchRun,
        tokenizer_id: &str,
        opts: &BenchOptions,
        dataset: Option<&DatasetWorkload>,
        scenario: &Scenario,
    ) -> anyhow::Result<()> {
        use lockstep_bench::vllm_result::{
            Meta, Samples, date_of, default_filename, percentile_lines, result_json,
        };
        let report = &run.report;
        let samples = Samples::new(report, &run.gaps_ns);
        let metrics = self
            .percentile_metrics
            .clone()
            .unwrap_or_else(|| vec!["ttft".into(), "tpot".into(), "itl".into()]);
        let percentiles = self
            .metric_percentiles
            .clone()
            .unwrap_or_else(|| vec![99.0]);
        if self.percentile_metrics.is_some() || self.metric_percentiles.is_some() {
            out!("{}", percentile_lines(&samples, &metrics, &percentiles));
        }
        if !self.save_result {
            return Ok(());
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let meta = Meta {
            backend: match opts.endpoint {
                lockstep_bench::Endpoint::Chat => "openai-chat".into(),
                lockstep_bench::Endpoint::Completions => "vllm".into(),
            },
            model_id: run.model.clone(),
            tokenizer_id: tokenizer_id.to_string(),
            num_prompts: samples.success.len() as u64,
            request_rate: match dataset {
                Some(d) => d.dataset.request_rate,
                // A scenario's open loop is Poisson at its rate (burstiness 1); its
                // other workloads have no rate: all due as soon as they may go.
                None => scenario
                    .workload
                    .as_ref()
                    .filter(|w| w.kind == lockstep_plan::workload::WorkloadKind::OpenLoop)
                    .and_then(|w| w.rate)
                    .unwrap_or(f64::INFINITY),
            },
            burstiness: dataset.map_or(1.0, |d| d.dataset.burstiness),
            max_concurrency: self.max_concurrency,
            date: date_of(now),
        };
        let name = self
            .result_filename
            .clone()
            .unwrap_or_else(|| default_filename(&meta));
        let path = match &self.result_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("--result-dir {}: creating it", dir.display()))?;
                dir.join(name)
            }
            None => PathBuf::from(name),
        };
        let json = result_json(&meta, report, &samples, &metrics, &percentiles);
        std::fs::write(&path, serde_json::to_string(&json)? + "\n")
            .with_context(|| format!("--save-result: writing {}", path.display()))?;
        eprintln!("vLLM's result JSON: {}", path.display());
        Ok(())
    }
}
