//! `lockstep bench`: the scenario's workload played against any OpenAI-compatible server.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use lockstep_bench::{BenchOptions, Endpoint, IgnoreEos};
use lockstep_plan::report::Slo;

use crate::args::{ScenarioArgs, finite_non_negative, load};
use crate::output::{exit_code, requests_bar, write_json};
use crate::stdout::out;
use crate::vllm_flags::{BenchShorthands, DatasetWorkload};

/// `lockstep bench`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Scenario file (TOML) whose `[workload]` is played; optional with --dataset-name
    /// (whose requests then replace the scenario's `[workload]`).
    scenario: Option<PathBuf>,
    /// Override a key: `workload.concurrency=64`, `workload.num_requests=2000`, ...
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The server's base URL: `http://HOST:PORT` (plain HTTP; a trailing /v1 is
    /// taken off).
    #[arg(long)]
    url: String,
    /// Seed of the workload (wins over a `seed` in the scenario; default 0).
    #[arg(long)]
    seed: Option<u64>,
    /// The model named in requests, as vLLM's `bench serve --model` (default: the
    /// first of GET /v1/models); --served-model-name wins. Not a model directory, as
    /// elsewhere: one is refused (give --tokenizer DIR and --served-model-name NAME).
    #[arg(long)]
    model: Option<String>,
    /// vLLM's --served-model-name: the model named in requests, when --model names
    /// something else (a path, the tokenizer's).
    #[arg(long, value_name = "NAME")]
    served_model_name: Option<String>,
    /// Which API: /v1/completions (prompts as token ids) or /v1/chat/completions
    /// (prompts as words).
    #[arg(long, value_parser = ["completions", "chat"], default_value = "completions")]
    endpoint: String,
    /// Send `Authorization: Bearer KEY`.
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Wall seconds per workload second (0: every arrival as soon as it is released).
    #[arg(long, default_value_t = 1.0, value_parser = finite_non_negative)]
    time_scale: f64,
    /// Write the report as JSON.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Goodput: requests per second completed within every objective given
    /// (`ttft_ms=200,tpot_ms=20,e2e_ms=5000`, any of them).
    #[arg(long, value_name = "KEY=MS,...")]
    slo: Option<Slo>,
    /// Longest one request may take, from sending to the end of its stream; it fails
    /// past it.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    request_timeout_s: u64,
    /// Draw prompt token ids from this tokenizer's vocabulary, clear of its added and
    /// special tokens: a `tokenizer.json`, or a model directory holding one.
    #[arg(long, value_name = "PATH")]
    tokenizer: Option<PathBuf>,
    /// Draw prompt token ids from MIN..=MAX (default: the whole --tokenizer vocabulary,
    /// or 1000-30000 without one); with --tokenizer it must fit the vocabulary.
    #[arg(long, value_name = "MIN-MAX", value_parser = lockstep_bench::request::parse_range)]
    prompt_ids: Option<(u32, u32)>,
    /// Send vLLM's `ignore_eos` and `min_tokens`: `auto` probes the server with one
    /// request first and leaves both out where it refuses them.
    #[arg(long, value_parser = ["auto", "on", "off"], default_value = "auto")]
    ignore_eos: String,
    /// No progress bar (there is none either when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
    #[command(flatten)]
    vllm: BenchShorthands,
}

