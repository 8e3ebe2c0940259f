//! `lockstep bench`: plays a scenario's workload against any OpenAI-compatible server
//! (`lockstep serve`, vLLM, SGLang, TensorRT-LLM) over plain HTTP and reports what
//! vLLM's `benchmark_serving` reports, as the same [`Report`] `sim` and `run` write.
//!
//! - [`request`]: the request body and its synthetic prompt (token ids from the
//!   workload's block hashes, so shared prefixes share tokens);
//! - [`sse`]: the streamed answer, event by event;
//! - [`exchange`]: one request, sent and measured;
//! - [`summary`]: vLLM's result lines from a report;
//! - here: the options, the server check, the `ignore_eos` probe, and the driver that
//!   plays the workload.
//!
//! Before any request: the prompt ids are settled ([`request::PromptIds`]: from
//! `--tokenizer` and `--prompt-ids`, a range that does not fit the tokenizer's vocabulary
//! being an error naming both), then `GET /v1/models` checks the server (and names the
//! model), then, under [`IgnoreEos::Auto`], one probe request of one prompt token and one
//! output token with vLLM's `ignore_eos` and `min_tokens` asks whether the server takes
//! them: a 4xx answer whose text names either field means it does not (OpenAI's own API
//! answers 400 `Unrecognized request argument supplied: ignore_eos`), and the run's
//! requests go without both; any other answer keeps them. The probe is not measured.
//!
//! The driver mirrors the real drivers' client ([`lockstep_runtime::client`]): one task
//! owns the [`Workload`], releases each arrival when it is due (in scaled wall time),
//! starts one tokio task per request, and hands each ending back to the workload
//! (`on_finished`), which releases a closed loop's next request or a conversation's next
//! round. Every request ends completed or failed with a reason: each has a timeout, and
//! a run where nothing ends for longer than that fails what is left.

#![forbid(unsafe_code)]

pub mod dataset;
pub mod exchange;
pub mod request;
pub mod sse;
pub mod summary;
pub mod vllm_result;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::task::JoinSet;

use lockstep_actors::ids::ReqId;
use lockstep_actors::vocab::FailureKind;

use exchange::{Exchange, Target, error_chain};
pub use lockstep_openai::Endpoint;
use lockstep_plan::fleet::{Fleet, PlanError};
use lockstep_plan::report::{
    ClientLog, Itl, Outcome, Report, RequestDetail, TimeBase, assemble_report,
};
use lockstep_plan::scenario::Scenario;
use lockstep_plan::workload::Workload;
use request::{BodyRules, PromptIds, PromptIdsError};

/// How long the server check (`GET /v1/models`) may take at most.
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

/// Slack past the per-request timeout before a run in which no request ends is given up.
const STALL_SLACK: Duration = Duration::from_secs(60);

/// What `lockstep bench` is told.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The server's base URL (`http://host:port`; a trailing `/v1` is taken off).
    pub url: String,
    /// The model to name in requests (`None`: the first of `GET /v1/models`).
    pub model: Option<String>,
    /// Which API.
    pub endpoint: Endpoint,
    /// Sent as `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Wall seconds per workload second (0: every arrival as soon as it is released).
    pub time_scale: f64,
    /// Longest one request may take, from sending to the end of its stream.
    pub request_timeout: Duration,
    /// The workload's seed (a seed in the scenario wins, as in `sim`).
    pub seed: u64,
    /// A `tokenizer.json` (or a directory holding one) whose vocabulary prompt ids are
    /// drawn from.
    pub tokenizer: Option<PathBuf>,
    /// The inclusive range prompt ids are drawn from (`None`: the whole tokenizer
    /// vocabulary, or [`request::TOKEN_ID_MIN`]`..=`[`request::TOKEN_ID_MAX`]
    /// without a tokenizer).
    pub prompt_ids: Option<(u32, u32)>,
    /// Whether vLLM's `ignore_eos` and `min_tokens` are sent.
    pub ignore_eos: IgnoreEos,
    /// vLLM's `--max-concurrency`: requests in flight at most; an arrival past it waits
    /// for one to end (`None`: no bound).
    pub max_concurrency: Option<usize>,
}

