//! The paged K/V store: per layer, a pool of blocks of `tokens_per_block` slots, addressed
//! by the block tables the KV manager hands out.
//!
//! A request's token at position `p` lives in block `table[p / tokens_per_block]`, slot
//! `p % tokens_per_block`. Block ids are plain integers into the pool, so two requests
//! whose tables name the same block share its K/V (prefix reuse) without copying.

use candle_core::{Device, Tensor};

use super::error::{ModelError, Result};

/// Geometry of the paged store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedKvGeometry {
    /// Transformer layers (one K and one V pool each).
    pub layers: usize,
    /// Blocks in each pool.
    pub num_blocks: usize,
    /// Token slots per block.
    pub tokens_per_block: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl PagedKvGeometry {
    /// Floats one token occupies in one layer's K (or V) pool.
    fn token_stride(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Floats one block occupies in one layer's K (or V) pool.
    fn block_stride(&self) -> usize {
        self.tokens_per_block * self.token_stride()
    }

    /// Bytes of one block across every layer, K and V (what a transceiver moves; the
    /// pool is `num_blocks` of them).
    pub fn block_bytes(&self) -> usize {
        2 * self.layers * self.block_stride() * std::mem::size_of::<f32>()
    }
}

/// The K/V of every block, per layer; layout `[block, slot, kv_head, head_dim]`.
#[derive(Debug, Clone)]
pub struct PagedKvCache {
    geometry: PagedKvGeometry,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl PagedKvCache {
    /// A zeroed store of the given geometry.
    pub fn new(geometry: PagedKvGeometry) -> Result<Self> {
        if geometry.tokens_per_block == 0 {
            return Err(ModelError::InvalidBatch(
                "tokens_per_block must be positive".into(),
            ));
        }
        let pool = geometry.num_blocks * geometry.block_stride();
        Ok(PagedKvCache {
            geometry,
            // One allocation per pool (not clones of one): zeroed pages stay untouched
            // until a block is written.
            keys: (0..geometry.layers).map(|_| vec![0.0; pool]).collect(),
            values: (0..geometry.layers).map(|_| vec![0.0; pool]).collect(),
        })
    }

    /// The store's geometry.
    pub fn geometry(&self) -> PagedKvGeometry {
        self.geometry
    }

    /// Checks that `table` covers positions `0..end` with blocks inside the pool.
    pub fn check_table(&self, table: &[u32], end: usize) -> Result<()> {
        let needed = end.div_ceil(self.geometry.tokens_per_block);
        if table.len() < needed {
            return Err(ModelError::InvalidBatch(format!(
                "block table of {} blocks covers {} tokens, {end} needed",
                table.len(),
                table.len() * self.geometry.tokens_per_block
            )));
        }
        if let Some(&bad) = table[..needed]
            .iter()
            .find(|&&b| b as usize >= self.geometry.num_blocks)
        {
            return Err(ModelError::InvalidBatch(format!(
                "block id {bad} outside the pool of {} blocks",
                self.geometry.num_blocks
            )));
        }
        Ok(())
    }

    /// Float offset of position `position` of a request with block table `table`.
    fn offset(&self, table: &[u32], position: usize) -> usize {
        let g = &self.geometry;
        let block = table[position / g.tokens_per_block] as usize;
        let slot = position % g.tokens_per_block;
        block * g.block_stride() + slot * g.token_stride()
    }

    /// Writes the K and V of tokens at positions `start..start + n` of the request
    /// whose block table is `table`. `keys` and `values` are `[n, kv_heads * head_dim]`,
    /// row-major. The table must already have passed [`check_table`](Self::check_table).
    pub fn write(
        &mut self,
        layer: usize,
        table: &[u32],
        start: usize,
        keys: &[f32],
        values: &[f32],
    ) {
        let stride = self.geometry.token_stride();
        let n = keys.len() / stride;
        for i in 0..n {
            let at = self.offset(table, start + i);
            let row = i * stride..(i + 1) * stride;
            self.keys[layer][at..at + stride].copy_from_slice(&keys[row.clone()]);
            self.values[layer][at..at + stride].copy_from_slice(&values[row]);
        }
    }

    /// The K and V rows (`[kv_heads * head_dim]` each) of position `position` of the
    /// request whose block table is `table`, read in place.
    pub(crate) fn token(&self, layer: usize, table: &[u32], position: usize) -> (&[f32], &[f32]) {
        let stride = self.geometry.token_stride();
        let at = self.offset(table, position);
        (
            &self.keys[layer][at..at + stride],
            &self.values[layer][at..at + stride],
        )
    }

    /// Gathers the K and V of positions `0..len` of the request whose block table is
    /// `table`, as two `[len, kv_heads, head_dim]` tensors. Copies whole blocks at a time:
    /// a block's slots are contiguous, so a gather is `len / tokens_per_block` copies.
    pub fn gather(&self, layer: usize, table: &[u32], len: usize) -> Result<(Tensor, Tensor)> {
        let g = &self.geometry;
        let stride = g.token_stride();
        let mut keys = Vec::with_capacity(len * stride);
        let mut values = Vec::with_capacity(len * stride);
        let mut position = 0;
        while position < len {
            let take = (len - position).min(g.tokens_per_block);
            let at = self.offset(table, position);
            keys.extend_from_slice(&self.keys[layer][at..at + take * stride]);
            values.extend_from_slice(&self.values[layer][at..at + take * stride]);
            position += take;
        }
        let shape = (len, g.kv_heads, g.head_dim);
        Ok((
            Tensor::from_vec(keys, shape, &Device::Cpu)?,
            Tensor::from_vec(values, shape, &Device::Cpu)?,
        ))
    }

    /// The raw K floats of one block of one layer.
    pub fn block_keys(&self, layer: usize, block: u32) -> Option<&[f32]> {
        let stride = self.geometry.block_stride();
        let start = block as usize * stride;
        self.keys.get(layer)?.get(start..start + stride)
    }

    /// Bytes of one block across every layer, K then V (what a transceiver moves).
    pub fn block_bytes(&self) -> usize {
        self.geometry.block_bytes()
    }

    /// Block `block`'s K and V of every layer as little-endian bytes: layer 0's K, layer
    /// 0's V, layer 1's K, and so on. `None` outside the pool.
    pub fn read_block(&self, block: u32) -> Option<Vec<u8>> {
        let stride = self.geometry.block_stride();
        let start = (block as usize).checked_mul(stride)?;
        let mut out = Vec::with_capacity(self.block_bytes());
        for (keys, values) in self.keys.iter().zip(&self.values) {
            for pool in [keys, values] {
                let floats = pool.get(start..start + stride)?;
                out.extend(floats.iter().flat_map(|f| f.to_le_bytes()));
            }
        }
        Some(out)
    }

    /// Writes what [`read_block`](Self::read_block) read into block `block`. Bytes of
    /// the wrong length or a block outside the pool are an error that writes nothing.
    pub fn write_block(&mut self, block: u32, bytes: &[u8]) -> Result<()> {
        let g = self.geometry;
        if block as usize >= g.num_blocks {
            return Err(ModelError::InvalidBatch(format!(
                "block id {block} outside the pool of {} blocks",
                g.num_blocks
            )));
        }
        if bytes.len() != self.block_bytes() {
            return Err(ModelError::InvalidBatch(format!(
                "a K/V block of this model is {} bytes, {} arrived",
                self.block_bytes(),
                bytes.len()
            )));
        }
        let stride = g.block_stride();
        let start = block as usize * stride;
        let mut floats = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        for layer in 0..g.layers {
            for pool in [&mut self.keys[layer], &mut self.values[layer]] {
                for (slot, f) in pool[start..start + stride].iter_mut().zip(&mut floats) {
                    *slot = f;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> PagedKvCache {
        PagedKvCache::new(PagedKvGeometry {
            layers: 2,
            num_blocks: 3,
            tokens_per_block: 2,
            kv_heads: 1,
            head_dim: 2,
        })
        .expect("pool")
    }

    #[test]
    fn a_block_read_from_one_pool_and_written_into_another_holds_the_same_k_and_v() {
        let mut from = pool();
        // Positions 0..4 of a request whose table is [2, 0]: blocks 2 and 0.
        for layer in 0..2 {
            let keys: Vec<f32> = (0..8).map(|i| (layer * 100 + i) as f32).collect();
            let values: Vec<f32> = keys.iter().map(|k| -k).collect();
            from.write(layer, &[2, 0], 0, &keys, &values);
        }
        let bytes = from.read_block(2).expect("in the pool");
        assert_eq!(bytes.len(), from.block_bytes());
        let mut to = pool();
        to.write_block(1, &bytes).expect("written");
        for layer in 0..2 {
            assert_eq!(to.block_keys(layer, 1), from.block_keys(layer, 2));
            let (_, v_to) = to.gather(layer, &[1], 2).expect("gather");
            let (_, v_from) = from.gather(layer, &[2], 2).expect("gather");
            assert_eq!(
                v_to.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                v_from.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
        }
        // Another block differs (the copy was not of zeros).
        assert_ne!(to.block_keys(0, 1), to.block_keys(0, 0));
    }

    #[test]
    fn a_block_of_the_wrong_size_or_outside_the_pool_is_refused_and_writes_nothing() {
        let mut p = pool();
        let size = p.block_bytes();
        let err = p.write_block(0, &vec![1u8; size - 4]).unwrap_err();
        assert!(err.to_string().contains(&format!("{size} bytes")), "{err}");
        let err = p.write_block(3, &vec![1u8; size]).unwrap_err();
        assert!(err.to_string().contains("block id 3"), "{err}");
        assert!(p.read_block(0).unwrap().iter().all(|&b| b == 0));
        assert_eq!(p.read_block(3), None);
    }
}
