//! The prefill attention part of `bench-kernels`: the matrix-unit kernel beside the plain one
//! on the models' attention shapes over a paged f16 cache, and with `--check` both against the
//! CPU reference.

use anyhow::Result;
use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::{
    DeviceArray, PREFILL_RUN_ROWS, PagedAttnShape, PrefillKernel, paged_decode_attention_reference,
    paged_prefill_attention, prefill_run_rows, prefill_runs, read_f32, sync,
};
use serde_json::{Value, json};

use crate::kernels::{BenchKernelsArgs, random_x, relative_error, time_batches};

/// Attention shapes `(model, layers, query heads, KV heads, head_dim, window)` (Gemma-4's
/// sliding and full layers).
const SHAPES: [(&str, &str, usize, usize, usize, usize); 4] = [
    ("mixtral", "all", 32, 8, 128, 0),
    ("qwen2_moe", "all", 16, 16, 128, 0),
    ("gemma4", "sliding", 16, 8, 256, 1024),
    ("gemma4", "full", 16, 2, 512, 0),
];

/// Largest `max |kernel − reference| / max |reference|` of the plain kernel (f32 arithmetic
/// on the f16 cache, another summation order).
const PLAIN_BUDGET: f32 = 1e-4;
/// Of the matrix-unit kernel: `Q` and the softmax weights rounded to f16 (2⁻¹¹ each) before
/// their products, summed in f32.
const MMA_BUDGET: f32 = 5e-3;

/// A step's rows over a paged cache: sequences' blocks shuffled through one pool.
struct Step {
    shape: PagedAttnShape,
    /// f16 values of the pools (as f32, for the reference).
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    table: Vec<u32>,
    lens: Vec<u32>,
    row_seq: Vec<usize>,
}

impl Step {
    /// Chunks `(first position, rows)`, one per sequence.
    fn new(shape: PagedAttnShape, chunks: &[(usize, usize)], seed: u64) -> Self {
        let w = shape.slot_width();
        let blocks = chunks.len() * shape.max_blocks;
        let mut order: Vec<u32> = (0..blocks as u32).collect();
        // A fixed shuffle: block i of the pool goes to position (i · 7919) mod blocks.
        order.sort_by_key(|&b| (b as u64 * 7919) % blocks as u64);
        let f16r = |v: Vec<f32>| v.into_iter().map(|x| f16::from_f32(2.0 * x).to_f32()).collect::<Vec<_>>();
        let slots = blocks * shape.block_size;
        let k = f16r(random_x(slots * w, seed));
        let v = f16r(random_x(slots * w, seed ^ 0x5555));
        let (mut table, mut lens, mut row_seq) = (Vec::new(), Vec::new(), Vec::new());
        for (s, &(p0, n)) in chunks.iter().enumerate() {
            let row = &order[s * shape.max_blocks..][..shape.max_blocks];
            for p in p0..p0 + n {
                table.extend_from_slice(row);
                lens.push(p as u32 + 1);
                row_seq.push(s);
            }
        }
        let width = shape.n_heads * shape.head_dim;
        let q = random_x(lens.len() * width, seed ^ 0xAAAA).into_iter().map(|x| 4.0 * x).collect();
        Self { shape, k, v, q, table, lens, row_seq }
    }

    fn rows(&self) -> usize {
        self.lens.len()
    }

    /// Multiply-adds of `Q·Kᵀ` and `P·V` over the keys each row sees, × 2.
    fn flops(&self) -> f64 {
        let s = self.shape;
        let keys: usize = self
            .lens
            .iter()
            .map(|&l| if s.window > 0 { (l as usize).min(s.window) } else { l as usize })
            .sum();
        4.0 * (keys * s.n_heads * s.head_dim) as f64
    }
}

/// The step's buffers on the device.
struct DeviceStep {
    k: DeviceArray,
    v: DeviceArray,
    q: DeviceArray,
    table: DeviceArray,
    lens: DeviceArray,
    scale: DeviceArray,
    out: DeviceArray,
}

impl DeviceStep {
    fn new<R: Runtime>(client: &ComputeClient<R>, s: &Step) -> Self {
        let h = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        let width = s.shape.n_heads * s.shape.head_dim;
        Self {
            k: DeviceArray::from_slice(client, &h(&s.k)),
            v: DeviceArray::from_slice(client, &h(&s.v)),
            q: DeviceArray::from_slice(client, &s.q),
            table: DeviceArray::from_slice(client, &s.table),
            lens: DeviceArray::from_slice(client, &s.lens),
            scale: DeviceArray::from_slice(client, &[1.0 / (s.shape.head_dim as f32).sqrt()]),
            out: DeviceArray::from_slice(client, &vec![f32::NAN; s.rows() * width]),
        }
    }

    /// Enqueues one launch of `kernel` over `runs` (`[first, rows]` pairs on the device).
    fn launch<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        s: &Step,
        kernel: PrefillKernel,
        runs: &(DeviceArray, usize, usize),
    ) -> Result<()> {
        let width = s.shape.n_heads * s.shape.head_dim;
        paged_prefill_attention::<R, f16>(
            client,
            s.shape,
            kernel,
            s.rows(),
            &runs.0,
            runs.1,
            runs.2,
            &self.q,
            width,
            &self.k,
            &self.v,
            &self.table,
            &self.lens,
            &self.scale,
            &self.out,
        )?;
        Ok(())
    }
}

