//! CubeCL kernels over the any-precision bit-plane format, generic over the
//! CubeCL runtime (CUDA on the GPU, wgpu in CI).
//!
//! - [`gemm`]: the grouped skinny GEMM `y = x · Wᵀ` (1..16 tokens per work
//!   item) reading bit-planes + LUTs with a different committed bit-width per
//!   block in one launch, optionally fusing `act(gate) · up` into the load of
//!   `x` (the down projection of a SwiGLU / GeGLU expert).
//!
//! - [`prefill`]: the many-token path: a block's committed planes + LUT expanded to dense f16
//!   for Burn's matmul.
//! - [`attention`]: the paged KV cache's append and decode-attention kernels.
//! - [`decode`]: the small fused kernels of a decode step (embedding, RMSNorm, dense f16 GEMM,
//!   RoPE, on-device routing into the grouped kernel's descriptors, gather, combine).
//! - [`mma`]: the dense f16 GEMM on the matrix units (TF32 `mma`, CUDA) for several tokens.
//!
//! Every kernel has a CPU `*_reference` here and `*_matches_reference` tests.

// `#[cube]` generates undocumented launch items.
#[allow(missing_docs)]
pub mod attention;
#[allow(missing_docs)]
pub mod bandwidth;
#[cfg(feature = "cuda")]
pub mod cuda_source;
#[allow(missing_docs)]
pub mod decode;
#[allow(missing_docs)]
pub mod families;
#[allow(missing_docs)]
pub mod gemm;
#[allow(missing_docs)]
pub mod gemv;
#[allow(missing_docs)]
pub mod mma;
#[allow(missing_docs)]
pub mod prefill;
pub mod step;

use cubecl::prelude::*;
use cubecl::server::Handle;
pub use gemm::Activation;
use half::f16;
pub use prefill::{ap_dequantize, ap_dequantize_reference};
use pw_format::ApBlock;

/// Largest token count of one work item.
pub const MAX_TOKENS: usize = 16;

/// Kernel launch or argument errors.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A work item or buffer is inconsistent.
    #[error("work item {item}: {reason}")]
    BadItem {
        /// Index of the work item.
        item: usize,
        /// What is wrong.
        reason: String,
    },
    /// The runtime reported an error (deferred launch errors surface at sync).
    #[error("runtime error: {0}")]
    Runtime(String),
    /// A [`GemmConfig`] the kernels cannot run.
    #[error("GEMM configuration: {0}")]
    Config(String),
}

/// One block × token group of a grouped launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkItem {
    /// Offset of the block's plane 0 in the plane pool (u32 words).
    pub plane_off: u32,
    /// Offset of the block's LUT in the LUT pool (f16 elements).
    pub lut_off: u32,
    /// Output rows N.
    pub rows: u32,
    /// Input columns K.
    pub cols: u32,
    /// Committed bit-width (3..=8): planes `0..bits` and the LUT of that width.
    pub bits: u32,
    /// Offset of the item's first token row in `x` (elements).
    pub x_off: u32,
    /// Offset of the item's first output row in `y` (elements); `y` is `[tokens, rows]`.
    pub y_off: u32,
    /// Tokens, 0..=16.
    pub tokens: u32,
}

impl WorkItem {
    fn words(&self) -> [u32; gemm::DESC_WORDS] {
        [self.plane_off, self.lut_off, self.rows, self.cols, self.bits, self.x_off, self.y_off, self.tokens]
    }
}

/// Host image of a device weight pool: the committed planes and LUT of each
/// block, concatenated. The page table owns the real pool; tests and benches
/// build one directly.
#[derive(Debug, Default, Clone)]
pub struct PoolImage {
    /// Plane words.
    pub planes: Vec<u32>,
    /// LUT entries.
    pub luts: Vec<f16>,
}

/// Where [`PoolImage::push`] put a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSlot {
    /// Plane offset (u32 words).
    pub plane_off: u32,
    /// LUT offset (f16 elements).
    pub lut_off: u32,
    /// Rows.
    pub rows: u32,
    /// Columns.
    pub cols: u32,
    /// Bits committed.
    pub bits: u32,
}

impl PoolImage {
    /// Appends planes `0..bits` and the `bits`-wide LUT of `block`.
    pub fn push(&mut self, block: &ApBlock, bits: u8) -> PoolSlot {
        let slot = PoolSlot {
            plane_off: self.planes.len() as u32,
            lut_off: self.luts.len() as u32,
            rows: block.rows as u32,
            cols: block.cols as u32,
            bits: bits as u32,
        };
        for p in 0..bits {
            self.planes.extend_from_slice(block.plane(p));
        }
        self.luts.extend_from_slice(block.lut(bits));
        slot
    }

    /// Bytes of planes + LUTs.
    pub fn bytes(&self) -> usize {
        self.planes.len() * 4 + self.luts.len() * 2
    }
}

impl PoolSlot {
    /// A work item over this block.
    pub fn item(&self, x_off: u32, y_off: u32, tokens: u32) -> WorkItem {
        WorkItem {
            plane_off: self.plane_off,
            lut_off: self.lut_off,
            rows: self.rows,
            cols: self.cols,
            bits: self.bits,
            x_off,
            y_off,
            tokens,
        }
    }
}

/// A device buffer and its length in elements.
#[derive(Debug, Clone)]
pub struct DeviceArray {
    /// The CubeCL handle.
    pub handle: Handle,
    /// Length in elements of the kernel-side type.
    pub len: usize,
}

impl DeviceArray {
    /// Uploads a slice.
    pub fn from_slice<R: Runtime, T: CubeElement>(client: &ComputeClient<R>, data: &[T]) -> Self {
        Self { handle: client.create_from_slice(T::as_bytes(data)), len: data.len() }
    }

