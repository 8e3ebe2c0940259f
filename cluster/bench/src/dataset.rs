//! `vllm bench serve`'s datasets and arrival process, as a request trace: `random`
//! (`--random-input-len`, `--random-output-len`, `--random-range-ratio`) or `sharegpt`
//! (`--dataset-path`), `--num-prompts` of them, arriving all at once
//! (`--request-rate inf`) or with gamma-distributed gaps of mean `1/rate`
//! (`--burstiness` the shape: 1 is Poisson), written as a Mooncake trace the workload
//! replays.

use std::fmt::Write;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

/// Why a dataset's requests could not be made.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// `sharegpt` without a file.
    #[error(
        "--dataset-name sharegpt needs --dataset-path FILE (ShareGPT's JSON, e.g. ShareGPT_V3_unfiltered_cleaned_split.json)"
    )]
    NoPath,
    /// The file could not be read.
    #[error("--dataset-path {path}: {why}")]
    Read {
        /// The file.
        path: String,
        /// What reading it said.
        why: String,
    },
    /// The file is not JSON.
    #[error("--dataset-path {path}: not ShareGPT JSON: {why}")]
    NotJson {
        /// The file.
        path: String,
        /// What the parser said.
        why: String,
    },
    /// The JSON is not an array.
    #[error(
        "--dataset-path {path}: expected a JSON array of {{\"conversations\": [...]}}, got {got}"
    )]
    NotArray {
        /// The file.
        path: String,
        /// What it holds instead.
        got: &'static str,
    },
    /// No item has two turns.
    #[error(
        "--dataset-path {path}: no conversation with two turns (`conversations`: [{{\"from\": \"human\", \"value\": …}}, {{\"from\": \"gpt\", \"value\": …}}])"
    )]
    NoConversation {
        /// The file.
        path: String,
    },
    /// Fewer usable conversations than requests asked for.
    #[error(
        "--dataset-path {path}: only {fit} conversations fit vLLM's ShareGPT filter (prompt and answer of 4 tokens or more, prompt at most 1024, both at most 2048), fewer than --num-prompts {wanted}"
    )]
    TooFew {
        /// The file.
        path: String,
        /// Conversations that pass the filter.
        fit: usize,
        /// `--num-prompts`.
        wanted: u64,
    },
}

/// Which dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatasetName {
    /// Lengths drawn uniformly around `--random-input-len` / `--random-output-len`.
    Random,
    /// Lengths of ShareGPT conversations' first human turn and first answer.
    ShareGpt,
}

/// What the dataset flags say.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Which dataset.
    pub name: DatasetName,
    /// The ShareGPT JSON file.
    pub path: Option<std::path::PathBuf>,
    /// Requests.
    pub num_prompts: u64,
    /// Random: prompt tokens.
    pub random_input_len: u32,
    /// Random: output tokens.
    pub random_output_len: u32,
    /// Random: lengths are uniform in `[len·(1−r), len·(1+r)]`.
    pub random_range_ratio: f64,
    /// ShareGPT: every output this long instead of the answer's.
    pub sharegpt_output_len: Option<u32>,
    /// Requests per second (infinite: all at once).
    pub request_rate: f64,
    /// The gamma distribution's shape (1: Poisson).
    pub burstiness: f64,
    /// Seeds the lengths, the ShareGPT sample and the arrival gaps.
    pub seed: u64,
}

/// One request of the dataset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DatasetRequest {
    /// Arrival, ms from the start.
    pub at_ms: f64,
    /// Prompt tokens.
    pub input_len: u32,
    /// Output tokens.
    pub output_len: u32,
}

/// Words of a text, as lockstep counts tokens without a tokenizer.
fn words(text: &str) -> u32 {
    u32::try_from(text.split_whitespace().count()).unwrap_or(u32::MAX)
}

/// A tokenizer counting tokens, or `None` for words.
pub type Counter<'a> = Option<&'a tokenizers::Tokenizer>;

fn count(counter: Counter<'_>, text: &str) -> u32 {
    match counter {
        Some(t) => t
            .encode(text, false)
            .map(|e| u32::try_from(e.len()).unwrap_or(u32::MAX))
            .unwrap_or_else(|_| words(text)),
        None => words(text),
    }
}

