//! `bench-kernels`' grouped expert GEMM ([`kernels_cubecl::ap_gemm_grouped`]): its check
//! against the CPU reference, and whole layers (gate_up with its activation, then down) at
//! steps of 8..256 tokens, each against the time the layer's active expert bytes take to
//! stream.

use anyhow::Result;
use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::{
    Activation, DeviceArray, ExpertBlock, GROUPED_MAX_TOKEN_GROUPS, GroupedGemm, GroupedKernel, PoolImage,
    ap_gemm_grouped_reference, ap_gemm_grouped_with, grouped_mma_supported, mean_tokens, read_f32,
};
use serde_json::{Value, json};

use crate::kernels::{gaussian_block, random_x, relative_error, time_batches};

/// Largest `|kernel − reference| / max |reference|` of the grouped GEMM on the matrix units:
/// `x` rounded to f16 (relative error ≤ 2⁻¹¹ per element) before f32 accumulation.
const CHECK_BUDGET_MMA: f32 = 2e-3;
/// The same for the plain kernel (`x` in f32).
const CHECK_BUDGET_SIMT: f32 = 1e-4;

/// Layers `(model, experts, hidden, intermediate, top_k, activation)`.
const LAYERS: [(&str, usize, usize, usize, usize, Activation); 3] = [
    ("mixtral", 8, 4096, 14336, 2, Activation::SiluMul),
    ("qwen2_moe", 60, 2048, 1408, 4, Activation::SiluMul),
    ("gemma4", 128, 2816, 704, 8, Activation::GeluTanhMul),
];

/// Token counts of the checked experts: none, one, odd counts, more than one pass of either
/// MMA kernel at its smallest passes, warps of the staged kernel with no tokens.
const CHECK_COUNTS: [u32; 9] = [0, 1, 2, 3, 8, 9, 17, 33, 70];

/// Output rows of a checked block, seven MMA tiles (the staged kernel's second cube lacks one; the
/// columns are the model's; the reference's cost is rows ×
/// columns × tokens).
const CHECK_ROWS: usize = 112;

/// The launch of `block` over one layer of `experts` (`hidden`, `inter`, `act`).
fn launch(block: ExpertBlock, experts: usize, rows: usize, cols: usize, act: Activation) -> GroupedGemm {
    let gated = block == ExpertBlock::GateUp;
    GroupedGemm {
        experts,
        rows,
        cols,
        block,
        x_stride: cols,
        y_stride: if gated { rows / 2 } else { rows },
        epilogue: if gated { act } else { Activation::None },
    }
}

/// First row and count of each expert for `counts`.
fn groups(counts: &[u32]) -> Vec<u32> {
    let mut first = 0;
    counts
        .iter()
        .flat_map(|&c| {
            let g = [first, c];
            first += c;
            g
        })
        .collect()
}

/// The check: per layer shape, a gate_up launch (gated, the model's hidden columns) and a down
/// launch (the model's intermediate columns) of [`CHECK_ROWS`] rows over experts of bits 3..8
/// holding [`CHECK_COUNTS`] tokens, against [`ap_gemm_grouped_reference`].
fn check<R: Runtime>(client: &ComputeClient<R>, records: &mut Vec<Value>) -> Result<()> {
    let mma = grouped_mma_supported(client);
    let budget = if mma { CHECK_BUDGET_MMA } else { CHECK_BUDGET_SIMT };
    for (model, _, hidden, inter, _, act) in LAYERS {
        for (block, cols) in [(ExpertBlock::GateUp, hidden), (ExpertBlock::Down, inter)] {
            let experts = CHECK_COUNTS.len();
            let g = launch(block, experts, CHECK_ROWS, cols, act);
            let mut pool = PoolImage::default();
            let mut slots = Vec::new();
            for e in 0..experts {
                let b = gaussian_block(CHECK_ROWS, cols, (e * 7 + cols) as u64)?;
                let s = pool.push(&b, 3 + (e % 6) as u8);
                // Both halves of the slot words name this block: the launch reads one.
                slots.extend([s.plane_off, s.lut_off, s.bits, s.plane_off, s.lut_off, s.bits]);
            }
            let gr = groups(&CHECK_COUNTS);
            let rows: usize = CHECK_COUNTS.iter().map(|&c| c as usize).sum();
            let x = random_x(rows * cols, 0x2545_F491_4F6C_DD1D ^ cols as u64);
            let up32 = |v: &[u32]| DeviceArray::from_slice(client, v);
            let (planes, luts) = (up32(&pool.planes), DeviceArray::from_slice(client, &pool.luts));
            let (sd, gd, xd) = (up32(&slots), up32(&gr), DeviceArray::from_slice(client, &x));
            let mut want = vec![0f32; rows * g.y_stride];
            ap_gemm_grouped_reference(g, &pool.planes, &pool.luts, &slots, &gr, &x, &mut want);
            // Each kernel at its smallest passes, at the counts' mean and at its largest.
            let mut err = 0f32;
            let runs: Vec<(GroupedKernel, usize)> = if mma {
                let mean = mean_tokens(rows, experts);
                let per_warp = [1, mean, 4 * GROUPED_MAX_TOKEN_GROUPS].map(|m| (GroupedKernel::Mma, m));
                let staged = [1, mean, 128].map(|m| (GroupedKernel::Staged, m));
                per_warp.into_iter().chain(staged).collect()
            } else {
                vec![(GroupedKernel::Plain, 1)]
            };
            for (kernel, mean) in runs {
                let y = DeviceArray::from_slice(client, &vec![0f32; rows * g.y_stride]);
                ap_gemm_grouped_with(client, g, kernel, &planes, &luts, &sd, &gd, rows, mean, &xd, &y)?;
                let e = relative_error(&read_f32(client, &y)?, &want);
                anyhow::ensure!(
                    e <= budget,
                    "grouped GEMM {kernel:?} (passes for {mean} tokens) vs reference: {model} {block:?} {CHECK_ROWS}x{cols}: relative error {e:.2e} > {budget:.0e}"
                );
                err = err.max(e);
            }
            eprintln!(
                "check grouped {model} {block:?} {CHECK_ROWS}x{cols} mma {mma}: relative error {err:.2e}"
            );
            records.push(json!({"kernel": "check", "variant": "grouped", "model": model,
                "block": format!("{block:?}"), "shape": [CHECK_ROWS, cols], "counts": CHECK_COUNTS,
                "mma": mma, "max_rel_err": err}));
        }
    }
    Ok(())
}