    /// An uninitialised buffer of `len` elements of `T`.
    pub fn empty<R: Runtime, T: CubeElement>(client: &ComputeClient<R>, len: usize) -> Self {
        Self { handle: client.empty(len.max(1) * size_of::<T>()), len }
    }

    fn arg<R: Runtime>(&self) -> ArrayArg<R> {
        // SAFETY: `len` is the element count the buffer was created with.
        unsafe { ArrayArg::from_raw_parts(self.handle.clone(), self.len.max(1)) }
    }
}

/// Launch shape of the grouped GEMM.
#[derive(Debug, Clone, Copy)]
pub struct GemmConfig {
    /// Lanes per plane (warp) of the device: 32 on NVIDIA, 8 on lavapipe.
    pub plane_size: usize,
    /// Planes (warps) per cube.
    pub warps: usize,
    /// Rows each warp handles per staged chunk of `x` (amortises the staging
    /// and its barriers; costs `warps · rows_per_warp` KiB of LUT space).
    pub rows_per_warp: usize,
    /// `true` (the default): the kernel with per-item bodies for each bit-width and for
    /// few-token items; `false`: the first kernel, kept so `bench-kernels` can compare both
    /// in one run.
    pub specialized: bool,
    /// `true` (the default): launches of at least `gemv_min_items` items of at most
    /// [`GEMV_HOST_MAX_TOKENS`] tokens (routed tables: [`GEMV_MAX_TOKENS`]) whose `x` fits in
    /// shared memory go to the persistent GEMV kernel ([`gemv`]).
    pub gemv: bool,
    /// Fewest items for the GEMV kernel ([`GEMV_MIN_ITEMS`] by default).
    pub gemv_min_items: usize,
    /// Plane words per lane and row that the GEMV kernel loads together (registers against
    /// loads in flight).
    pub gemv_words_per_lane: usize,
    /// Rows of one warp unit of the GEMV kernel: each staged `x` vector read from shared memory
    /// serves this many rows (the load/store pipe, which also carries the LUT shuffles, is the
    /// GEMV's busiest: 77 % of its wavefronts at one token, ncu on the H200), against registers
    /// (4 rows: Mixtral's batch-1 decode step 6.78 → 7.19 ms on the H200, see
    /// `benches/results/h200-kernels.md`).
    pub gemv_rows: usize,
    /// The GEMM and GEMV kernels' inner loops fully unrolled (constant shifts; the GPU's
    /// choice) or compact (CPU shader compilers such as lavapipe's take minutes on the unrolled
    /// bodies).
    pub unrolled: bool,
    /// How the kernels look up LUTs of ≤ 4-bit blocks: `true` (the default where planes have
    /// at least 8 lanes) from registers spread over the warp's lanes by shuffles, the index
    /// itself being the source lane, which saves the address arithmetic of a shared-memory
    /// lookup; `false` from shared memory like wider LUTs.
    pub lut_in_lanes: bool,
    /// The runtime's shuffles take the source lane modulo 32 (CUDA), so no mask is needed.
    pub shuffle_wraps: bool,
    /// The GEMV kernel stages `x` in shared memory as f16 instead of f32 (`false` by default):
    /// half the shared-memory bytes per read, on the load/store pipe that also carries the LUT
    /// shuffles, at the cost of rounding `x` to f16 (relative error ≤ 2⁻¹¹ per element).
    pub gemv_x_half: bool,
    /// Warps of the GEMV kernel resident per SM that its grid is sized for
    /// ([`GEMV_WARPS_PER_SM`] by default: its registers' limit on the H200 with `x` in f32).
    pub gemv_warps_per_sm: usize,
    /// The GEMV kernel loads a step's plane words during the previous step's arithmetic (≤ 4-bit
    /// items; `false` by default).
    pub gemv_prefetch: bool,
}

impl GemmConfig {
    /// Checks the shared-memory LUT bases fit the 14 bits `gemm::word_rows` keeps of them (a
    /// bound it gives the compiler): at most 64 rows of 256-slot LUTs per cube.
    pub fn check(&self) -> Result<(), KernelError> {
        let rows = (self.warps * self.rows_per_warp).max(self.warps * self.gemv_rows);
        if rows * gemm::LUT_SLOTS * 4 > 1 << 16
            || self.plane_size == 0
            || self.warps == 0
            || self.gemv_rows == 0
            || self.gemv_warps_per_sm == 0
        {
            return Err(KernelError::Config(format!(
                "{} warps × {} rows per warp, {} per GEMV unit (at most 64 rows per cube, non-zero plane \
                 size, warps and rows)",
                self.warps, self.rows_per_warp, self.gemv_rows
            )));
        }
        Ok(())
    }

    /// The configuration for `client`'s device.
    pub fn for_client<R: Runtime>(client: &ComputeClient<R>) -> Self {
        Self::for_hardware(&client.properties().hardware, R::name(client) == "cuda")
    }

    /// The configuration for a device of `hw` (`cuda`: the CUDA runtime, whose shuffles take
    /// the source lane modulo 32).
    pub fn for_hardware(hw: &cubecl::ir::HardwareProperties, cuda: bool) -> Self {
        // Devices with little shared memory (lavapipe: 32 KiB) get one row per warp.
        // 2 measured fastest on the H200 (bench-kernels sweep of 1, 2, 4, 8 rows per warp).
        let rows_per_warp = if hw.max_shared_memory_size >= 96 * 1024 { 2 } else { 1 };
        // Planes narrower than 16 lanes: lavapipe (8), a CPU behind a shader compiler.
        let unrolled = hw.plane_size_max >= 16;
        let plane_size = hw.plane_size_max as usize;
        Self {
            plane_size,
            warps: 8,
            rows_per_warp,
            specialized: true,
            gemv: true,
            gemv_min_items: GEMV_MIN_ITEMS,
            gemv_words_per_lane: 2,
            gemv_rows: GEMV_ROWS,
            unrolled,
            lut_in_lanes: plane_size == 8 || plane_size >= 16,
            shuffle_wraps: cuda && plane_size == 32,
            gemv_x_half: false,
            gemv_warps_per_sm: GEMV_WARPS_PER_SM,
            gemv_prefetch: false,
        }
    }