/// Whether requests carry vLLM's `ignore_eos: true` and `min_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IgnoreEos {
    /// Probe the server once before the run; send them unless it refuses them.
    #[default]
    Auto,
    /// Always (a server that refuses them fails every request).
    On,
    /// Never (a real model may stop before the asked output length).
    Off,
}

/// What a benchmark gave: the report, and what the requests carried.
#[derive(Debug)]
pub struct BenchRun {
    /// As `sim` and `run` write.
    pub report: Report,
    /// Whether the requests carried `ignore_eos` and `min_tokens`.
    pub ignore_eos: bool,
    /// Under [`IgnoreEos::Auto`], the probe's answer when the server refused them.
    pub ignore_eos_refused: Option<String>,
    /// The least and largest prompt id, and how many ids prompts are drawn from.
    pub prompt_ids: (u32, u32, usize),
    /// The model named in requests.
    pub model: String,
    /// What the server says its times are (`/v1/models`' `lockstep_time_base`; `None`
    /// from a server that does not say, any other than lockstep's).
    pub server_time_base: Option<TimeBase>,
    /// The served model's directory whose tokenizer prompt ids were drawn from, when
    /// neither `--tokenizer` nor `--prompt-ids` was given and the server named one.
    pub tokenizer_from_server: Option<String>,
    /// Per completed request (by id), the gaps between its chunks carrying text, in ns.
    pub gaps_ns: BTreeMap<u64, Vec<u64>>,
}

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// `--url` is not a usable base URL.
    #[error("--url `{url}`: {why}")]
    BadUrl {
        /// As given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// No HTTP answer from the server.
    #[error("--url {url}: cannot reach the server: {why}")]
    Unreachable {
        /// As given.
        url: String,
        /// The connection error.
        why: String,
    },
    /// `GET /v1/models` did not name a model, and none was given.
    #[error("--url {url}: GET /v1/models gave no model ({why}); name one with --model")]
    NoModel {
        /// As given.
        url: String,
        /// The answer.
        why: String,
    },
    /// The scenario cannot be played.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The prompt ids cannot be drawn (`--tokenizer`, `--prompt-ids`).
    #[error(transparent)]
    PromptIds(#[from] PromptIdsError),
    /// The HTTP client or the async runtime could not start.
    #[error("starting the HTTP client: {0}")]
    Start(String),
}

/// A base URL ending in `/`, from `--url`.
pub fn base_url(url: &str) -> Result<reqwest::Url, BenchError> {
    let bad = |why: String| BenchError::BadUrl {
        url: url.to_string(),
        why,
    };
    let mut u = reqwest::Url::parse(url.trim())
        .map_err(|e| bad(format!("not a URL ({e}); expected http://HOST:PORT")))?;
    match u.scheme() {
        "http" => {}
        "https" => {
            return Err(bad(
                "https is not supported: bench speaks plain HTTP (no TLS); use http://".into(),
            ));
        }
        s => {
            return Err(bad(format!(
                "the scheme must be http, got `{s}`; expected http://HOST:PORT"
            )));
        }
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host; expected http://HOST:PORT".into()));
    }
    if u.query().is_some() || u.fragment().is_some() {
        return Err(bad("a base URL takes no query or fragment".into()));
    }
    let mut path = u.path().trim_end_matches('/').to_string();
    if path.ends_with("/v1") {
        path.truncate(path.len() - 3);
    }
    path.push('/');
    u.set_path(&path);
    Ok(u)
}

/// The ids prompts are drawn from, as `opts` says (no server asked).
pub fn prompt_ids(opts: &BenchOptions) -> Result<PromptIds, PromptIdsError> {
    match (&opts.tokenizer, opts.prompt_ids) {
        (Some(path), range) => PromptIds::from_tokenizer(path, range),
        (None, Some((min, max))) => PromptIds::range(min, max),
        (None, None) => Ok(PromptIds::default()),
    }
}

/// Whether an answer to the probe says that the server refuses vLLM's `ignore_eos` or
/// `min_tokens`: a 4xx whose text names either.
pub fn refuses_ignore_eos(status: u16, text: &str) -> bool {
    (400..500).contains(&status) && (text.contains("ignore_eos") || text.contains("min_tokens"))
}

/// Plays `scenario`'s workload against the server at `opts.url` and reports. `progress`
/// is told (requests ended, requests in all) as requests end.
pub fn run(
    scenario: &Scenario,
    opts: &BenchOptions,
    progress: Option<&mut dyn FnMut(u64, u64)>,
) -> Result<BenchRun, BenchError> {
    let base = base_url(&opts.url)?;
    let mut ids = prompt_ids(opts)?;
    let fleet = Fleet::plan(scenario, opts.seed)?;
    let workload = fleet.workload()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Start(e.to_string()))?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .build()
        .map_err(|e| BenchError::Start(error_chain(&e)))?;
    runtime.block_on(async {
        let card = probe(&client, &base, opts).await?;
        let server_time_base = card.as_ref().ok().and_then(|c| c.time_base);
        // Asked nothing of ids: the served model's own tokenizer, where the server names
        // a directory holding one (`root`, as vLLM and `lockstep serve --model` give it)
        // on this machine, so prompt ids lie inside its vocabulary.
        let mut tokenizer_from_server = None;
        if opts.tokenizer.is_none() && opts.prompt_ids.is_none() {
            let root = card.as_ref().ok().and_then(|c| c.root.clone());
            if let Some(root) = root.filter(|r| Path::new(r).join("tokenizer.json").is_file()) {
                ids = PromptIds::from_tokenizer(Path::new(&root), None)?;
                tokenizer_from_server = Some(root);
            }
        }
        let model = match (&opts.model, card.map(|c| c.model)) {
            (Some(m), _) => m.clone(),
            (None, Ok(Some(m))) => m,
            (None, Ok(None)) => {
                return Err(BenchError::NoModel {
                    url: opts.url.clone(),
                    why: "its list is empty".into(),
                });
            }
            (None, Err(why)) => {
                return Err(BenchError::NoModel {
                    url: opts.url.clone(),
                    why,
                });
            }
        };
        let target = Target {
            url: base
                .join(request::endpoint_path(opts.endpoint))
                .map_err(|e| BenchError::BadUrl {
                    url: opts.url.clone(),
                    why: e.to_string(),
                })?,
            api_key: opts.api_key.clone(),
        };
        let (lo, hi) = ids.bounds();
        let prompt_ids = (lo, hi, ids.len());
        let mut rules = BodyRules {
            model,
            tokens_per_block: fleet.tokens_per_block,
            prompt_ids: ids,
            ignore_eos: opts.ignore_eos != IgnoreEos::Off,
        };
        let mut ignore_eos_refused = None;
        if opts.ignore_eos == IgnoreEos::Auto {
            ignore_eos_refused = probe_ignore_eos(&client, &target, opts, &rules).await;
            rules.ignore_eos = ignore_eos_refused.is_none();
        }
        let ignore_eos = rules.ignore_eos;
        let model = rules.model.clone();
        let driver = Driver {
            client,
            target,
            rules,
            max_concurrency: opts.max_concurrency,
            endpoint: opts.endpoint,
            time_scale: opts.time_scale.max(0.0),
            timeout: opts.request_timeout,
        };
        let (report, gaps_ns) = driver.play(scenario, fleet.seed, workload, progress).await;
        Ok(BenchRun {
            report,
            ignore_eos,
            ignore_eos_refused,
            prompt_ids,
            model,
            server_time_base,
            tokenizer_from_server,
            gaps_ns,
        })
    })
}