/// ShareGPT's (prompt, answer) lengths, as vLLM samples them: conversations with at
/// least two turns, the first two taken; shuffled with the seed; pairs with a prompt
/// or an answer under 4 tokens, a prompt over 1,024 or both over 2,048 left out (a
/// fixed output length waives only the answer's minimum, as vLLM's
/// `is_valid_sequence`).
pub fn sharegpt_lengths(
    text: &str,
    path: &str,
    counter: Counter<'_>,
    d: &Dataset,
) -> Result<Vec<(u32, u32)>, DatasetError> {
    let v: Value = serde_json::from_str(text).map_err(|e| DatasetError::NotJson {
        path: path.to_string(),
        why: e.to_string(),
    })?;
    let Value::Array(items) = v else {
        return Err(DatasetError::NotArray {
            path: path.to_string(),
            got: kind(&v),
        });
    };
    let mut pairs: Vec<(&str, &str)> = items
        .iter()
        .filter_map(|item| {
            let turns = item.get("conversations")?.as_array()?;
            if turns.len() < 2 {
                return None;
            }
            Some((turn_text(&turns[0])?, turn_text(&turns[1])?))
        })
        .collect();
    if pairs.is_empty() {
        return Err(DatasetError::NoConversation {
            path: path.to_string(),
        });
    }
    let mut rng = ChaCha8Rng::seed_from_u64(d.seed);
    // Fisher–Yates, as random.shuffle.
    for i in (1..pairs.len()).rev() {
        let j = rng.random_range(0..=i);
        pairs.swap(i, j);
    }
    let mut out = Vec::new();
    for (prompt, answer) in pairs {
        if out.len() as u64 >= d.num_prompts {
            break;
        }
        let input = count(counter, prompt);
        let output = d
            .sharegpt_output_len
            .unwrap_or_else(|| count(counter, answer));
        let too_short = input < 4 || (d.sharegpt_output_len.is_none() && output < 4);
        if too_short || input > 1024 || input + output > 2048 {
            continue;
        }
        out.push((input, output));
    }
    if (out.len() as u64) < d.num_prompts {
        return Err(DatasetError::TooFew {
            path: path.to_string(),
            fit: out.len(),
            wanted: d.num_prompts,
        });
    }
    Ok(out)
}

fn turn_text(turn: &Value) -> Option<&str> {
    turn.get("value").and_then(Value::as_str)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Random lengths, as vLLM's random dataset: uniform integers in
/// `[⌊len·(1−r)⌋, ⌈len·(1+r)⌉]`, at least 1.
pub fn random_lengths(d: &Dataset) -> Vec<(u32, u32)> {
    let mut rng = ChaCha8Rng::seed_from_u64(d.seed);
    let range = |len: u32| {
        let lo = ((f64::from(len) * (1.0 - d.random_range_ratio)).floor() as u32).max(1);
        let hi = ((f64::from(len) * (1.0 + d.random_range_ratio)).ceil() as u32).max(lo);
        (lo, hi)
    };
    let (ilo, ihi) = range(d.random_input_len);
    let (olo, ohi) = range(d.random_output_len);
    (0..d.num_prompts)
        .map(|_| (rng.random_range(ilo..=ihi), rng.random_range(olo..=ohi)))
        .collect()
}

/// One gamma(shape, scale) draw (Marsaglia–Tsang; shape < 1 boosted).
fn gamma(rng: &mut impl Rng, shape: f64, scale: f64) -> f64 {
    if shape < 1.0 {
        let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        return gamma(rng, shape + 1.0, scale) * u.powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        // A standard normal, Box–Muller.
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random();
        let x = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v * scale;
        }
    }
}

/// Arrival times in ms of `n` requests, as vLLM's `get_request`: the first at 0, then
/// gaps drawn from gamma(shape = burstiness, scale = 1/(rate·burstiness)) seconds (mean
/// 1/rate); all at 0 for an infinite rate.
pub fn arrivals_ms(n: usize, rate: f64, burstiness: f64, seed: u64) -> Vec<f64> {
    if rate.is_infinite() {
        return vec![0.0; n];
    }
    // Apart from the lengths' stream.
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xA881_7A15);
    let scale = 1.0 / (rate * burstiness);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let at = t;
            t += gamma(&mut rng, burstiness, scale) * 1e3;
            at
        })
        .collect()
}