    /// The kernels' comptime LUT mode (`gemm::LUT_*`).
    pub(crate) fn lut_mode(&self) -> u32 {
        match (self.lut_in_lanes, self.plane_size) {
            (false, _) => gemm::LUT_SHARED,
            (true, 8) => gemm::LUT_LANES_PAIR,
            (true, 32) if self.shuffle_wraps => gemm::LUT_LANES_WRAP,
            (true, p) if p >= 16 => gemm::LUT_LANES_MASKED,
            _ => gemm::LUT_SHARED,
        }
    }
}

/// Most tokens per item the persistent GEMV kernel takes (its `x` for all columns stays in
/// shared memory): the routed launches' largest chunk
/// ([`step::ROUTE_CHUNK_CHOICES`]). Launches of host items take it up to
/// [`GEMV_HOST_MAX_TOKENS`].
pub const GEMV_MAX_TOKENS: usize = 8;
/// Most tokens per item for which launches of host items (not routed) take the persistent
/// GEMV; above, the tiled kernel, which decodes each weight once for up to 16 tokens.
pub const GEMV_HOST_MAX_TOKENS: usize = 2;
/// Fewest items for which the persistent GEMV kernel is chosen. The tiled grid launches cubes
/// for every item, the GEMV only works on the active ones. Measured on the H200: at git
/// `09f2cf5` the tiled kernel was faster for Mixtral's 16 routed items (8 experts × 2 chunks;
/// batch 1, 4 bits: 11.3 vs 13.0 ms per step) and the GEMV for Qwen1.5-MoE's 120 (5.65 → 5.35
/// ms); with lane-held LUTs (git `bbe5b65`) the GEMV is ahead for Mixtral too (Mixtral layer of
/// 8 experts × 8 tokens at 4 bits: 651.5 vs 771.5 µs; batch-1 decode 8.67 vs 8.79 ms), but not
/// for one block (24.0 vs 23.4 µs), which keeps the tiled kernel.
pub const GEMV_MIN_ITEMS: usize = 16;
/// Default [`GemmConfig::gemv_rows`].
pub const GEMV_ROWS: usize = 2;
/// Default [`GemmConfig::gemv_warps_per_sm`]: the GEMV's registers (77–80 per thread at one
/// token, ncu on the H200 and CUDA 13.0's ptxas alike) leave room for 24 warps per SM. At two
/// tokens ptxas gives Qwen1.5-MoE's GEMVs and Gemma-4's down 110–116 (16 warps fit;
/// `benches/results/sass-gemv.md`), a grid still to be timed against this one.
pub const GEMV_WARPS_PER_SM: usize = 24;

/// Calls `$f` (the GEMV kernel's launch, or its kernel definition's constructor) with the
/// leading arguments `$pre` and then [`gemv::ap_gemv_kernel`]'s comptime arguments for one
/// launch of `$cfg` and `$plan`, in declaration order: the one list both share.
macro_rules! gemv_comptime_call {
    ($f:path, ($($pre:expr),* $(,)?), ($cfg:expr, $plan:expr, $n_items:expr, $act:expr, $lut_slots:expr, $counted:expr)) => {
        $f(
            $($pre,)*
            $n_items,
            $plan.tb,
            $cfg.plane_size,
            $plan.warps,
            $cfg.gemv_rows,
            $cfg.gemv_words_per_lane,
            $plan.x_words,
            $act.code(),
            $lut_slots,
            $cfg.unrolled,
            $cfg.lut_mode(),
            $plan.glu,
            $counted,
            $cfg.gemv_prefetch,
        )
    };
}
#[cfg(feature = "cuda")]
pub(crate) use gemv_comptime_call;

/// The persistent GEMV's launch shape and comptime arguments for one launch (see
/// [`gemv_plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvPlan {
    /// Cubes in the grid.
    pub cubes: usize,
    /// Warps per cube.
    pub warps: usize,
    /// The kernel's comptime token bucket.
    pub tb: usize,
    /// Staged `x` words per token (a multiple of `plane_size · words_per_lane`).
    pub x_words: usize,
    /// Bytes of shared memory a cube takes.
    pub shared_bytes: usize,
    /// Gated activation code of the epilogue (0: plain units).
    pub glu: u32,
}