/// One request of one prompt token and one output token carrying `ignore_eos` and
/// `min_tokens`: the server's answer (`HTTP 400: …`) when it refuses them, else `None`.
async fn probe_ignore_eos(
    client: &reqwest::Client,
    target: &Target,
    opts: &BenchOptions,
    rules: &BodyRules,
) -> Option<String> {
    let spec = lockstep_actors::request::RequestSpec::new(0, 1, 1);
    let body = request::request_body(&spec, opts.endpoint, rules);
    let mut req = client
        .post(target.url.clone())
        .json(&body)
        .timeout(PROBE_TIMEOUT.min(opts.request_timeout));
    if let Some(k) = &target.api_key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.ok()?;
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    refuses_ignore_eos(status, &text).then(|| sse::http_error_reason(status, &text))
}

/// What `GET /v1/models` says of the server's first model.
struct ModelCard {
    /// Its id.
    model: Option<String>,
    /// lockstep's `lockstep_time_base`.
    time_base: Option<TimeBase>,
    /// What is served (vLLM: the model's path or hub name).
    root: Option<String>,
}

/// Checks that the server answers HTTP (`GET /v1/models`); its first model's card, or
/// why the answer is not one. An error only when no HTTP answer came.
async fn probe(
    client: &reqwest::Client,
    base: &reqwest::Url,
    opts: &BenchOptions,
) -> Result<Result<ModelCard, String>, BenchError> {
    let unreachable = |why: String| BenchError::Unreachable {
        url: opts.url.clone(),
        why,
    };
    let url = base
        .join("v1/models")
        .map_err(|e| unreachable(e.to_string()))?;
    let mut req = client
        .get(url.clone())
        .timeout(PROBE_TIMEOUT.min(opts.request_timeout));
    if let Some(k) = &opts.api_key {
        req = req.bearer_auth(k);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| unreachable(format!("GET {url}: {}", error_chain(&e.without_url()))))?;
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    if !status.is_success() {
        return Ok(Err(sse::http_error_reason(status.as_u16(), &text)));
    }
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let first = v.get("data").and_then(|d| d.get(0));
    Ok(Ok(ModelCard {
        model: first
            .and_then(|m| m.get("id"))
            .and_then(Value::as_str)
            .map(String::from),
        time_base: first
            .and_then(|m| m.get("lockstep_time_base"))
            .and_then(|t| serde_json::from_value(t.clone()).ok()),
        root: first
            .and_then(|m| m.get("root"))
            .and_then(Value::as_str)
            .map(String::from),
    }))
}

