//! Deterministic KV-cache contents for drivers that move real bytes between ranks (the
//! threads driver's disaggregated KV handoff). The ctx side fills a block as the backend
//! would have written it; the gen side checks what arrived. Contents depend only on
//! (request, block index), so any run — and any peer — can recompute them.

/// The most bytes one KV block carries between ranks. A real block is
/// `bytes_per_token × tokens_per_block` (about 1.1 MB for DeepSeek-V3 at 32 tokens per
/// block); moving that much per block would make tests slow and memory-hungry while
/// testing nothing more, so drivers send at most this much per block.
pub const MAX_KV_BLOCK_BYTES: usize = 4 * 1024;

/// Bytes one transferred block carries: the model's real block size, capped at
/// [`MAX_KV_BLOCK_BYTES`] (at least 1 byte so every block is checked).
pub fn block_bytes(bytes_per_token: u64, tokens_per_block: u32) -> usize {
    let real = bytes_per_token.saturating_mul(u64::from(tokens_per_block));
    usize::try_from(real)
        .unwrap_or(usize::MAX)
        .clamp(1, MAX_KV_BLOCK_BYTES)
}

/// One step of splitmix64: a well-mixed 64-bit stream from a counter.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `out` with the contents of block `block_index` of request `request`: a
/// splitmix64 stream seeded by both, so different blocks and requests differ.
pub fn fill_block(request: u64, block_index: u32, out: &mut [u8]) {
    let mut state = request.rotate_left(32) ^ u64::from(block_index) ^ 0x6B76_5F63_6F6E_7465;
    let mut chunks = out.chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let last = splitmix64(&mut state).to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

/// FNV-1a over little-endian 64-bit words (the tail zero-padded, the length mixed in):
/// a cheap checksum that catches any changed byte in transit, at a word per step — a
/// byte-wise FNV-1a over megabytes of KV per transfer costs more than the transfer's
/// modeled wire time.
pub fn checksum(bytes: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xCBF2_9CE4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01B3;
    let step = |hash: u64, word: u64| (hash ^ word).wrapping_mul(PRIME);
    let mut chunks = bytes.chunks_exact(8);
    let mut hash = (&mut chunks).fold(OFFSET_BASIS ^ bytes.len() as u64, |h, c| {
        step(h, u64::from_le_bytes(c.try_into().expect("8 bytes")))
    });
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 8];
        last[..rest.len()].copy_from_slice(rest);
        hash = step(hash, u64::from_le_bytes(last));
    }
    // Spread the last word's bits over the whole hash.
    hash ^ (hash >> 29)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contents_are_deterministic_and_differ_by_request_and_block() {
        let mut a = vec![0u8; 100];
        let mut b = vec![0u8; 100];
        fill_block(7, 3, &mut a);
        fill_block(7, 3, &mut b);
        assert_eq!(a, b);
        fill_block(7, 4, &mut b);
        assert_ne!(a, b);
        fill_block(8, 3, &mut b);
        assert_ne!(a, b);
        assert_ne!(checksum(&a), checksum(&b));
    }

    #[test]
    fn every_flipped_bit_and_every_length_change_shows_in_the_checksum() {
        let mut block = vec![0u8; 67];
        fill_block(3, 1, &mut block);
        let before = checksum(&block);
        for i in 0..block.len() {
            for bit in 0..8 {
                block[i] ^= 1 << bit;
                assert_ne!(before, checksum(&block), "byte {i} bit {bit}");
                block[i] ^= 1 << bit;
            }
        }
        assert_ne!(before, checksum(&block[..66]));
        let mut longer = block.clone();
        longer.push(0);
        assert_ne!(before, checksum(&longer));
    }

    #[test]
    fn a_flipped_byte_changes_the_checksum() {
        let mut block = vec![0u8; 4096];
        fill_block(1, 0, &mut block);
        let before = checksum(&block);
        block[1234] ^= 1;
        assert_ne!(before, checksum(&block));
    }

    #[test]
    fn block_size_is_the_models_capped() {
        assert_eq!(block_bytes(16, 32), 512);
        assert_eq!(block_bytes(35_136, 32), MAX_KV_BLOCK_BYTES);
        assert_eq!(block_bytes(0, 32), 1);
    }
}