/// Where [`launch_gemv`] would launch the persistent GEMV on a device of `hw` (and with which
/// shape), or `None` where it does not apply (see [`GemmConfig::gemv`]; `x` of `cols` columns
/// must fit in shared memory). `counted`: a routed table (live items first, their count in a
/// header slot).
#[allow(clippy::too_many_arguments)]
pub fn gemv_plan(
    hw: &cubecl::ir::HardwareProperties,
    cfg: GemmConfig,
    n_items: usize,
    counted: bool,
    cols: usize,
    tokens: usize,
    lut_slots: usize,
    glu: Option<Activation>,
) -> Option<GemvPlan> {
    let tb = token_bucket(tokens);
    // Routed tables (`counted`) come in chunks the GEMV always takes; host items above two
    // tokens go to the tiled kernel.
    let most = if counted { GEMV_MAX_TOKENS } else { GEMV_HOST_MAX_TOKENS };
    if !cfg.gemv || !cfg.specialized || tb > most || n_items < cfg.gemv_min_items.max(1) {
        return None;
    }
    // A gated unit pairs gate rows with up rows, half of its rows each.
    let glu = match glu {
        None => 0,
        Some(a @ (Activation::SiluMul | Activation::GeluTanhMul)) if cfg.gemv_rows.is_multiple_of(2) => {
            a.code()
        }
        Some(_) => return None,
    };
    let ps = cfg.plane_size;
    let step = ps * cfg.gemv_words_per_lane;
    let x_words = cols.div_ceil(32).div_ceil(step) * step;
    // Staged x, LUTs, the items' prefix and one warp total per round of the prefix.
    let x_bytes = if cfg.gemv_x_half { 2 } else { 4 };
    let shared = |warps: usize| {
        let prefix = n_items + 1 + n_items.div_ceil(warps * ps) * warps;
        x_bytes * tb * x_words * 4 * gemm::XV_PER_WORD + 4 * (warps * cfg.gemv_rows * lut_slots + prefix)
    };
    if shared(cfg.warps) > hw.max_shared_memory_size {
        return None;
    }
    // As many cubes per SM as can be resident (shared memory, and registers: ncu on the H200
    // saw 77 per thread, room for 24 warps), so no second wave leaves SMs idle at the end.
    let per_sm =
        |warps: usize| (hw.max_shared_memory_size / shared(warps)).min(cfg.gemv_warps_per_sm / warps).max(1);
    // Where the staged `x` (all columns) leaves room for fewer cubes, wider cubes keep as many
    // warps per SM: Mixtral's down input at two tokens (129 KB) allowed one cube of 8 warps
    // per SM, and its GEMV ran at half the gate_up's bandwidth (ncu on the H200, batch 8).
    let widest = (hw.max_units_per_cube as usize / ps).min(3 * cfg.warps);
    let warps = [cfg.warps, cfg.warps * 3 / 2, 2 * cfg.warps, 3 * cfg.warps]
        .into_iter()
        // At most 64 rows of LUTs per cube: `word_rows` keeps 14-bit LUT bases (see `check`).
        .filter(|&w| w <= widest && w * cfg.gemv_rows <= 64 && shared(w) <= hw.max_shared_memory_size)
        .max_by_key(|&w| (per_sm(w) * w, std::cmp::Reverse(w)))
        .unwrap_or(cfg.warps);
    let cubes = hw.num_streaming_multiprocessors.unwrap_or(4) as usize * per_sm(warps);
    Some(GemvPlan { cubes, warps, tb, x_words, shared_bytes: shared(warps), glu })
}

/// Launches [`gemv::ap_gemv_kernel`] over `n_items` descriptors when it applies (see
/// [`gemv_plan`]); `false` when it does not.
/// `counted`: the table has a header slot after its `n_items` items whose word 0 counts the
/// live items, which come first (the routing's tables); the kernel reads only those.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_gemv<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: GemmConfig,
    [planes, luts, desc, x, y]: [&DeviceArray; 5],
    n_items: usize,
    counted: bool,
    cols: usize,
    tokens: usize,
    act: Activation,
    lut_slots: usize,
    glu: Option<Activation>,
) -> bool {
    let hw = &client.properties().hardware;
    let Some(plan) = gemv_plan(hw, cfg, n_items, counted, cols, tokens, lut_slots, glu) else {
        return false;
    };
    let threads = plan.warps * cfg.plane_size;
    // SAFETY: callers checked the descriptors against the buffers (host items) or built them
    // on the device from validated slot words (routed items).
    unsafe {
        // The staged element type is a generic of the kernel: one call per type.
        macro_rules! launch {
            ($xf:ty) => {
                gemv_comptime_call!(
                    gemv::ap_gemv_kernel::launch_unchecked::<$xf, R>,
                    (
                        client,
                        CubeCount::Static(plan.cubes as u32, 1, 1),
                        CubeDim::new_1d(threads as u32),
                        planes.arg(),
                        luts.arg(),
                        desc.arg(),
                        x.arg(),
                        y.arg(),
                        n_items as u32
                    ),
                    (cfg, plan, n_items, act, lut_slots, counted)
                )
            };
        }
        if cfg.gemv_x_half { launch!(f16) } else { launch!(f32) }
    };
    true
}

/// Smallest compiled token bucket holding `tokens`.
fn token_bucket(tokens: usize) -> usize {
    tokens.next_power_of_two().max(1)
}

/// Validates `items` against the buffer lengths.
fn check_items(
    items: &[WorkItem],
    planes_len: usize,
    luts_len: usize,
    x_len: usize,
    y_len: usize,
    act: Activation,
) -> Result<(), KernelError> {
    for (i, it) in items.iter().enumerate() {
        let bad = |reason: String| Err(KernelError::BadItem { item: i, reason });
        if !(3..=8).contains(&it.bits) {
            return bad(format!("bits {} outside 3..=8", it.bits));
        }
        if it.tokens as usize > MAX_TOKENS {
            return bad(format!("{} tokens, at most {MAX_TOKENS} per item", it.tokens));
        }
        let (n, k, t) = (it.rows as usize, it.cols as usize, it.tokens as usize);
        let words = k.div_ceil(32);
        if it.plane_off as usize + it.bits as usize * n * words > planes_len {
            return bad("planes past the end of the plane pool".into());
        }
        if it.lut_off as usize + n * (1 << it.bits) > luts_len {
            return bad("LUT past the end of the LUT pool".into());
        }
        let x_cols = if act == Activation::None { k } else { 2 * k };
        if it.x_off as usize + t * x_cols > x_len {
            return bad(format!("x needs {} elements, has {x_len}", it.x_off as usize + t * x_cols));
        }
        if it.y_off as usize + t * n > y_len {
            return bad(format!("y needs {} elements, has {y_len}", it.y_off as usize + t * n));
        }
    }
    Ok(())
}

