//! Choosing the next token from logits: greedy, or temperature / top-k / top-p with a
//! per-request seed, so a seeded request draws the same tokens on every driver.

use pulp::Arch;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::error::{ModelError, Result};

/// How one request samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy (argmax); above 0 divides the logits before the softmax.
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches this
    /// (1 keeps all).
    pub top_p: f32,
    /// Keep only the `k` most likely tokens (0 keeps all).
    pub top_k: usize,
    /// Seed of the request's random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

/// A request's sampler: its parameters and its own random stream. The stream is a
/// ChaCha generator seeded by the request alone, so the draws depend on nothing else
/// (not the batch, the rank, the thread or the driver).
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler for `params`, or an error when they are out of range.
    pub fn new(params: SamplingParams) -> Result<Self> {
        if !params.temperature.is_finite() || params.temperature < 0.0 {
            return Err(ModelError::InvalidSampling(format!(
                "temperature {} must be finite and non-negative",
                params.temperature
            )));
        }
        if !(params.top_p > 0.0 && params.top_p <= 1.0) {
            return Err(ModelError::InvalidSampling(format!(
                "top_p {} must be in (0, 1]",
                params.top_p
            )));
        }
        Ok(Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
        })
    }

    /// The next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(ModelError::InvalidSampling("no logits".into()));
        }
        if self.params.temperature == 0.0 {
            return Ok(argmax(logits));
        }
        // Candidates in descending likelihood; ties broken by token id so the order,
        // and hence the draw, is the same everywhere.
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        if self.params.top_k > 0 {
            order.truncate(self.params.top_k);
        }
        let max = logits[order[0] as usize];
        let mut weights: Vec<f64> = order
            .iter()
            .map(|&t| (((logits[t as usize] - max) / self.params.temperature) as f64).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        if self.params.top_p < 1.0 {
            let mut kept = 0.0;
            let mut keep = weights.len();
            for (i, w) in weights.iter().enumerate() {
                kept += w / total;
                if kept >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            order.truncate(keep);
            weights.truncate(keep);
        }
        let total: f64 = weights.iter().sum();
        let mut target = self.rng.random::<f64>() * total;
        for (i, w) in weights.iter().enumerate() {
            if target < *w {
                return Ok(order[i]);
            }
            target -= w;
        }
        Ok(order[order.len() - 1])
    }
}

/// The most likely token; the lowest id among equals (NaN logits are never the most
/// likely; all NaN gives 0).
pub fn argmax(logits: &[f32]) -> u32 {
    // Two passes the compiler vectorizes (a scan that tracks the best index is a branch
    // per logit): the largest value in sixteen running maxima, then the first chunk that
    // holds it, searched element by element.
    Arch::new().dispatch(
        #[inline(always)]
        || {
            let mut lanes = [f32::NEG_INFINITY; 16];
            let chunks = logits.chunks_exact(16);
            let mut best = chunks
                .remainder()
                .iter()
                .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
            for chunk in chunks {
                for (lane, &l) in lanes.iter_mut().zip(chunk) {
                    *lane = if l > *lane { l } else { *lane };
                }
            }
            for lane in lanes {
                best = if lane > best { lane } else { best };
            }
            let mut offset = 0;
            for chunk in logits.chunks(16) {
                if chunk.iter().fold(false, |found, &l| found | (l == best)) {
                    let within = chunk.iter().position(|&l| l == best).unwrap_or(0);
                    return (offset + within) as u32;
                }
                offset += chunk.len();
            }
            0
        },
    )
}

/// A request's penalties on tokens it has seen, as vLLM applies them (its order:
/// repetition, then frequency, then presence).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// Subtracted once from the logit of every token the output holds (OpenAI's
    /// `presence_penalty`).
    pub presence: f32,
    /// Subtracted from a token's logit once per time the output holds it (OpenAI's
    /// `frequency_penalty`).
    pub frequency: f32,
    /// A token of the prompt or the output: a positive logit is divided by it, a
    /// negative one multiplied (vLLM's `repetition_penalty`; 1 is none).
    pub repetition: f32,
}

impl Penalties {
    /// No penalty.
    pub const NONE: Penalties = Penalties {
        presence: 0.0,
        frequency: 0.0,
        repetition: 1.0,
    };

    /// Whether they change nothing (then no pass over the history is made).
    pub fn is_none(&self) -> bool {
        *self == Penalties::NONE
    }
}