/// The step's runs for `kernel` (the matrix-unit kernel's length, or the plain one's) on the
/// device, their count and the longest.
fn runs<R: Runtime>(
    client: &ComputeClient<R>,
    s: &Step,
    kernel: PrefillKernel,
) -> (DeviceArray, usize, usize) {
    let rows = match kernel {
        PrefillKernel::Plain => PREFILL_RUN_ROWS,
        _ => prefill_run_rows::<R, f16>(client, &s.shape),
    };
    let r = prefill_runs(&s.row_seq, rows);
    let longest = r.chunks(2).map(|x| x[1] as usize).max().unwrap_or(0);
    (DeviceArray::from_slice(client, &r), r.len() / 2, longest)
}

/// The kernels to run: the plain one, and the matrix-unit one where the device has it.
fn kernels<R: Runtime>(client: &ComputeClient<R>) -> Vec<(&'static str, PrefillKernel)> {
    let mut k = vec![("plain", PrefillKernel::Plain)];
    if kernels_cubecl::grouped_mma_supported(client) {
        k.push(("mma", PrefillKernel::Mma));
    }
    k
}

/// `bench-kernels --check` of the prefill attention: both kernels against
/// [`paged_decode_attention_reference`] on random inputs (a 300-row chunk at positions
/// 77..377, a decode row, a 45-row chunk from position 0), GQA groups 4, 1 and 2, windows
/// crossing chunks, head dims 128, 64, 256 and 512; fails the run past the budgets.
fn check<R: Runtime>(client: &ComputeClient<R>) -> Result<Vec<Value>> {
    let mut records = Vec::new();
    let shape = |n_heads, n_kv_heads, head_dim, window| PagedAttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
        block_size: 16,
        max_blocks: 25,
        window,
    };
    let cases = [
        ("mixtral", shape(32, 8, 128, 0)),
        ("qwen2_moe", shape(16, 16, 128, 0)),
        ("window 100", shape(16, 16, 128, 100)),
        ("group 2, head_dim 64", shape(8, 4, 64, 0)),
        ("gemma4 sliding, window 100", shape(16, 8, 256, 100)),
        ("gemma4 full, head_dim 512", shape(16, 2, 512, 0)),
    ];
    for (i, (name, sh)) in cases.into_iter().enumerate() {
        let s = Step::new(sh, &[(77, 300), (5, 1), (0, 45)], 0x7A11 + i as u64);
        let scale = 1.0 / (sh.head_dim as f32).sqrt();
        let want = paged_decode_attention_reference(sh, scale, &s.q, &s.k, &s.v, &s.table, &s.lens);
        for (variant, kernel) in kernels(client) {
            // Fresh buffers (output all NaN) per kernel: a row one leaves unwritten shows.
            let d = DeviceStep::new(client, &s);
            d.launch(client, &s, kernel, &runs(client, &s, kernel))?;
            let got = read_f32(client, &d.out)?;
            let err = relative_error(&got, &want);
            let budget = if kernel == PrefillKernel::Plain { PLAIN_BUDGET } else { MMA_BUDGET };
            eprintln!(
                "check prefill attention {name} {variant}: relative error {err:.2e} (budget {budget:.0e})"
            );
            anyhow::ensure!(
                err <= budget,
                "prefill attention {name} ({variant}) vs reference: relative error {err:.2e} > {budget:.0e}"
            );
            records.push(json!({"kernel": "prefill_attention_check", "case": name, "variant": variant,
                "rel_err": err, "budget": budget}));
        }
    }
    Ok(records)
}

/// Prefill attention records: with `check`, the check above; then each model's shape (or a
/// small one with `quick`) over a 2048-row chunk after 0 and 6144 cached tokens (the first and
/// last steps of an 8192-token prompt), plain and matrix-unit kernels, with TFLOP/s.
pub(crate) fn attention_records<R: Runtime>(
    client: &ComputeClient<R>,
    a: &BenchKernelsArgs,
) -> Result<Vec<Value>> {
    let mut records = if a.check { check(client)? } else { Vec::new() };
    let chunks: &[(usize, usize)] = if a.quick { &[(0, 64)] } else { &[(0, 2048), (6144, 2048)] };
    for &(model, layers, n_heads, n_kv_heads, head_dim, window) in SHAPES.iter().filter(|s| a.wants(s.0)) {
        for &(p0, rows) in chunks {
            let shape = PagedAttnShape {
                n_heads,
                n_kv_heads,
                head_dim,
                block_size: 16,
                max_blocks: (p0 + rows).div_ceil(16),
                window,
            };
            let s = Step::new(shape, &[(p0, rows)], 0xBE7C);
            let d = DeviceStep::new(client, &s);
            for (variant, kernel) in kernels(client) {
                let r = runs(client, &s, kernel);
                let launches = if a.quick { 2 } else { a.launches.clamp(2, 10) };
                let t = time_batches(client, launches, |_| {
                    d.launch(client, &s, kernel, &r).expect("checked shapes");
                })?;
                sync(client)?;
                let tflops = s.flops() / t.device / 1e12;
                eprintln!(
                    "prefill attention {model} ({layers} layers) rows {rows} after {p0}: {variant} {:.1} us ({tflops:.1} TFLOP/s)",
                    t.device * 1e6
                );
                records.push(json!({"kernel": "prefill_attention", "model": model, "layers": layers, "variant": variant,
                    "rows": rows, "cached": p0, "time_us": t.device * 1e6, "wall_us": t.wall * 1e6,
                    "tflops": tflops}));
            }
        }
    }
    Ok(records)
}
