//! One batched forward over a mixed batch: prefill chunks and decode tokens of many
//! requests in one pass, their K/V read from and written to the paged store.
//!
//! Every token of the batch goes through the projections and the MLP together (one
//! matmul per weight per layer); only attention is per request, since each request
//! attends to its own cached tokens.

use candle_core::{Device, Tensor};

use super::Model;
use super::error::{ModelError, Result};
use super::ops::{RotaryAngles, attention, gated_mlp, rms_norm};
use super::paged_kv::PagedKvCache;

/// One request's share of a forward.
#[derive(Debug, Clone, Copy)]
pub struct BatchEntry<'a> {
    /// The request's block table: block ids in the paged store, in position order.
    pub block_table: &'a [u32],
    /// Position of the first new token (= tokens already cached for this request).
    pub start_position: usize,
    /// The new tokens: a prefill chunk, or one decode token.
    pub token_ids: &'a [u32],
    /// A dummy entry (padding a rank's batch) runs the arithmetic but writes no K/V and
    /// reads none from the cache: it attends to its own tokens only, so whatever its
    /// block table says, no real request's blocks change.
    pub dummy: bool,
}

/// Where the forward keeps K/V: the paged store, or the dense reference's buffers.
pub(crate) trait KvStore {
    /// Stores the new tokens' K/V of entry `entry` in layer `layer` (`[n, kv_heads,
    /// head_dim]`, positions `start..start + n`) and returns the K/V the entry's queries
    /// attend to, with the position of their first key.
    fn store_and_read(
        &mut self,
        layer: usize,
        entry: usize,
        start: usize,
        keys: &Tensor,
        values: &Tensor,
    ) -> Result<(Tensor, Tensor, usize)>;
}

/// Runs every layer over the batch's new tokens; returns each entry's last-position
/// logits. `entries` gives each entry's start position and new tokens.
pub(crate) fn forward_with(
    model: &Model,
    entries: &[(usize, &[u32])],
    store: &mut impl KvStore,
) -> Result<Vec<Vec<f32>>> {
    let config = &model.config;
    let mut tokens = Vec::new();
    let mut positions = Vec::new();
    for &(start, ids) in entries {
        if ids.is_empty() {
            return Err(ModelError::InvalidBatch(
                "an entry has no new tokens".into(),
            ));
        }
        if start + ids.len() > config.max_position_embeddings {
            return Err(ModelError::InvalidBatch(format!(
                "positions up to {} exceed max_position_embeddings {}",
                start + ids.len(),
                config.max_position_embeddings
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= config.vocab_size) {
            return Err(ModelError::InvalidBatch(format!(
                "token id {bad} outside the vocabulary of {}",
                config.vocab_size
            )));
        }
        tokens.extend_from_slice(ids);
        positions.extend((start..start + ids.len()).map(|p| p as u32));
    }
    if tokens.is_empty() {
        return Ok(Vec::new());
    }
    let total = tokens.len();
    let (heads, kv_heads, head_dim) = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    );
    let ids = Tensor::from_vec(tokens, total, &Device::Cpu)?;
    let mut x = model.weights.embed_tokens.index_select(&ids, 0)?;
    let rotary = RotaryAngles::new(&positions, &config.inverse_frequencies())?;
    for (layer_index, layer) in model.weights.layers.iter().enumerate() {
        let h = rms_norm(&x, &layer.input_layernorm, config.rms_norm_eps)?;
        let q = layer
            .q_proj
            .forward(&h)?
            .reshape((total, heads, head_dim))?;
        let k = layer
            .k_proj
            .forward(&h)?
            .reshape((total, kv_heads, head_dim))?;
        let v = layer
            .v_proj
            .forward(&h)?
            .reshape((total, kv_heads, head_dim))?;
        let q = rotary.apply(&q)?;
        let k = rotary.apply(&k)?;
        let mut outputs = Vec::with_capacity(entries.len());
        let mut row = 0;
        for (entry, &(start, ids)) in entries.iter().enumerate() {
            let n = ids.len();
            let (keys, values, context_start) = store.store_and_read(
                layer_index,
                entry,
                start,
                &k.narrow(0, row, n)?,
                &v.narrow(0, row, n)?,
            )?;
            outputs.push(attention(
                &q.narrow(0, row, n)?,
                &keys,
                &values,
                start,
                context_start,
                config.sliding_window,
            )?);
            row += n;
        }
        let attended = Tensor::cat(&outputs, 0)?;
        x = (x + layer.o_proj.forward(&attended)?)?;
        let h = rms_norm(&x, &layer.post_attention_layernorm, config.rms_norm_eps)?;
        x = (x + gated_mlp(&h, layer, config.hidden_act)?)?;
    }
    // Only each entry's last position is sampled from: the LM head (the widest matmul)
    // runs on those rows alone.
    let mut last_rows = Vec::with_capacity(entries.len());
    let mut end = 0u32;
    for &(_, ids) in entries {
        end += ids.len() as u32;
        last_rows.push(end - 1);
    }
    let count = last_rows.len();
    let last = x.index_select(&Tensor::from_vec(last_rows, count, &Device::Cpu)?, 0)?;
    let normed = rms_norm(&last, &model.weights.norm, config.rms_norm_eps)?;
    Ok(model.weights.lm_head.forward(&normed)?.to_vec2::<f32>()?)
}

/// The paged store seen through the batch's block tables.
struct PagedStore<'c, 'b> {
    cache: &'c mut PagedKvCache,
    batch: &'b [BatchEntry<'b>],
}

impl KvStore for PagedStore<'_, '_> {
    fn store_and_read(
        &mut self,
        layer: usize,
        entry: usize,
        start: usize,
        keys: &Tensor,
        values: &Tensor,
    ) -> Result<(Tensor, Tensor, usize)> {
        let e = &self.batch[entry];
        if e.dummy {
            return Ok((keys.clone(), values.clone(), start));
        }
        let n = keys.dim(0)?;
        let key_rows = keys.flatten_all()?.to_vec1::<f32>()?;
        let value_rows = values.flatten_all()?.to_vec1::<f32>()?;
        self.cache
            .write(layer, e.block_table, start, &key_rows, &value_rows);
        let (keys, values) = self.cache.gather(layer, e.block_table, start + n)?;
        Ok((keys, values, 0))
    }
}

/// Runs one forward over `batch`, writing each real entry's new K/V into `cache` at the
/// slots its block table names and attending over its cached and new tokens. Returns
/// each entry's logits at its last new position (`[vocab]` per entry, dummies included).
pub fn forward_paged(
    model: &Model,
    cache: &mut PagedKvCache,
    batch: &[BatchEntry<'_>],
) -> Result<Vec<Vec<f32>>> {
    let geometry = cache.geometry();
    if geometry.layers != model.config.num_hidden_layers
        || geometry.kv_heads != model.config.num_key_value_heads
        || geometry.head_dim != model.config.head_dim
    {
        return Err(ModelError::InvalidBatch(
            "the paged store's geometry does not match the model".into(),
        ));
    }
    for entry in batch.iter().filter(|e| !e.dummy) {
        cache.check_table(
            entry.block_table,
            entry.start_position + entry.token_ids.len(),
        )?;
    }
    let entries: Vec<(usize, &[u32])> = batch
        .iter()
        .map(|e| (e.start_position, e.token_ids))
        .collect();
    forward_with(model, &entries, &mut PagedStore { cache, batch })
}