/// Plays the workload: one task owns it; one tokio task per request.
struct Driver {
    client: reqwest::Client,
    target: Target,
    rules: BodyRules,
    max_concurrency: Option<usize>,
    endpoint: Endpoint,
    time_scale: f64,
    timeout: Duration,
}

impl Driver {
    /// Wall ns since the start at which workload time `t_ns` is due.
    fn due_ns(&self, t_ns: u64) -> u64 {
        (t_ns as f64 * self.time_scale) as u64
    }

    /// Workload time at wall ns `wall_ns` since the start.
    fn workload_ns(&self, wall_ns: u64) -> u64 {
        if self.time_scale > 0.0 {
            (wall_ns as f64 / self.time_scale) as u64
        } else {
            wall_ns
        }
    }

    async fn play(
        self,
        scenario: &Scenario,
        seed: u64,
        mut workload: Workload,
        mut progress: Option<&mut dyn FnMut(u64, u64)>,
    ) -> (Report, BTreeMap<u64, Vec<u64>>) {
        let mut gaps_ns: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        let start = Instant::now();
        let now_ns = || u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let total = workload.total().unwrap_or(0);
        let mut records: BTreeMap<ReqId, RequestDetail> = BTreeMap::new();
        let mut itl = Itl::new(workload.warmup_requests());
        let mut tasks: JoinSet<Exchange> = JoinSet::new();
        let mut task_ids: HashMap<tokio::task::Id, ReqId> = HashMap::new();
        let mut ended = 0u64;
        let mut last_end = Instant::now();
        let stall_bound = self.timeout + STALL_SLACK;
        let mut outcome = None;
        if let Some(p) = progress.as_mut() {
            p(0, total);
        }
        loop {
            // Release every arrival that is due (while --max-concurrency leaves room).
            let full = |n: usize| self.max_concurrency.is_some_and(|c| n >= c);
            while let Some(t) = workload.next_arrival_ns() {
                if self.due_ns(t) > now_ns() || full(tasks.len()) {
                    break;
                }
                let Some(a) = workload.pop_due(t) else {
                    break;
                };
                let body = request::request_body(&a.spec, self.endpoint, &self.rules);
                let id = a.spec.id;
                if tasks.is_empty() {
                    // The stall bound counts from the oldest request in flight.
                    last_end = Instant::now();
                }
                records.insert(id, RequestDetail::arrived(&a.spec, now_ns()));
                let (client, target, timeout) =
                    (self.client.clone(), self.target.clone(), self.timeout);
                let handle = tasks.spawn(async move {
                    exchange::play(client, &target, id, body, start, timeout).await
                });
                task_ids.insert(handle.id(), id);
            }
            if tasks.is_empty() {
                if workload.exhausted() {
                    break;
                }
                if workload.next_arrival_ns().is_none() {
                    // Nothing in flight, nothing pending, yet not every request issued:
                    // a workload that waits on nothing cannot go on.
                    outcome = Some((
                        Outcome::Failed,
                        "the workload released no further request while none was in flight"
                            .to_string(),
                    ));
                    break;
                }
            }
            let wait = match workload.next_arrival_ns() {
                // An arrival held by --max-concurrency waits for an ending.
                Some(_) if full(tasks.len()) => Duration::from_secs(1),
                Some(t) => Duration::from_nanos(self.due_ns(t).saturating_sub(now_ns())),
                None => Duration::from_secs(1),
            }
            .min(Duration::from_secs(1));
            tokio::select! {
                joined = tasks.join_next_with_id(), if !tasks.is_empty() => {
                    let ex = match joined {
                        Some(Ok((task, ex))) => {
                            task_ids.remove(&task);
                            ex
                        }
                        Some(Err(e)) => {
                            let id = task_ids.remove(&e.id()).unwrap_or(ReqId(0));
                            Exchange {
                                id,
                                text_chunk_ns: Vec::new(),
                                end_ns: now_ns(),
                                output_tokens: 0,
                                digest: 0,
                                failure: Some(format!("the request's task ended abnormally: {e}")),
                            }
                        }
                        None => continue,
                    };
                    last_end = Instant::now();
                    if ex.failure.is_none() {
                        gaps_ns.insert(
                            ex.id.0,
                            ex.text_chunk_ns.windows(2).map(|w| w[1].saturating_sub(w[0])).collect(),
                        );
                    }
                    if let Some(rec) = records.get_mut(&ex.id) {
                        apply(rec, &ex, &mut itl);
                        workload.on_finished(ex.id, self.workload_ns(ex.end_ns), rec.completed());
                    }
                    ended += 1;
                    if let Some(p) = progress.as_mut() {
                        p(ended, total);
                    }
                }
                _ = tokio::time::sleep(wait) => {}
            }
            if !tasks.is_empty() && last_end.elapsed() > stall_bound {
                tasks.abort_all();
                let why = format!(
                    "no request ended for {} s (longer than --request-timeout-s)",
                    stall_bound.as_secs()
                );
                let now = now_ns();
                for rec in records.values_mut().filter(|r| r.end_ns().is_none()) {
                    rec.fail(now, FailureKind::Client, why.clone());
                }
                outcome = Some((Outcome::Failed, why));
                break;
            }
        }
        let end_ns = now_ns();
        let mut report = assemble_report(
            scenario,
            seed,
            ClientLog {
                records: records.into_values().collect(),
                itl,
                end_ns,
                frontend: None,
            },
            [],
            start.elapsed().as_secs_f64(),
            Vec::new(),
            outcome,
        );
        report.time_base = TimeBase::Client;
        (report, gaps_ns)
    }
}