/// A pool of `copies` layers of random planes and LUTs (the timing does not depend on the
/// values): the slot words of each copy.
fn random_layers(
    experts: usize,
    hidden: usize,
    inter: usize,
    bits: u8,
    copies: usize,
    pool: &mut PoolImage,
) -> Vec<Vec<u32>> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 32) as u32
    };
    let mut push = |rows: usize, cols: usize, pool: &mut PoolImage| {
        let (p, l) = (pool.planes.len() as u32, pool.luts.len() as u32);
        let words = bits as usize * rows * cols.div_ceil(32);
        pool.planes.extend((0..words).map(|_| next()));
        pool.luts.extend(
            (0..rows << bits).map(|_| f16::from_f32((next() >> 8) as f32 / (1u32 << 24) as f32 - 0.5)),
        );
        [p, l, bits as u32]
    };
    (0..copies)
        .map(|_| {
            (0..experts)
                .flat_map(|_| {
                    let gu = push(2 * inter, hidden, pool);
                    let dn = push(hidden, inter, pool);
                    gu.into_iter().chain(dn)
                })
                .collect()
        })
        .collect()
}

/// The check (with `check`) and the timed layers at `bits_list` and `tokens` per step (routed
/// rows spread evenly over the experts), with their bounds: the active experts' bytes at
/// `hbm` GB/s.
pub(crate) fn grouped_records<R: Runtime>(
    client: &ComputeClient<R>,
    launches: usize,
    hbm: f64,
    do_check: bool,
    bits_list: &[u8],
    tokens: &[usize],
    wanted: impl Fn(&str) -> bool,
) -> Result<Vec<Value>> {
    let mut records = Vec::new();
    if do_check {
        check(client, &mut records)?;
    }
    for (model, experts, hidden, inter, top_k, act) in LAYERS.into_iter().filter(|l| wanted(l.0)) {
        for &bits in bits_list {
            let mut pool = PoolImage::default();
            let layers = random_layers(experts, hidden, inter, bits, 2, &mut pool);
            let planes = DeviceArray::from_slice(client, &pool.planes);
            let luts = DeviceArray::from_slice(client, &pool.luts);
            drop(pool);
            let slots: Vec<DeviceArray> = layers.iter().map(|s| DeviceArray::from_slice(client, s)).collect();
            for &t in tokens {
                let rows = t * top_k;
                let counts: Vec<u32> =
                    (0..experts).map(|e| (rows / experts + usize::from(e < rows % experts)) as u32).collect();
                let active = counts.iter().filter(|&&c| c > 0).count();
                let gd = DeviceArray::from_slice(client, &groups(&counts));
                let x = DeviceArray::from_slice(client, &vec![0.01f32; rows * hidden]);
                let a = DeviceArray::empty::<R, f32>(client, rows * inter);
                let y = DeviceArray::empty::<R, f32>(client, rows * hidden);
                let (gu, dn) = GroupedGemm::layer(experts, hidden, inter, act);
                let mean = mean_tokens(rows, experts);
                let kernels: &[GroupedKernel] = if grouped_mma_supported(client) {
                    &[GroupedKernel::Mma, GroupedKernel::Staged]
                } else {
                    &[GroupedKernel::Plain]
                };
                for &kernel in kernels {
                    let time = time_batches(client, launches / 4 + 1, |i| {
                        let s = &slots[i % slots.len()];
                        for (g, x, y) in [(gu, &x, &a), (dn, &a, &y)] {
                            ap_gemm_grouped_with(client, g, kernel, &planes, &luts, s, &gd, rows, mean, x, y)
                                .expect("valid launch");
                        }
                    })?;
                    let weights = 3 * hidden * inter;
                    let bytes =
                        active * (weights * bits as usize / 8 + (2 * inter + hidden) * (2usize << bits));
                    let bound = bytes as f64 / (hbm * 1e9);
                    let tflops = 2.0 * (rows * weights) as f64 / time.device / 1e12;
                    eprintln!(
                        "grouped layer {model} {kernel:?} t{t} b{bits}: {:.1} us (bytes bound {:.1} us, {tflops:.1} TFLOP/s)",
                        time.device * 1e6,
                        bound * 1e6
                    );
                    records.push(json!({"kernel": "grouped_layer", "model": model, "experts": experts,
                        "tokens": t, "top_k": top_k, "bits": bits, "active_experts": active, "launches": 2,
                        "time_us": time.device * 1e6, "wall_us": time.wall * 1e6, "bound_us": bound * 1e6,
                        "bytes": bytes, "tflops": tflops, "grouped_kernel": format!("{kernel:?}"),
                        "hbm_read_gbps": hbm}));
                }
            }
        }
    }
    Ok(records)
}