/// Uploads the descriptor table of `items`.
pub fn upload_items<R: Runtime>(client: &ComputeClient<R>, items: &[WorkItem]) -> DeviceArray {
    let words: Vec<u32> = items.iter().flat_map(|i| i.words()).collect();
    DeviceArray::from_slice(client, &words)
}

/// Launches the grouped GEMM: for every item, `y[t, r] = Σ_c x̃[t, c] · W[r, c]`
/// where `x̃ = x` or `act(gate) · up`. Does not synchronise.
///
/// # Shapes
/// - per item: `x` `[tokens, cols]` (or `[tokens, 2·cols]` with an activation)
///   at `x_off`, `y` `[tokens, rows]` at `y_off`
#[allow(clippy::too_many_arguments)]
pub fn ap_gemm<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: GemmConfig,
    planes: &DeviceArray,
    luts: &DeviceArray,
    items: &[WorkItem],
    desc: &DeviceArray,
    x: &DeviceArray,
    y: &DeviceArray,
    act: Activation,
) -> Result<(), KernelError> {
    if items.is_empty() {
        return Ok(());
    }
    cfg.check()?;
    check_items(items, planes.len, luts.len, x.len, y.len, act)?;
    if desc.len != items.len() * gemm::DESC_WORDS {
        return Err(KernelError::BadItem {
            item: 0,
            reason: "descriptor table does not match the items".into(),
        });
    }
    let max_rows = items.iter().map(|i| i.rows).max().unwrap_or(0) as usize;
    let most_tokens = items.iter().map(|i| i.tokens).max().unwrap_or(1) as usize;
    let max_cols = items.iter().map(|i| i.cols).max().unwrap_or(0) as usize;
    // Room for the widest LUT, in two classes (16 or 256 slots) so few kernel variants are
    // compiled: launches of ≤ 4-bit blocks keep their shared memory small.
    let lut_slots = if items.iter().all(|i| i.bits <= 4) { 16 } else { gemm::LUT_SLOTS };
    let bufs = [planes, luts, desc, x, y];
    if launch_gemv(client, cfg, bufs, items.len(), false, max_cols, most_tokens, act, lut_slots, None) {
        return Ok(());
    }
    let max_tokens = token_bucket(most_tokens);
    let tiles = max_rows.div_ceil(cfg.warps * cfg.rows_per_warp) as u32;
    let cube_dim = CubeDim::new_1d((cfg.warps * cfg.plane_size) as u32);
    // SAFETY: every offset and length was checked against the buffers above.
    let count = CubeCount::Static(tiles, items.len() as u32, 1);
    let (p, l, d, xa, ya) = (planes.arg(), luts.arg(), desc.arg(), x.arg(), y.arg());
    let (ps, w, r, a) = (cfg.plane_size, cfg.warps, cfg.rows_per_warp, act.code());
    unsafe {
        if cfg.specialized {
            gemm::ap_gemm_kernel::launch_unchecked::<R>(
                client,
                count,
                cube_dim,
                p,
                l,
                d,
                xa,
                ya,
                max_tokens,
                ps,
                w,
                r,
                a,
                lut_slots,
                cfg.unrolled,
                cfg.lut_mode(),
            )
        } else {
            gemm::ap_gemm_kernel_v1::launch_unchecked::<R>(
                client, count, cube_dim, p, l, d, xa, ya, max_tokens, ps, w, r, a,
            )
        }
    };
    Ok(())
}

/// CPU reference of [`ap_gemm`] over a host pool image; `y` is updated in place.
pub fn ap_gemm_reference(pool: &PoolImage, items: &[WorkItem], x: &[f32], y: &mut [f32], act: Activation) {
    for it in items {
        let (n, k, t, b) = (it.rows as usize, it.cols as usize, it.tokens as usize, it.bits as usize);
        let words = k.div_ceil(32);
        let x_cols = if act == Activation::None { k } else { 2 * k };
        for tok in 0..t {
            let xr = &x[it.x_off as usize + tok * x_cols..][..x_cols];
            let xv: Vec<f32> = (0..k)
                .map(|c| match act {
                    Activation::None => xr[c],
                    Activation::SiluMul => silu(xr[c]) * xr[k + c],
                    Activation::GeluTanhMul => gelu_tanh(xr[c]) * xr[k + c],
                    Activation::Applied => xr[c],
                })
                .collect();
            for r in 0..n {
                let mut acc = 0f32;
                for (c, &xc) in xv.iter().enumerate() {
                    let mut idx = 0usize;
                    for p in 0..b {
                        let w = pool.planes[it.plane_off as usize + (p * n + r) * words + c / 32];
                        idx = (idx << 1) | ((w >> (c % 32)) & 1) as usize;
                    }
                    acc += xc * pool.luts[it.lut_off as usize + r * (1 << b) + idx].to_f32();
                }
                y[it.y_off as usize + tok * n + r] = acc;
            }
        }
    }
}

/// Launches the streaming read over `data` (u32 words);
/// `out` gets one word per unit, `cubes · 256` in all. Does not synchronise.
pub fn stream_read<R: Runtime>(client: &ComputeClient<R>, data: &DeviceArray, out: &DeviceArray, cubes: u32) {
    assert!(out.len >= cubes as usize * 256, "stream_read: `out` needs one word per unit");
    // SAFETY: the kernel reads `data.len` words and writes `cubes · 256` words, checked above.
    unsafe {
        bandwidth::stream_read_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(cubes, 1, 1),
            CubeDim::new_1d(256),
            data.arg(),
            out.arg(),
            16,
        )
    };
}

/// Fills `out` (u32 words) with a hash of each index and `seed`, on the device. Does not
/// synchronise.
pub fn fill_hash<R: Runtime>(client: &ComputeClient<R>, out: &DeviceArray, seed: u32) {
    let seed = DeviceArray::from_slice(client, &[seed]);
    // SAFETY: the kernel writes only indices below `out.len`.
    unsafe {
        bandwidth::fill_hash_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(1024, 1, 1),
            CubeDim::new_1d(256),
            out.arg(),
            seed.arg(),
        )
    };
}

