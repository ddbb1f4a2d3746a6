//! Per-layer K/V pools on a CubeCL device and one decode step's append + attention.

use cubecl::prelude::*;
use kernels_cubecl::{DeviceArray, kv_append, paged_decode_attention};

use crate::{BlockTables, KvError, KvGeometry, SeqId};

/// The step's shared arrays, uploaded once and read by every layer.
#[derive(Debug, Clone)]
pub struct StepArrays {
    /// Sequences of the step, in batch order.
    pub seqs: usize,
    /// New token's slot per sequence.
    pub slots: DeviceArray,
    /// Flat block table `[seqs, max_blocks]`.
    pub table: DeviceArray,
    /// Cached tokens per sequence, the new one included.
    pub lens: DeviceArray,
    /// The largest of `lens` (sizes the attention's split of the context).
    pub max_len: usize,
}

/// K and V pools of every layer, each `[capacity · block_size, kv_heads · head_dim]` of `KV`.
#[derive(Debug)]
pub struct DevicePools<R: Runtime> {
    geometry: KvGeometry,
    capacity: usize,
    layers: Vec<(DeviceArray, DeviceArray)>,
    _runtime: std::marker::PhantomData<R>,
}

impl<R: Runtime> DevicePools<R> {
    /// Allocates pools for `capacity` blocks, elements of `KV` (whose size must be
    /// `geometry.elem_bytes`).
    pub fn new<KV: CubeElement>(client: &ComputeClient<R>, geometry: &KvGeometry, capacity: usize) -> Self {
        assert_eq!(size_of::<KV>(), geometry.elem_bytes, "cache element size differs from the geometry's");
        let layers = geometry
            .layers
            .iter()
            .map(|l| {
                let n = capacity * geometry.block_size * l.n_kv_heads * l.head_dim;
                (DeviceArray::empty::<R, KV>(client, n), DeviceArray::empty::<R, KV>(client, n))
            })
            .collect();
        Self { geometry: geometry.clone(), capacity, layers, _runtime: std::marker::PhantomData }
    }

    /// The cache geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// Layer `i`'s K and V pools (for fused kernels that append and attend themselves).
    pub fn layer(&self, i: usize) -> (&DeviceArray, &DeviceArray) {
        let (k, v) = &self.layers[i];
        (k, v)
    }

    /// Blocks the pools hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        self.capacity * self.geometry.block_bytes()
    }

    /// Uploads the step's slots, block table and lengths for `seqs` (after their new tokens
    /// were appended in `tables`). `new_slots[i]` is the slot `tables.append` gave `seqs[i]`.
    pub fn upload_step(
        &self,
        client: &ComputeClient<R>,
        tables: &BlockTables,
        seqs: &[SeqId],
        new_slots: &[u32],
    ) -> Result<StepArrays, KvError> {
        let positions = seqs
            .iter()
            .map(|&s| tables.len(s).map(|l| l.saturating_sub(1) as u32))
            .collect::<Result<Vec<_>, _>>()?;
        self.upload_tokens(client, tables, seqs, new_slots, &positions)
    }

    /// [`Self::upload_step`] for tokens at given positions: a sequence may appear several
    /// times (a chunk of its prompt), and token `i` attends to the positions `..= positions[i]`
    /// only, so the chunk stays causal although all its K/V rows are written first.
    pub fn upload_tokens(
        &self,
        client: &ComputeClient<R>,
        tables: &BlockTables,
        seqs: &[SeqId],
        new_slots: &[u32],
        positions: &[u32],
    ) -> Result<StepArrays, KvError> {
        if tables.capacity() > self.capacity {
            return Err(KvError::Device(format!(
                "block tables address {} blocks, the pools hold {}",
                tables.capacity(),
                self.capacity
            )));
        }
        if positions.len() != seqs.len() || new_slots.len() != seqs.len() {
            return Err(KvError::Device(format!(
                "{} sequences, {} slots and {} positions in one step",
                seqs.len(),
                new_slots.len(),
                positions.len()
            )));
        }
        let (table, held) = tables.step_tables(seqs)?;
        let mut lens = Vec::with_capacity(seqs.len());
        for ((&s, &p), &h) in seqs.iter().zip(positions).zip(&held) {
            if p >= h {
                return Err(KvError::Device(format!(
                    "sequence {s}: position {p} is not cached (it holds {h} tokens)"
                )));
            }
            lens.push(p + 1);
        }
        Ok(StepArrays {
            seqs: seqs.len(),
            slots: DeviceArray::from_slice(client, new_slots),
            table: DeviceArray::from_slice(client, &table),
            lens: DeviceArray::from_slice(client, &lens),
            max_len: lens.iter().copied().max().unwrap_or(0) as usize,
        })
    }

    /// Layer `layer` of a decode step: writes the new K/V rows (`[seqs, kv_heads · head_dim]`
    /// f32) into the cache, then attends each sequence's query (`[seqs, heads · head_dim]`)
    /// over its cache into `out`. `params` holds `[scale]`. Does not synchronise.
    ///
    /// # Shapes
    /// - `q`, `out`: `[seqs, n_heads · head_dim]`; `k_new`, `v_new`: `[seqs, n_kv_heads · head_dim]`
    #[allow(clippy::too_many_arguments)]
    pub fn decode_layer<KV: Float + CubeElement>(
        &self,
        client: &ComputeClient<R>,
        layer: usize,
        step: &StepArrays,
        q: &DeviceArray,
        k_new: &DeviceArray,
        v_new: &DeviceArray,
        params: &DeviceArray,
        out: &DeviceArray,
    ) -> Result<(), KvError> {
        let shape = self.geometry.attn_shape(layer);
        let (k, v) = &self.layers[layer];
        let dev = |e: kernels_cubecl::KernelError| KvError::Device(e.to_string());
        kv_append::<R, KV>(client, shape, step.seqs, k_new, v_new, &step.slots, k, v).map_err(dev)?;
        paged_decode_attention::<R, KV>(
            client,
            shape,
            step.seqs,
            step.max_len,
            q,
            k,
            v,
            &step.table,
            &step.lens,
            params,
            out,
        )
        .map_err(dev)
    }
}