/// The dataset's requests: lengths from the dataset, arrivals from the rate.
pub fn requests(d: &Dataset, counter: Counter<'_>) -> Result<Vec<DatasetRequest>, DatasetError> {
    let lens = match d.name {
        DatasetName::Random => random_lengths(d),
        DatasetName::ShareGpt => {
            let path = d.path.as_deref().ok_or(DatasetError::NoPath)?;
            let shown = path.display().to_string();
            let text = std::fs::read_to_string(path).map_err(|e| DatasetError::Read {
                path: shown.clone(),
                why: e.to_string(),
            })?;
            sharegpt_lengths(&text, &shown, counter, d)?
        }
    };
    let times = arrivals_ms(lens.len(), d.request_rate, d.burstiness, d.seed);
    Ok(lens
        .into_iter()
        .zip(times)
        .map(|((input_len, output_len), at_ms)| DatasetRequest {
            at_ms,
            input_len,
            output_len,
        })
        .collect())
}

/// The requests as a Mooncake trace whose blocks are `block_tokens` tokens, every
/// request's blocks its own (no prefix is shared, as vLLM's random prompts share none).
pub fn mooncake_trace(requests: &[DatasetRequest], block_tokens: u32) -> String {
    let mut o = String::new();
    for (i, r) in requests.iter().enumerate() {
        let blocks = r.input_len.div_ceil(block_tokens) as u64;
        let base = (i as u64 + 1) << 24;
        let ids: Vec<String> = (0..blocks).map(|b| (base | b).to_string()).collect();
        let _ = writeln!(
            o,
            "{{\"timestamp\": {:.6}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": [{}]}}",
            r.at_ms,
            r.input_len,
            r.output_len,
            ids.join(", ")
        );
    }
    o
}

/// Writes the trace to `path`.
pub fn write_trace(
    requests: &[DatasetRequest],
    block_tokens: u32,
    path: &Path,
) -> std::io::Result<()> {
    std::fs::write(path, mooncake_trace(requests, block_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(n: u64, rate: f64, burstiness: f64) -> Dataset {
        Dataset {
            name: DatasetName::Random,
            path: None,
            num_prompts: n,
            random_input_len: 100,
            random_output_len: 10,
            random_range_ratio: 0.5,
            sharegpt_output_len: None,
            request_rate: rate,
            burstiness,
            seed: 3,
        }
    }

    #[test]
    fn random_lengths_stay_in_vllms_range() {
        let lens = random_lengths(&random(500, f64::INFINITY, 1.0));
        assert_eq!(lens.len(), 500);
        assert!(
            lens.iter()
                .all(|&(i, o)| (50..=150).contains(&i) && (5..=15).contains(&o))
        );
        assert!(lens.iter().any(|&(i, _)| i < 70) && lens.iter().any(|&(i, _)| i > 130));
    }

    #[test]
    fn gaps_have_mean_one_over_rate_and_burstiness_sets_their_spread() {
        for (b, cv) in [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)] {
            let t = arrivals_ms(20_001, 10.0, b, 1);
            let gaps: Vec<f64> = t.windows(2).map(|w| w[1] - w[0]).collect();
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
            assert!((mean - 100.0).abs() < 4.0, "burstiness {b}: mean {mean}");
            let got = var.sqrt() / mean;
            assert!((got - cv).abs() < 0.1 * cv, "burstiness {b}: cv {got}");
        }
        assert_eq!(arrivals_ms(3, f64::INFINITY, 1.0, 0), vec![0.0; 3]);
    }

    #[test]
    fn sharegpt_takes_the_first_turns_and_filters_as_vllm() {
        let long = "w ".repeat(1100);
        let text = format!(
            r#"[{{"id":"a","conversations":[{{"from":"human","value":"one two three four five"}},{{"from":"gpt","value":"a b c d e f"}}]}},
               {{"id":"b","conversations":[{{"from":"human","value":"too short"}},{{"from":"gpt","value":"a b c d"}}]}},
               {{"id":"c","conversations":[{{"from":"human","value":"{long}"}},{{"from":"gpt","value":"a b c d"}}]}},
               {{"id":"d","conversations":[{{"from":"human","value":"only one turn"}}]}}]"#
        );
        let mut d = random(1, f64::INFINITY, 1.0);
        d.name = DatasetName::ShareGpt;
        assert_eq!(
            sharegpt_lengths(&text, "x", None, &d).unwrap(),
            vec![(5, 6)]
        );
        d.num_prompts = 2;
        let e = sharegpt_lengths(&text, "x", None, &d)
            .unwrap_err()
            .to_string();
        assert!(e.contains("only 1") && e.contains("--num-prompts 2"), "{e}");
        // A fixed output length replaces the answer's, below the answer's minimum too;
        // the prompt's limits still hold.
        d.num_prompts = 1;
        d.sharegpt_output_len = Some(2);
        assert_eq!(
            sharegpt_lengths(&text, "x", None, &d).unwrap(),
            vec![(5, 2)]
        );
    }
}