/// CPU reference of [`fill_hash`].
pub fn fill_hash_reference(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            let mut z = i ^ seed;
            z = (z ^ (z >> 16)).wrapping_mul(0x7feb_352d);
            z = (z ^ (z >> 15)).wrapping_mul(0x846c_a68b);
            z ^ (z >> 16)
        })
        .collect()
}

/// CPU reference of [`stream_read`]: the XOR of all words, which equals the
/// XOR of the kernel's outputs.
pub fn stream_read_reference(data: &[u32]) -> u32 {
    data.iter().fold(0, |a, b| a ^ b)
}

/// Reads back a u32 buffer (synchronising first).
pub fn read_u32<R: Runtime>(client: &ComputeClient<R>, a: &DeviceArray) -> Result<Vec<u32>, KernelError> {
    sync(client)?;
    let bytes = client.read_one(a.handle.clone()).map_err(|e| KernelError::Runtime(format!("{e:?}")))?;
    Ok(u32::from_bytes(&bytes)[..a.len].to_vec())
}

/// `x · sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation.
pub fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh())
}

/// Waits for the queue and turns deferred launch errors into an error.
pub fn sync<R: Runtime>(client: &ComputeClient<R>) -> Result<(), KernelError> {
    cubecl::future::block_on(client.sync()).map_err(|e| KernelError::Runtime(format!("{e:?}")))
}

/// Reads back an f32 buffer (synchronising first, so launch errors surface).
pub fn read_f32<R: Runtime>(client: &ComputeClient<R>, a: &DeviceArray) -> Result<Vec<f32>, KernelError> {
    sync(client)?;
    let bytes = client.read_one(a.handle.clone()).map_err(|e| KernelError::Runtime(format!("{e:?}")))?;
    Ok(f32::from_bytes(&bytes)[..a.len].to_vec())
}

/// Geometry of one layer's paged KV cache and of its decode attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PagedAttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA: `n_heads` is a multiple).
    pub n_kv_heads: usize,
    /// Head dimension; a multiple of the plane size.
    pub head_dim: usize,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Width of the block table: blocks a sequence may hold.
    pub max_blocks: usize,
    /// Sliding window (each query sees the last `window` tokens, itself included); 0 = none.
    pub window: usize,
}

impl PagedAttnShape {
    /// Elements of one cached token (one slot) in a K or V pool.
    pub fn slot_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    fn check(&self, plane_size: usize) -> Result<(), KernelError> {
        let bad = |reason: String| Err(KernelError::BadItem { item: 0, reason });
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(plane_size) {
            return bad(format!(
                "head_dim {} is not a multiple of the plane size {plane_size}",
                self.head_dim
            ));
        }
        if self.block_size == 0 || self.max_blocks == 0 {
            return bad("block_size and max_blocks must be positive".into());
        }
        Ok(())
    }
}

/// Writes each sequence's new K/V row (`k_new`, `v_new`: `[seqs, kv_heads · head_dim]` f32) into
/// pool slot `slots[s]`, converting to the pool type `KV`. Does not synchronise.
///
/// # Shapes
/// - `k_new`, `v_new`: `[seqs, slot_width]`; `slots`: `[seqs]`; pools: `[pool slots, slot_width]`
#[allow(clippy::too_many_arguments)]
pub fn kv_append<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    seqs: usize,
    k_new: &DeviceArray,
    v_new: &DeviceArray,
    slots: &DeviceArray,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
) -> Result<(), KernelError> {
    let w = shape.slot_width();
    let layout = RowLayout { stride: w, k_off: 0, v_off: 0 };
    kv_append_rows::<R, KV>(client, shape, seqs, layout, k_new, v_new, slots, k_pool, v_pool)
}

/// Where K and V sit in the rows of their source: row `s` at `s · stride`, K at `k_off`, V at
/// `v_off` (a fused QKV projection's output is one buffer with all three).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLayout {
    /// Elements per source row.
    pub stride: usize,
    /// Offset of K in a row.
    pub k_off: usize,
    /// Offset of V in a row.
    pub v_off: usize,
}

/// [`kv_append`] reading K/V rows laid out as `layout` says.
#[allow(clippy::too_many_arguments)]
pub fn kv_append_rows<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    seqs: usize,
    layout: RowLayout,
    k_new: &DeviceArray,
    v_new: &DeviceArray,
    slots: &DeviceArray,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
) -> Result<(), KernelError> {
    let w = shape.slot_width();
    if seqs == 0 {
        return Ok(());
    }
    let need = (seqs - 1) * layout.stride + w;
    if layout.k_off + w > layout.stride.max(w)
        || layout.v_off + w > layout.stride.max(w)
        || k_new.len < need + layout.k_off
        || v_new.len < need + layout.v_off
        || slots.len < seqs
        || k_pool.len != v_pool.len
    {
        return Err(KernelError::BadItem { item: 0, reason: "kv_append: buffer sizes do not match".into() });
    }
    // SAFETY: sources and slot list checked above; slot values are the cache allocator's, which
    // hands out only slots below `k_pool.len / w`.
    unsafe {
        attention::kv_append_kernel::launch_unchecked::<KV, R>(
            client,
            CubeCount::Static(seqs as u32, 1, 1),
            CubeDim::new_1d(w.min(256) as u32),
            k_new.arg(),
            v_new.arg(),
            slots.arg(),
            k_pool.arg(),
            v_pool.arg(),
            w,
            layout.stride,
            layout.k_off,
            layout.v_off,
        )
    };
    Ok(())
}