/// Runs `lockstep bench`.
pub(crate) fn run(
    BenchArgs {
        scenario,
        set,
        url,
        seed,
        model,
        served_model_name,
        endpoint,
        api_key,
        time_scale,
        json,
        slo,
        request_timeout_s,
        tokenizer,
        prompt_ids,
        ignore_eos,
        no_progress,
        vllm,
    }: BenchArgs,
) -> anyhow::Result<ExitCode> {
    if served_model_name.is_none()
        && let Some(m) = &model
    {
        crate::vllm_flags::refuse_model_directory(m)?;
    }
    let dataset = vllm.dataset(scenario.is_some(), seed.unwrap_or(0))?;
    let tokenizer_id = tokenizer
        .as_ref()
        .map(|t| t.display().to_string())
        .or_else(|| model.clone());
    bench_command(
        scenario,
        set,
        dataset,
        &vllm,
        tokenizer_id,
        BenchOptions {
            url,
            model: served_model_name.or(model),
            endpoint: if endpoint == "chat" {
                Endpoint::Chat
            } else {
                Endpoint::Completions
            },
            api_key,
            time_scale,
            request_timeout: std::time::Duration::from_secs(request_timeout_s),
            seed: seed.unwrap_or(0),
            tokenizer,
            prompt_ids,
            ignore_eos: match ignore_eos.as_str() {
                "on" => IgnoreEos::On,
                "off" => IgnoreEos::Off,
                _ => IgnoreEos::Auto,
            },
            max_concurrency: vllm
                .max_concurrency
                .map(|c| usize::try_from(c).unwrap_or(usize::MAX)),
        },
        seed,
        json.as_deref(),
        slo.as_ref(),
        !no_progress,
    )
}

/// `lockstep bench`: plays the workload against the server, prints the table and vLLM's
/// result block, writes the JSON; 1 if any request failed.
#[allow(clippy::too_many_arguments)]
fn bench_command(
    scenario: Option<PathBuf>,
    set: Vec<String>,
    dataset: Option<DatasetWorkload>,
    vllm: &BenchShorthands,
    tokenizer_id: Option<String>,
    opts: BenchOptions,
    seed: Option<u64>,
    json: Option<&Path>,
    slo: Option<&Slo>,
    progress: bool,
) -> anyhow::Result<ExitCode> {
    let mut scenario = match scenario {
        Some(path) => load(
            &ScenarioArgs {
                scenario: path,
                set,
            },
            None,
            seed,
        )?,
        None => {
            let mut s = crate::vllm_flags::default_bench_scenario()?;
            if seed.is_some() {
                s.seed = seed;
            }
            for a in &set {
                s.apply_set(a)?;
            }
            s
        }
    };
    // The dataset's requests, as a trace the workload replays (removed when dropped).
    let _trace = match &dataset {
        Some(d) => Some(d.install(&mut scenario, opts.tokenizer.as_deref())?),
        None => None,
    };
    let bar = (progress && std::io::stderr().is_terminal()).then(requests_bar);
    let mut tick = |done: u64, total: u64| {
        if let Some(b) = &bar {
            b.set_length(total);
            b.set_position(done);
        }
    };
    let mut run = lockstep_bench::run(&scenario, &opts, Some(&mut tick))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(why) = &run.ignore_eos_refused {
        eprintln!(
            "note: the server refused vLLM's ignore_eos ({why}); requests went without \
             ignore_eos and min_tokens, so a real model may stop before the asked output \
             length (--ignore-eos on|off to choose)"
        );
    }
    if let Some(root) = &run.tokenizer_from_server {
        eprintln!(
            "note: prompt ids drawn from the served model's tokenizer ({root}, the root \
             GET /v1/models names); --tokenizer or --prompt-ids to choose"
        );
    }
    if run.server_time_base == Some(lockstep_plan::report::TimeBase::ZeroCost) {
        eprintln!(
            "note: the server models no time (lockstep serve at zero cost: no --time-scale, \
             no --model): its forwards take none, so these throughputs and latencies \
             measure its control plane and HTTP on this machine, not a model"
        );
    }
    if let Some(slo) = slo {
        run.report.apply_slo(slo);
    }
    let report = &run.report;
    out!("{}", report.table());
    out!("{}", lockstep_bench::summary::vllm_summary(report));
    vllm.finish(
        &run,
        tokenizer_id.as_deref().unwrap_or(&run.model),
        &opts,
        dataset.as_ref(),
        &scenario,
    )?;
    if let Some(p) = json {
        write_json(p, report)?;
    }
    if report.requests.failed > 0 {
        eprintln!(
            "error: {} of {} requests failed (reasons above)",
            report.requests.failed, report.requests.submitted
        );
    }
    // As `sim` and `run`: 3 when the run ended with requests that did not complete.
    Ok(exit_code(report))
}