/// Fills a request's record from what its exchange saw; the inter-token gaps of a
/// completed request go to `itl` (vLLM counts those of successful requests only).
fn apply(rec: &mut RequestDetail, ex: &Exchange, itl: &mut Itl) {
    let mut chunks = ex.text_chunk_ns.iter();
    if let Some(&first) = chunks.next() {
        rec.set_first_token_ns(Some(first));
        let mut last = first;
        for &t in chunks {
            if ex.failure.is_none() {
                itl.record(ex.id, t.saturating_sub(last));
            }
            last = t;
        }
        rec.last_token_ns = last;
    }
    rec.output_tokens = ex.output_tokens;
    rec.token_digest = ex.digest;
    match &ex.failure {
        None => rec.complete(ex.end_ns),
        Some(why) => rec.fail(ex.end_ns, FailureKind::Client, why.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_are_checked_and_normalised() {
        let ok = |s: &str| base_url(s).unwrap().to_string();
        assert_eq!(ok("http://127.0.0.1:8000"), "http://127.0.0.1:8000/");
        assert_eq!(ok("http://127.0.0.1:8000/v1/"), "http://127.0.0.1:8000/");
        assert_eq!(ok("http://h:1/proxy/v1"), "http://h:1/proxy/");
        for (bad, says) in [
            ("127.0.0.1:8000", "not a URL"),
            ("localhost:8000", "scheme must be http"),
            ("https://h", "https is not supported"),
            ("http://h/?x=1", "no query"),
        ] {
            let e = base_url(bad).unwrap_err().to_string();
            assert!(
                e.contains("--url") && e.contains(bad) && e.contains(says),
                "{e}"
            );
        }
    }

    #[test]
    fn only_a_client_error_naming_the_extension_refuses_it() {
        let openai = r#"{"error":{"message":"Unrecognized request argument supplied: ignore_eos","type":"invalid_request_error"}}"#;
        assert!(refuses_ignore_eos(400, openai));
        assert!(refuses_ignore_eos(422, "extra field: min_tokens"));
        assert!(!refuses_ignore_eos(200, openai), "a success takes them");
        assert!(!refuses_ignore_eos(500, openai), "not a client error");
        assert!(!refuses_ignore_eos(401, "missing or wrong API key"));
        assert!(!refuses_ignore_eos(400, "prompt: token id 9000 is outside"));
    }

    #[test]
    fn an_exchange_fills_the_record_vllm_style() {
        let spec = lockstep_actors::request::RequestSpec::new(2, 10, 3);
        let mut rec = RequestDetail::arrived(&spec, 1_000);
        let mut itl = Itl::new(0);
        let ex = Exchange {
            id: ReqId(2),
            text_chunk_ns: vec![5_000, 7_000, 10_000],
            end_ns: 11_000,
            output_tokens: 3,
            digest: 9,
            failure: None,
        };
        apply(&mut rec, &ex, &mut itl);
        assert_eq!(rec.first_token_ns(), Some(5_000));
        assert_eq!(rec.end_ns(), Some(11_000));
        assert!(rec.completed());
        assert_eq!(rec.output_tokens, 3);
        // One inter-token sample per chunk after the first.
        assert_eq!(itl.samples(), 2);
        let mut failed = RequestDetail::arrived(&spec, 0);
        apply(
            &mut failed,
            &Exchange {
                failure: Some("HTTP 401: no".into()),
                text_chunk_ns: vec![3_000, 4_000],
                ..ex
            },
            &mut itl,
        );
        assert_eq!(itl.samples(), 2, "no gap of a failed request counts");
        assert!(!failed.completed());
        assert_eq!(
            (failed.failure_kind(), failed.failure()),
            (Some(FailureKind::Client), Some("HTTP 401: no"))
        );
    }
}