/// RoPE of the query and key heads of `qkv` rows and the K/V append in one launch (see
/// [`attention::rope_append_kernel`]): the decode step's `rope` + [`kv_append_rows`] with one
/// launch less per layer. `layout.k_off` must be `n_heads · head_dim` (keys right after the
/// queries). Does not synchronise.
///
/// # Shapes
/// - `qkv`: `[tokens, layout.stride]`; `pos`, `slots`: `[tokens]`; `inv_freq`: `[rot_dim / 2]`;
///   pools: `[pool slots, n_kv_heads · head_dim]`
#[allow(clippy::too_many_arguments)]
pub fn rope_append<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    tokens: usize,
    layout: RowLayout,
    rot_dim: usize,
    qkv: &DeviceArray,
    pos: &DeviceArray,
    inv_freq: &DeviceArray,
    slots: &DeviceArray,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
) -> Result<(), KernelError> {
    let (hd, w) = (shape.head_dim, shape.slot_width());
    let bad = |reason: String| Err(KernelError::BadItem { item: 0, reason });
    if layout.k_off != shape.n_heads * hd
        || layout.k_off + w > layout.stride
        || layout.v_off + w > layout.stride
    {
        return bad(format!("rope_append: row layout {layout:?} does not hold Q | K | V heads of {hd}"));
    }
    if rot_dim == 0 || rot_dim > hd || !rot_dim.is_multiple_of(2) {
        return bad(format!("rope_append: rot_dim {rot_dim} for head_dim {hd}"));
    }
    if tokens == 0 {
        return Ok(());
    }
    if qkv.len < tokens * layout.stride
        || pos.len < tokens
        || slots.len < tokens
        || inv_freq.len < rot_dim / 2
        || k_pool.len != v_pool.len
    {
        return bad("rope_append: buffer sizes do not match".into());
    }
    // A unit per rotated pair, cubes of up to 256.
    let pairs = (shape.n_heads + shape.n_kv_heads) * rot_dim / 2;
    let units = pairs.clamp(1, 256);
    // SAFETY: sizes checked above; slot values are the cache allocator's (inside the pools).
    unsafe {
        attention::rope_append_kernel::launch_unchecked::<KV, R>(
            client,
            CubeCount::Static(tokens as u32, pairs.div_ceil(units) as u32, 1),
            CubeDim::new_1d(units as u32),
            qkv.arg(),
            pos.arg(),
            inv_freq.arg(),
            slots.arg(),
            k_pool.arg(),
            v_pool.arg(),
            layout.stride,
            shape.n_heads,
            shape.n_kv_heads,
            hd,
            rot_dim,
            layout.v_off,
        )
    };
    Ok(())
}

/// CPU reference of [`kv_append`] on f32 pools.
pub fn kv_append_reference(
    shape: PagedAttnShape,
    k_new: &[f32],
    v_new: &[f32],
    slots: &[u32],
    k_pool: &mut [f32],
    v_pool: &mut [f32],
) {
    let w = shape.slot_width();
    for (s, &slot) in slots.iter().enumerate() {
        let d = slot as usize * w;
        k_pool[d..d + w].copy_from_slice(&k_new[s * w..][..w]);
        v_pool[d..d + w].copy_from_slice(&v_new[s * w..][..w]);
    }
}

/// Decode attention of one query token per sequence over its paged K/V:
/// `out[s, h] = softmax(scale · q[s, h] · K[s, kv(h)]ᵀ) · V[s, kv(h)]` over the sequence's
/// visible tokens. `params` holds `[scale]`; `max_len` bounds `seq_lens` (it sizes the split
/// of the context across cubes; a smaller value would leave tokens out). Does not synchronise.
///
/// # Shapes
/// - `q`, `out`: `[seqs, n_heads, head_dim]`; `block_table`: `[seqs, max_blocks]`;
///   `seq_lens`: `[seqs]`; pools: `[pool slots, n_kv_heads · head_dim]`
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    seqs: usize,
    max_len: usize,
    q: &DeviceArray,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
    block_table: &DeviceArray,
    seq_lens: &DeviceArray,
    params: &DeviceArray,
    out: &DeviceArray,
) -> Result<(), KernelError> {
    let q_stride = shape.n_heads * shape.head_dim;
    paged_decode_attention_strided::<R, KV>(
        client,
        shape,
        seqs,
        max_len,
        q,
        q_stride,
        k_pool,
        v_pool,
        block_table,
        seq_lens,
        params,
        out,
    )
}

/// How [`paged_decode_attention`] cuts its work: heads per cube, planes per cube, tokens per
/// plane iteration and per split, number of splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnSplit {
    /// Query heads per cube (they share one KV head).
    pub hg: usize,
    /// Planes per cube.
    pub planes: usize,
    /// Tokens per plane iteration (their loads are in flight together).
    pub unroll: usize,
    /// Tokens per split.
    pub chunk: usize,
    /// Splits of the context (1: no combine pass).
    pub splits: usize,
}

