//! The dense reference forward: the same weights and arithmetic as the paged forward,
//! each sequence's K/V in one contiguous buffer instead of blocks. Tests compare the two
//! for equality; the benchmark compares their cost.

use candle_core::{Device, Tensor};

use lockstep_actors::vocab::TokenLogprobs;

use super::Model;
use super::error::{ModelError, Result};
use super::forward::{KvStore, LayerRows, Rows, forward_with};
use super::ops::attention;
use super::paged_attention::AttentionShape;
use super::sampling::token_logprobs;

/// One sequence's contiguous K/V, per layer, `[len, kv_heads * head_dim]` row-major.
#[derive(Debug, Clone)]
pub struct DenseSequence {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl DenseSequence {
    /// An empty sequence for `model`.
    pub fn new(model: &Model) -> Self {
        let layers = model.config.num_hidden_layers;
        DenseSequence {
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            len: 0,
            kv_heads: model.config.num_key_value_heads,
            head_dim: model.config.head_dim,
        }
    }

    /// Tokens cached so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

struct DenseStore<'s> {
    sequences: Vec<&'s mut DenseSequence>,
}

impl DenseStore<'_> {
    /// Appends entry `entry`'s new K/V (positions `start..start + n`) to its buffers and
    /// returns all of them, `[start + n, kv_heads, head_dim]`.
    fn store_and_read(
        &mut self,
        layer: usize,
        entry: usize,
        start: usize,
        keys: &Tensor,
        values: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let sequence = &mut self.sequences[entry];
        let stride = sequence.kv_heads * sequence.head_dim;
        let n = keys.dim(0)?;
        sequence.keys[layer].truncate(start * stride);
        sequence.values[layer].truncate(start * stride);
        sequence.keys[layer].extend(keys.flatten_all()?.to_vec1::<f32>()?);
        sequence.values[layer].extend(values.flatten_all()?.to_vec1::<f32>()?);
        let shape = (start + n, sequence.kv_heads, sequence.head_dim);
        Ok((
            Tensor::from_slice(&sequence.keys[layer], shape, &Device::Cpu)?,
            Tensor::from_slice(&sequence.values[layer], shape, &Device::Cpu)?,
        ))
    }
}

/// The reference attends with candle tensor ops (`ops::attention`), entry by entry: an
/// implementation independent of the paged store's loops.
impl KvStore for DenseStore<'_> {
    fn attend(
        &mut self,
        layer: usize,
        entries: &[(usize, &[u32])],
        rows: LayerRows<'_>,
    ) -> Result<Vec<f32>> {
        let AttentionShape {
            heads,
            kv_heads,
            head_dim,
            window,
        } = rows.shape;
        let total = rows.tokens();
        let cpu = &Device::Cpu;
        let queries = Tensor::from_slice(rows.queries, (total, heads, head_dim), cpu)?;
        let keys = Tensor::from_slice(rows.keys, (total, kv_heads, head_dim), cpu)?;
        let values = Tensor::from_slice(rows.values, (total, kv_heads, head_dim), cpu)?;
        let mut outputs = Vec::with_capacity(entries.len());
        let mut row = 0;
        for (entry, &(start, ids)) in entries.iter().enumerate() {
            let n = ids.len();
            let (k, v) = self.store_and_read(
                layer,
                entry,
                start,
                &keys.narrow(0, row, n)?,
                &values.narrow(0, row, n)?,
            )?;
            outputs.push(attention(
                &queries.narrow(0, row, n)?,
                &k,
                &v,
                start,
                0,
                window,
            )?);
            row += n;
        }
        Ok(Tensor::cat(&outputs, 0)?.flatten_all()?.to_vec1::<f32>()?)
    }
}

/// Appends `new_tokens[i]` to `sequences[i]` for every `i` in one batched forward and
/// returns each sequence's logits at its last new position.
pub fn forward_dense(
    model: &Model,
    sequences: &mut [DenseSequence],
    new_tokens: &[&[u32]],
) -> Result<Vec<Vec<f32>>> {
    if sequences.len() != new_tokens.len() {
        return Err(ModelError::InvalidBatch(format!(
            "{} sequences but {} token lists",
            sequences.len(),
            new_tokens.len()
        )));
    }
    let entries: Vec<(usize, &[u32])> = sequences
        .iter()
        .zip(new_tokens)
        .map(|(s, t)| (s.len, *t))
        .collect();
    let logits = forward_with(
        model,
        &entries,
        &mut DenseStore {
            sequences: sequences.iter_mut().collect(),
        },
        Rows::Last,
    )?;
    for (sequence, tokens) in sequences.iter_mut().zip(new_tokens) {
        sequence.len += tokens.len();
    }
    Ok(logits)
}

/// The prompt's log-probabilities (what completions' `echo` with `logprobs` shows, as
/// vLLM's `prompt_logprobs`): for each token after the first, its log-probability given
/// the tokens before it and the `top` most likely tokens' there, from one forward over
/// the whole prompt (the LM head on every position). The first token has none.
pub fn prompt_logprobs(model: &Model, prompt: &[u32], top: usize) -> Result<Vec<TokenLogprobs>> {
    if prompt.len() < 2 {
        return Ok(Vec::new());
    }
    let mut sequence = DenseSequence::new(model);
    let logits = forward_with(
        model,
        &[(0, prompt)],
        &mut DenseStore {
            sequences: vec![&mut sequence],
        },
        Rows::All,
    )?;
    Ok(logits
        .iter()
        .zip(&prompt[1..])
        .map(|(row, &token)| {
            let (logprob, top) = token_logprobs(row, token, top);
            TokenLogprobs {
                token,
                logprob,
                top,
            }
        })
        .collect())
}

/// The reference generation: `count` greedy tokens after `prompt`, one sequence, no
/// paging and no batching (what every driver's paged, batched run must reproduce).
pub fn greedy_reference(model: &Model, prompt: &[u32], count: usize) -> Result<Vec<u32>> {
    let mut sequence = [DenseSequence::new(model)];
    let mut logits = forward_dense(model, &mut sequence, &[prompt])?;
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let token = super::sampling::argmax(&logits[0]);
        out.push(token);
        if out.len() < count {
            logits = forward_dense(model, &mut sequence, &[&[token]])?;
        }
    }
    Ok(out)
}
