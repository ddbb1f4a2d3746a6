//! Host bookkeeping of the paged cache: free blocks, one block table per sequence.

use std::collections::BTreeMap;

use crate::{KvError, KvGeometry};

/// A sequence's id (the serving engine's request id).
pub type SeqId = u64;

#[derive(Debug, Clone, Default)]
struct Seq {
    blocks: Vec<u32>,
    len: usize,
}

/// Free list and block tables. Blocks `0..capacity` exist; the capacity can grow or shrink
/// (shrinking only over free blocks) as the memory accountant moves bytes between the cache and
/// the weights.
#[derive(Debug, Clone)]
pub struct BlockTables {
    block_size: usize,
    max_blocks: usize,
    capacity: usize,
    /// Free block ids, kept sorted descending so `pop` hands out the lowest id: low ids stay
    /// dense, which lets the capacity shrink from the top.
    free: Vec<u32>,
    seqs: BTreeMap<SeqId, Seq>,
}

impl BlockTables {
    /// `capacity` blocks of `geometry.block_size` tokens.
    pub fn new(geometry: &KvGeometry, capacity: usize) -> Self {
        Self {
            block_size: geometry.block_size,
            max_blocks: geometry.max_blocks_per_seq(),
            capacity,
            free: (0..capacity as u32).rev().collect(),
            seqs: BTreeMap::new(),
        }
    }

    /// Blocks that exist.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Free blocks (F_blk).
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks held by sequences.
    pub fn used_blocks(&self) -> usize {
        self.capacity - self.free.len()
    }

    /// Most tokens one sequence's table can address.
    pub fn max_tokens(&self) -> usize {
        self.max_blocks * self.block_size
    }

    /// Tokens cached for `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize, KvError> {
        self.seqs.get(&seq).map(|s| s.len).ok_or(KvError::UnknownSeq(seq))
    }

    /// Sequences, in id order.
    pub fn seqs(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Blocks `seq` would need to hold `extra` more tokens.
    pub fn blocks_needed(&self, seq: SeqId, extra: usize) -> Result<usize, KvError> {
        let s = self.seqs.get(&seq).ok_or(KvError::UnknownSeq(seq))?;
        Ok((s.len + extra).div_ceil(self.block_size).saturating_sub(s.blocks.len()))
    }

    /// Registers an empty sequence.
    pub fn add(&mut self, seq: SeqId) -> Result<(), KvError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::DuplicateSeq(seq));
        }
        self.seqs.insert(seq, Seq::default());
        Ok(())
    }

    /// Makes room for `n` more tokens of `seq` and returns their slots
    /// (`block · block_size + offset`), in token order. All or nothing.
    pub fn append(&mut self, seq: SeqId, n: usize) -> Result<Vec<u32>, KvError> {
        let max_tokens = self.max_tokens();
        let needed = self.blocks_needed(seq, n)?;
        let s = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSeq(seq))?;
        if s.len + n > max_tokens {
            return Err(KvError::TooLong { seq, tokens: s.len + n, max: max_tokens });
        }
        if needed > self.free.len() {
            return Err(KvError::OutOfBlocks { seq, needed, free: self.free.len() });
        }
        for _ in 0..needed {
            s.blocks.push(self.free.pop().expect("checked above"));
        }
        let bs = self.block_size;
        let slots = (s.len..s.len + n).map(|t| s.blocks[t / bs] * bs as u32 + (t % bs) as u32).collect();
        s.len += n;
        Ok(slots)
    }

    /// Drops `seq` and returns its blocks to the free list.
    pub fn free(&mut self, seq: SeqId) -> Result<usize, KvError> {
        let s = self.seqs.remove(&seq).ok_or(KvError::UnknownSeq(seq))?;
        let n = s.blocks.len();
        self.free.extend(s.blocks);
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        Ok(n)
    }

    /// Grows or shrinks the block count. Shrinking needs the top blocks free; blocks are
    /// handed out lowest first, so this holds unless long-lived sequences sit high.
    pub fn set_capacity(&mut self, want: usize) -> Result<(), KvError> {
        if want >= self.capacity {
            self.free.extend(self.capacity as u32..want as u32);
            self.free.sort_unstable_by(|a, b| b.cmp(a));
        } else {
            let top_free = self.free.iter().filter(|&&b| b as usize >= want).count();
            if top_free < self.capacity - want {
                return Err(KvError::InUse { want, used: self.used_blocks() });
            }
            self.free.retain(|&b| (b as usize) < want);
        }
        self.capacity = want;
        Ok(())
    }

    /// The flat block table (`[seqs.len(), max_blocks]`, unused entries 0) and lengths of
    /// `seqs`, in that order: what the attention kernel reads.
    pub fn step_tables(&self, seqs: &[SeqId]) -> Result<(Vec<u32>, Vec<u32>), KvError> {
        let mut table = vec![0u32; seqs.len() * self.max_blocks];
        let mut lens = Vec::with_capacity(seqs.len());
        for (i, id) in seqs.iter().enumerate() {
            let s = self.seqs.get(id).ok_or(KvError::UnknownSeq(*id))?;
            table[i * self.max_blocks..][..s.blocks.len()].copy_from_slice(&s.blocks);
            lens.push(s.len as u32);
        }
        Ok((table, lens))
    }
}