/// Per-token counts [`apply_penalties`] needs, kept across steps so that a penalised
/// step allocates nothing once the vectors have the vocabulary's length. Left all zero
/// and all false after every call.
#[derive(Debug, Clone, Default)]
pub struct PenaltyScratch {
    output_counts: Vec<u32>,
    seen: Vec<bool>,
}

/// Applies `penalties` to `logits`: repetition over the tokens of `prompt` and
/// `output`, frequency and presence over those of `output`. Ids outside the logits are
/// ignored.
pub fn apply_penalties(
    logits: &mut [f32],
    penalties: Penalties,
    prompt: &[u32],
    output: &[u32],
    scratch: &mut PenaltyScratch,
) {
    let vocab = logits.len();
    if scratch.output_counts.len() < vocab {
        scratch.output_counts.resize(vocab, 0);
        scratch.seen.resize(vocab, false);
    }
    let in_vocab = |t: &&u32| (**t as usize) < vocab;
    if penalties.repetition != 1.0 {
        for &t in prompt.iter().chain(output).filter(in_vocab) {
            scratch.seen[t as usize] = true;
        }
        // Each distinct token once: its flag is cleared as it is penalised.
        for &t in prompt.iter().chain(output).filter(in_vocab) {
            let t = t as usize;
            if std::mem::take(&mut scratch.seen[t]) {
                let l = &mut logits[t];
                *l = if *l > 0.0 {
                    *l / penalties.repetition
                } else {
                    *l * penalties.repetition
                };
            }
        }
    }
    if penalties.frequency != 0.0 || penalties.presence != 0.0 {
        for &t in output.iter().filter(in_vocab) {
            scratch.output_counts[t as usize] += 1;
        }
        for &t in output.iter().filter(in_vocab) {
            let count = std::mem::take(&mut scratch.output_counts[t as usize]);
            if count > 0 {
                logits[t as usize] -= penalties.frequency * count as f32 + penalties.presence;
            }
        }
    }
}

/// Adds each `(token, bias)` to its token's logit (`logit_bias`); ids outside the
/// logits are ignored (the API refused them).
pub fn apply_logit_bias(logits: &mut [f32], bias: impl IntoIterator<Item = (u32, f32)>) {
    for (token, b) in bias {
        if let Some(l) = logits.get_mut(token as usize) {
            *l += b;
        }
    }
}

/// Makes `ids` impossible to sample (`min_tokens` masks the end of the answer).
pub fn mask_tokens(logits: &mut [f32], ids: &[u32]) {
    for &t in ids {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// The log-softmax of `logits` at `token`, and the `top` most likely tokens with theirs,
/// most likely first (ties: lower id first). The normaliser is summed in f64, so a
/// large vocabulary loses no precision to it.
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return (f32::NEG_INFINITY, Vec::new());
    }
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_normaliser = f64::from(max) + sum.ln();
    let logprob = |l: f32| (f64::from(l) - log_normaliser) as f32;
    // A small sorted list (top is at most 20): one pass, no copy of the vocabulary.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (id, &l) in logits.iter().enumerate() {
            if best.len() == top && best.last().is_some_and(|&(_, worst)| l <= worst) {
                continue;
            }
            let at = best.partition_point(|&(_, b)| b >= l);
            best.insert(at, (id as u32, l));
            best.truncate(top);
        }
    }
    let own = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| logprob(l));
    (
        own,
        best.into_iter().map(|(id, l)| (id, logprob(l))).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::argmax;

    /// The scan the vectorized search replaces: first index of the largest logit.
    fn scan(logits: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_index_of_the_largest_logit_at_every_length_and_place() {
        for len in [1, 2, 15, 16, 17, 31, 32, 33, 100, 32_000] {
            // Few distinct values, so ties are common; the best moves across chunk
            // boundaries and the remainder.
            let mut logits: Vec<f32> = (0..len)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761) % 7) as f32 - 3.0)
                .collect();
            assert_eq!(argmax(&logits), scan(&logits), "length {len}");
            for at in [0, len / 2, len - 1] {
                logits[at] = 10.0;
                assert_eq!(argmax(&logits), at as u32, "length {len}, best at {at}");
                logits[at] = -3.0;
            }
        }
        let masked = [
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            -5.0,
            f32::NEG_INFINITY,
        ];
        assert_eq!(argmax(&masked), 2);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 20]), 0);
        assert_eq!(
            argmax(&[1.0, f32::NAN, 3.0, f32::NAN]),
            2,
            "NaN is never the best"
        );
    }
}