impl AttnSplit {
    /// The split for `seqs` sequences of at most `max_len` cached tokens on a device with
    /// `sms` multiprocessors, `plane_size` lanes and `smem` bytes of shared memory per cube.
    pub fn choose(
        shape: &PagedAttnShape,
        seqs: usize,
        max_len: usize,
        plane_size: usize,
        sms: usize,
        smem: usize,
    ) -> Self {
        let group = shape.n_heads / shape.n_kv_heads;
        let per = shape.head_dim / plane_size;
        // Registers: `hg · per` query and accumulator values per lane; 16 keeps ptxas from
        // spilling with the K/V registers of `unroll` tokens beside them.
        let mut hg = group;
        while hg > 1 && (hg * per > 16 || !group.is_multiple_of(hg)) {
            hg -= 1;
        }
        let unroll = if per <= 4 {
            4
        } else if per <= 8 {
            2
        } else {
            1
        };
        // The plane merge needs `planes · hg · (head_dim + 2)` f32 of shared memory; stay within
        // 16 KiB so that several cubes share an SM (and lavapipe's 32 KiB).
        let budget = smem.min(16 * 1024) / 4;
        let mut planes = 4;
        while planes > 1 && planes * hg * (shape.head_dim + 2) > budget {
            planes /= 2;
        }
        let visible = if shape.window > 0 { max_len.min(shape.window) } else { max_len }.max(1);
        // Enough cubes to cover the SMs twice, down to one iteration per plane: with four
        // (the earlier floor) a Mixtral sequence of 512 tokens ran in 72 cubes of 4 planes and
        // took 18 µs for 2 MB of K/V (ncu on the H200, git `b4cf179`).
        let base = (shape.n_heads / hg) * seqs.max(1);
        let want = (2 * sms).div_ceil(base).max(1);
        let min_chunk = planes * unroll;
        let chunk = visible.div_ceil(want).max(min_chunk);
        Self { hg, planes, unroll, chunk, splits: visible.div_ceil(chunk) }
    }
}

/// [`paged_decode_attention`] with the query of sequence `s` at `s · q_stride` (inside a fused
/// QKV row).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_strided<R: Runtime, KV: Float + CubeElement>(
    client: &ComputeClient<R>,
    shape: PagedAttnShape,
    seqs: usize,
    max_len: usize,
    q: &DeviceArray,
    q_stride: usize,
    k_pool: &DeviceArray,
    v_pool: &DeviceArray,
    block_table: &DeviceArray,
    seq_lens: &DeviceArray,
    params: &DeviceArray,
    out: &DeviceArray,
) -> Result<(), KernelError> {
    let hw = &client.properties().hardware;
    let plane_size = hw.plane_size_max as usize;
    let sms = hw.num_streaming_multiprocessors.unwrap_or(8) as usize;
    let smem = hw.max_shared_memory_size;
    shape.check(plane_size)?;
    if seqs == 0 {
        return Ok(());
    }
    let qn = seqs * shape.n_heads * shape.head_dim;
    if q_stride < shape.n_heads * shape.head_dim
        || q.len < (seqs - 1) * q_stride + shape.n_heads * shape.head_dim
        || out.len < qn
        || block_table.len < seqs * shape.max_blocks
        || seq_lens.len < seqs
        || params.len < 1
    {
        return Err(KernelError::BadItem {
            item: 0,
            reason: "paged_decode_attention: buffer sizes do not match".into(),
        });
    }
    let sp = AttnSplit::choose(&shape, seqs, max_len, plane_size, sms, smem);
    let direct = sp.splits == 1;
    let row = shape.head_dim + 2;
    let part = if direct {
        None
    } else {
        Some(DeviceArray::empty::<R, f32>(client, qn / shape.head_dim * sp.splits * row))
    };
    let part_arg = part.as_ref().unwrap_or(out);
    let group = shape.n_heads / shape.n_kv_heads;
    // SAFETY: q/out/table/lens sizes checked above; table entries and lengths come from the
    // cache allocator, which keeps every referenced slot inside the pools; `part` holds
    // `splits` rows per (sequence, head).
    unsafe {
        attention::paged_decode_split_kernel::launch_unchecked::<KV, R>(
            client,
            CubeCount::Static((shape.n_kv_heads * group / sp.hg) as u32, seqs as u32, sp.splits as u32),
            CubeDim::new_1d((sp.planes * plane_size) as u32),
            q.arg(),
            k_pool.arg(),
            v_pool.arg(),
            block_table.arg(),
            seq_lens.arg(),
            params.arg(),
            out.arg(),
            part_arg.arg(),
            sp.chunk as u32,
            sp.splits as u32,
            shape.head_dim,
            shape.n_heads,
            shape.n_kv_heads,
            sp.hg,
            shape.block_size,
            shape.max_blocks,
            shape.window,
            plane_size,
            sp.planes,
            sp.unroll,
            q_stride,
            direct,
        );
        if let Some(part) = &part {
            attention::paged_decode_combine_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(shape.n_heads as u32, seqs as u32, 1),
                CubeDim::new_1d(plane_size as u32),
                part.arg(),
                out.arg(),
                sp.splits as u32,
                shape.head_dim,
                shape.n_heads,
                plane_size,
            );
        }
    };
    Ok(())
}

/// CPU reference of [`paged_decode_attention`] on f32 pools (plain two-pass softmax).
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_reference(
    shape: PagedAttnShape,
    scale: f32,
    q: &[f32],
    k_pool: &[f32],
    v_pool: &[f32],
    block_table: &[u32],
    seq_lens: &[u32],
) -> Vec<f32> {
    let (hq, d, w) = (shape.n_heads, shape.head_dim, shape.slot_width());
    let group = hq / shape.n_kv_heads;
    let mut out = vec![0f32; seq_lens.len() * hq * d];
    for (s, &len) in seq_lens.iter().enumerate() {
        let len = len as usize;
        let start = if shape.window > 0 { len.saturating_sub(shape.window) } else { 0 };
        let slot = |t: usize| {
            block_table[s * shape.max_blocks + t / shape.block_size] as usize * shape.block_size
                + t % shape.block_size
        };
        for h in 0..hq {
            let qh = &q[(s * hq + h) * d..][..d];
            let off = (h / group) * d;
            let scores: Vec<f32> = (start..len)
                .map(|t| {
                    let k = &k_pool[slot(t) * w + off..][..d];
                    scale * qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>()
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum();
            let o = &mut out[(s * hq + h) * d..][..d];
            for (i, t) in (start..len).enumerate() {
                let v = &v_pool[slot(t) * w + off..][..d];
                for (oo, vv) in o.iter_mut().zip(v) {
                    *oo += e[i] / z * vv;
                }
            }
        }
    }
    out
}
