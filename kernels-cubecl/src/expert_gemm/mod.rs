//! The grouped bit-plane + LUT GEMM of the routed experts: `y = x · Wᵀ` for 1..16 tokens per
//! work item, many blocks of different committed bit-widths in one launch, optionally applying
//! `act(gate) · up` to `x` as it is loaded (the down projection of a SwiGLU / GeGLU expert).
//!
//! Two kernels share the descriptors and results: the tiled kernel ([`tiled`]) and the
//! persistent GEMV ([`gemv`]) for items of few tokens; [`ap_gemm`] picks one per launch, and
//! [`routed`] launches them over the descriptor tables the routing writes on the device.

pub mod bitplane;
pub mod gemv;
pub mod grouped;
pub mod routed;
#[cfg(test)]
mod tests;
pub mod tiled;

use cubecl::prelude::*;

use crate::activation::{gelu_tanh, silu};
use crate::pool::{DESC_WORDS, MAX_TOKENS, PoolImage, WorkItem, token_bucket};
use crate::{Activation, DeviceArray, KernelError};
use gemv::{GEMV_MIN_ITEMS, GEMV_ROWS, GEMV_WARPS_PER_SM, launch_gemv};

/// Largest LUT (8 bits): each row gets this many shared-memory slots.
pub const LUT_SLOTS: usize = 256;

/// Launch shape of the grouped GEMM: device facts (plane size, how shuffles behave) and the
/// kernels' tuning, fixed when the configuration is built ([`GemmConfig::for_client`] gives the
/// defaults for a device).
#[derive(Debug, Clone, Copy)]
pub struct GemmConfig {
    /// Lanes per plane (warp) of the device: 32 on NVIDIA, 8 on lavapipe.
    pub plane_size: usize,
    /// Planes (warps) per cube.
    pub warps: usize,
    /// Rows each warp of the tiled kernel handles per staged chunk of `x` (amortises the
    /// staging and its barriers; costs `warps · rows_per_warp` KiB of LUT space).
    pub rows_per_warp: usize,
    /// `true` (the default): launches of at least `gemv_min_items` items of at most
    /// [`gemv::GEMV_HOST_MAX_TOKENS`] tokens (routed tables: [`gemv::GEMV_MAX_TOKENS`]) whose `x` fits in
    /// shared memory go to the persistent GEMV kernel ([`gemv`]).
    pub gemv: bool,
    /// Fewest items for the GEMV kernel ([`GEMV_MIN_ITEMS`] by default).
    pub gemv_min_items: usize,
    /// Plane words per lane and row that the GEMV kernel loads together (registers against
    /// loads in flight).
    pub gemv_words_per_lane: usize,
    /// Rows of one warp unit of the GEMV kernel: each staged `x` vector read from shared memory
    /// serves this many rows (the load/store pipe, which also carries the LUT shuffles, is the
    /// GEMV's busiest), against registers.
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
    /// ([`GEMV_WARPS_PER_SM`] by default: its registers' limit with `x` in f32).
    pub gemv_warps_per_sm: usize,
    /// The GEMV kernel loads a step's plane words during the previous step's arithmetic (≤ 4-bit
    /// items; `false` by default).
    pub gemv_prefetch: bool,
}

impl GemmConfig {
    /// Checks the shared-memory LUT bases fit the 14 bits [`bitplane::word_rows`] keeps of them (a
    /// bound it gives the compiler): at most 64 rows of 256-slot LUTs per cube.
    pub fn check(&self) -> Result<(), KernelError> {
        let rows = (self.warps * self.rows_per_warp).max(self.warps * self.gemv_rows);
        if rows * LUT_SLOTS * 4 > 1 << 16
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
        // Two rows per warp where shared memory allows (the fastest on the H200); devices with
        // little of it (lavapipe: 32 KiB) get one.
        let rows_per_warp = if hw.max_shared_memory_size >= 96 * 1024 { 2 } else { 1 };
        // Planes narrower than 16 lanes: lavapipe (8), a CPU behind a shader compiler.
        let unrolled = hw.plane_size_max >= 16;
        let plane_size = hw.plane_size_max as usize;
        Self {
            plane_size,
            warps: 8,
            rows_per_warp,
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

    /// The kernels' comptime LUT mode (`bitplane::LUT_*`).
    pub(crate) fn lut_mode(&self) -> u32 {
        match (self.lut_in_lanes, self.plane_size) {
            (false, _) => bitplane::LUT_SHARED,
            (true, 8) => bitplane::LUT_LANES_PAIR,
            (true, 32) if self.shuffle_wraps => bitplane::LUT_LANES_WRAP,
            (true, p) if p >= 16 => bitplane::LUT_LANES_MASKED,
            _ => bitplane::LUT_SHARED,
        }
    }
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
    if desc.len != items.len() * DESC_WORDS {
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
    let lut_slots = if items.iter().all(|i| i.bits <= 4) { 16 } else { LUT_SLOTS };
    let bufs = [planes, luts, desc, x, y];
    if launch_gemv(client, cfg, bufs, items.len(), false, max_cols, most_tokens, act, lut_slots, None) {
        return Ok(());
    }
    // SAFETY: every offset and length was checked against the buffers above.
    unsafe {
        tiled::launch(
            client,
            cfg,
            bufs,
            items.len(),
            max_rows,
            token_bucket(most_tokens),
            act,
            lut_slots,
            false,
        )
    };
    Ok(())
}

/// CPU reference of [`ap_gemm`] over a host pool image; `y` is updated in place.
pub fn ap_gemm_reference(pool: &PoolImage, items: &[WorkItem], x: &[f32], y: &mut [f32], act: Activation) {
    for it in items {
        let (n, k, t, b) = (it.rows as usize, it.cols as usize, it.tokens as usize, it.bits as usize);
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
            let (p, l) = (&pool.planes[it.plane_off as usize..], &pool.luts[it.lut_off as usize..]);
            for r in 0..n {
                let acc: f32 =
                    xv.iter().enumerate().map(|(c, &xc)| xc * grouped::ap_weight(p, l, n, k, b, r, c)).sum();
                y[it.y_off as usize + tok * n + r] = acc;
            }
        }
    }
}
