//! `vllm bench serve --save-result`'s JSON, from a bench run: the same keys, units
//! (seconds per request, milliseconds in the statistics) and definitions (TPOT of a
//! request `(e2el − ttft)/(output − 1)` over requests of more than one output token;
//! ITL every gap between chunks of successful requests; percentiles interpolated
//! linearly, as numpy; std the population's), and the lines `--percentile-metrics` /
//! `--metric-percentiles` print.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::{Map, Value, json};

use lockstep_plan::report::Report;

/// The metrics `--percentile-metrics` may name.
pub const METRICS: [&str; 4] = ["ttft", "tpot", "itl", "e2el"];

/// What the JSON says about the run besides its requests.
#[derive(Debug, Clone)]
pub struct Meta {
    /// `backend`: `vllm` (completions) or `openai-chat`.
    pub backend: String,
    /// `model_id`: the model named in requests.
    pub model_id: String,
    /// `tokenizer_id`: `--tokenizer`, or the model.
    pub tokenizer_id: String,
    /// `num_prompts`.
    pub num_prompts: u64,
    /// `request_rate` (infinite: "inf").
    pub request_rate: f64,
    /// `burstiness`.
    pub burstiness: f64,
    /// `max_concurrency`.
    pub max_concurrency: Option<u64>,
    /// `date`, `YYYYMMDD-HHMMSS` (UTC).
    pub date: String,
}

/// The run's per-request figures, measured requests only (no warm-up), in id order.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    /// Per request: prompt tokens.
    pub input_lens: Vec<u32>,
    /// Per request: output tokens (0 for a failure).
    pub output_lens: Vec<u32>,
    /// Per request: TTFT in s (0 for a failure).
    pub ttfts: Vec<f64>,
    /// Per request: its inter-token gaps in s (none for a failure).
    pub itls: Vec<Vec<f64>>,
    /// Per request: E2E latency in s (0 for a failure).
    pub latencies: Vec<f64>,
    /// Per request: why it failed ("" for a success).
    pub errors: Vec<String>,
    /// Whether it completed.
    pub success: Vec<bool>,
}

impl Samples {
    /// From the report and each request's chunk gaps (ns, by request id).
    pub fn new(report: &Report, gaps_ns: &BTreeMap<u64, Vec<u64>>) -> Samples {
        let mut s = Samples::default();
        let warmup = report.requests.warmup;
        for d in report.per_request.iter().filter(|d| d.id > warmup) {
            let ok = d.failure().is_none();
            s.input_lens.push(d.prompt_tokens);
            s.success.push(ok);
            s.errors.push(d.failure().unwrap_or_default().to_string());
            if ok {
                s.output_lens.push(d.output_tokens);
                let ttft = d.ttft_ms().map_or(0.0, |t| t / 1e3);
                s.ttfts.push(ttft);
                s.latencies.push(d.e2e_ms().map_or(0.0, |t| t / 1e3));
                s.itls.push(
                    gaps_ns
                        .get(&d.id)
                        .map(|g| g.iter().map(|&n| n as f64 / 1e9).collect())
                        .unwrap_or_default(),
                );
            } else {
                s.output_lens.push(0);
                s.ttfts.push(0.0);
                s.latencies.push(0.0);
                s.itls.push(Vec::new());
            }
        }
        s
    }

    /// A metric's values in ms over successful requests (ITL: every gap).
    pub fn metric_ms(&self, metric: &str) -> Vec<f64> {
        let ok = |i: &usize| self.success[*i];
        let idx = (0..self.success.len()).filter(ok);
        match metric {
            "ttft" => idx.map(|i| self.ttfts[i] * 1e3).collect(),
            "e2el" => idx.map(|i| self.latencies[i] * 1e3).collect(),
            "tpot" => idx
                .filter(|&i| self.output_lens[i] > 1)
                .map(|i| {
                    (self.latencies[i] - self.ttfts[i]) / f64::from(self.output_lens[i] - 1) * 1e3
                })
                .collect(),
            "itl" => idx
                .flat_map(|i| self.itls[i].iter().map(|g| g * 1e3))
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// numpy's `percentile` (linear interpolation); 0 for no values, as vLLM's `or 0`.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn std(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let m = mean(v);
    (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
}

/// vLLM's percentile key word: `99`, `99.9`.
fn p_word(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{}", p as u64)
    } else {
        format!("{p}")
    }
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// The JSON `--save-result` writes. `metrics` and `percentiles` choose the `p…` keys
/// (mean, median and std of all four metrics are always there).
pub fn result_json(
    meta: &Meta,
    report: &Report,
    samples: &Samples,
    metrics: &[String],
    percentiles: &[f64],
) -> Value {
    let duration = report.throughput.duration_s;
    let completed = samples.success.iter().filter(|&&b| b).count() as u64;
    let total_input: u64 = (0..samples.success.len())
        .filter(|&i| samples.success[i])
        .map(|i| u64::from(samples.input_lens[i]))
        .sum();
    let total_output: u64 = samples.output_lens.iter().map(|&n| u64::from(n)).sum();
    let per_s = |n: f64| if duration > 0.0 { n / duration } else { 0.0 };
    let mut o = Map::new();
    o.insert("date".into(), json!(meta.date));
    o.insert("backend".into(), json!(meta.backend));
    o.insert("model_id".into(), json!(meta.model_id));
    o.insert("tokenizer_id".into(), json!(meta.tokenizer_id));
    o.insert("num_prompts".into(), json!(meta.num_prompts));
    o.insert(
        "request_rate".into(),
        if meta.request_rate.is_infinite() {
            json!("inf")
        } else {
            json!(meta.request_rate)
        },
    );
    o.insert("burstiness".into(), json!(meta.burstiness));
    o.insert("max_concurrency".into(), json!(meta.max_concurrency));
    o.insert("duration".into(), json!(duration));
    o.insert("completed".into(), json!(completed));
    o.insert("total_input_tokens".into(), json!(total_input));
    o.insert("total_output_tokens".into(), json!(total_output));
    o.insert("request_throughput".into(), json!(per_s(completed as f64)));
    o.insert(
        "request_goodput".into(),
        json!(report.goodput.as_ref().map(|g| g.requests_per_s)),
    );
    o.insert(
        "output_throughput".into(),
        json!(per_s(total_output as f64)),
    );
    o.insert(
        "total_token_throughput".into(),
        json!(per_s((total_input + total_output) as f64)),
    );
    o.insert("input_lens".into(), json!(samples.input_lens));
    o.insert("output_lens".into(), json!(samples.output_lens));
    o.insert("ttfts".into(), json!(samples.ttfts));
    o.insert("itls".into(), json!(samples.itls));
    // lockstep's client keeps no answer text (it measures chunks and usage only).
    o.insert(
        "generated_texts".into(),
        json!(vec![""; samples.success.len()]),
    );
    o.insert("errors".into(), json!(samples.errors));
    for m in METRICS {
        let v = sorted(samples.metric_ms(m));
        o.insert(format!("mean_{m}_ms"), json!(mean(&v)));
        o.insert(format!("median_{m}_ms"), json!(percentile(&v, 50.0)));
        o.insert(format!("std_{m}_ms"), json!(std(&v)));
        if metrics.iter().any(|x| x == m) {
            for &p in percentiles {
                o.insert(format!("p{}_{m}_ms", p_word(p)), json!(percentile(&v, p)));
            }
        }
    }
    Value::Object(o)
}

/// The lines vLLM prints for `--percentile-metrics` and `--metric-percentiles`: per
/// metric its mean, median and each percentile.
pub fn percentile_lines(samples: &Samples, metrics: &[String], percentiles: &[f64]) -> String {
    let mut o = String::new();
    let line = |o: &mut String, name: String, v: f64| {
        let _ = writeln!(o, "{name:<40} {v:<10.2}");
    };
    for m in metrics {
        let (title, short) = match m.as_str() {
            "ttft" => ("Time to First Token", "TTFT"),
            "tpot" => ("Time per Output Token (excl. 1st token)", "TPOT"),
            "itl" => ("Inter-token Latency", "ITL"),
            _ => ("End-to-end Latency", "E2EL"),
        };
        let v = sorted(samples.metric_ms(m));
        let _ = writeln!(o, "{title:-^50}");
        line(&mut o, format!("Mean {short} (ms):"), mean(&v));
        line(
            &mut o,
            format!("Median {short} (ms):"),
            percentile(&v, 50.0),
        );
        for &p in percentiles {
            line(
                &mut o,
                format!("P{} {short} (ms):", p_word(p)),
                percentile(&v, p),
            );
        }
    }
    let _ = writeln!(o, "{}", "=".repeat(50));
    o
}

/// A bad item of `--percentile-metrics` or `--metric-percentiles`.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    /// Not one of [`METRICS`].
    #[error("unknown metric `{0}`; expected a comma-separated list of ttft, tpot, itl, e2el")]
    UnknownMetric(String),
    /// Not a number in [0, 100].
    #[error("`{0}` is not a percentile in [0, 100]")]
    NotPercentile(String),
}

/// One metric of `--percentile-metrics`: ttft, tpot, itl or e2el.
pub fn parse_metric(text: &str) -> Result<String, ListError> {
    let m = text.trim();
    if METRICS.contains(&m) {
        Ok(m.to_string())
    } else {
        Err(ListError::UnknownMetric(m.to_string()))
    }
}

/// `--percentile-metrics`: a comma-separated subset of ttft, tpot, itl, e2el.
pub fn parse_metrics(text: &str) -> Result<Vec<String>, ListError> {
    text.split(',').map(parse_metric).collect()
}

/// One percentile of `--metric-percentiles`, in [0, 100].
pub fn parse_percentile(text: &str) -> Result<f64, ListError> {
    let s = text.trim();
    s.parse::<f64>()
        .ok()
        .filter(|p| (0.0..=100.0).contains(p))
        .ok_or_else(|| ListError::NotPercentile(s.to_string()))
}

/// `--metric-percentiles`: comma-separated numbers in [0, 100].
pub fn parse_percentiles(text: &str) -> Result<Vec<f64>, ListError> {
    text.split(',').map(parse_percentile).collect()
}

/// `YYYYMMDD-HHMMSS` of a Unix time (UTC), as vLLM dates a result.
pub fn date_of(unix_s: u64) -> String {
    let days = (unix_s / 86_400) as i64;
    let secs = unix_s % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// vLLM's default result file name:
/// `{backend}-{rate}qps[-concurrency{N}]-{model's last path part}-{date}.json`.
pub fn default_filename(meta: &Meta) -> String {
    let rate = if meta.request_rate.is_infinite() {
        "inf".to_string()
    } else {
        format!("{:?}", meta.request_rate)
    };
    let conc = meta
        .max_concurrency
        .map_or(String::new(), |c| format!("-concurrency{c}"));
    let model = meta.model_id.rsplit('/').next().unwrap_or("model");
    format!(
        "{}-{rate}qps{conc}-{model}-{}.json",
        meta.backend, meta.date
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_as_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-9);
        assert_eq!(percentile(&[], 99.0), 0.0);
        assert_eq!(p_word(99.0), "99");
        assert_eq!(p_word(99.9), "99.9");
    }

    #[test]
    fn dates_and_names_are_vllms() {
        assert_eq!(date_of(0), "19700101-000000");
        assert_eq!(date_of(1_764_942_000), "20251205-134000");
        let meta = Meta {
            backend: "vllm".into(),
            model_id: "meta-llama/Llama-3.1-8B".into(),
            tokenizer_id: "t".into(),
            num_prompts: 1,
            request_rate: 2.0,
            burstiness: 1.0,
            max_concurrency: Some(8),
            date: "20251205-134000".into(),
        };
        assert_eq!(
            default_filename(&meta),
            "vllm-2.0qps-concurrency8-Llama-3.1-8B-20251205-134000.json"
        );
    }

    #[test]
    fn bad_metric_lists_are_refused() {
        assert!(
            parse_metrics("ttft,foo")
                .unwrap_err()
                .to_string()
                .contains("`foo`")
        );
        assert_eq!(parse_percentiles("50, 99.9").unwrap(), vec![50.0, 99.9]);
        assert!(parse_percentiles("101").is_err());
    }
}
