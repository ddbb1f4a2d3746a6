//! `pw-bench bench-kernels`: GPU timings of the bit-plane kernels on the
//! three models' expert shapes, written as JSON records.
//!
//! Timing: batches of back-to-back launches, each batch timed by device events around it
//! (`ComputeClient::profile`, CUDA events on the GPU; wall clock where the runtime has no
//! device timer), median of 7 batches; the wall-clock time of the same batches is recorded
//! beside it. Each launch reads a different copy of the weights so that L2 cannot serve them.
//! The bound is the streaming read bandwidth measured by the same binary.

use anyhow::{Context, Result};
use cubecl::prelude::*;
use kernels_cubecl::{
    Activation, DeviceArray, GemmConfig, PoolImage, PoolSlot, WorkItem, ap_gemm, sync, upload_items,
};
use pw_format::ApBlock;
use serde_json::{Value, json};
use std::time::Instant;

/// Options of `bench-kernels`.
#[derive(clap::Args, Debug)]
pub struct BenchKernelsArgs {
    /// Runtime: cuda or wgpu.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Output JSON file.
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Bytes of weight copies to rotate through (must exceed L2).
    #[arg(long, default_value_t = 512 << 20)]
    pub rotate_bytes: usize,
    /// Launches per timed batch.
    #[arg(long, default_value_t = 100)]
    pub launches: usize,
    /// Quick run: fewer shapes and bit-widths (for a smoke test on wgpu).
    #[arg(long)]
    pub quick: bool,
    /// Only these models (comma-separated: mixtral, qwen2_moe, gemma4).
    #[arg(long, value_delimiter = ',')]
    pub models: Vec<String>,
    /// Override the warps per cube of the grouped GEMM.
    #[arg(long)]
    pub warps: Option<usize>,
    /// Override the rows per warp of the grouped GEMM.
    #[arg(long)]
    pub rows_per_warp: Option<usize>,
    /// Override the plane words per lane of the GEMV kernel.
    #[arg(long)]
    pub gemv_words: Option<usize>,
    /// Override the rows of one GEMV warp unit.
    #[arg(long)]
    pub gemv_rows: Option<usize>,
    /// Also time the other variants of the expert kernel (the GEMV wherever it applies, the
    /// tiled kernel alone, the GEMV's staging and prefetch options), for ratios in the same run.
    #[arg(long)]
    pub all_variants: bool,
    /// Only these bit-widths (comma-separated; default 3..=8).
    #[arg(long, value_delimiter = ',')]
    pub bits: Vec<u8>,
    /// Token counts of the single-block runs (comma-separated; default 1,4,8,16).
    #[arg(long, value_delimiter = ',')]
    pub tokens: Vec<usize>,
    /// Skip the prefill comparison (dequantize + Burn matmul vs Burn's f16 matmul; CUDA only).
    #[arg(long)]
    pub no_prefill: bool,
    /// Skip the whole-layer runs.
    #[arg(long)]
    pub no_layers: bool,
    /// Time only these variants (comma-separated names from `--all-variants`' list, which they
    /// imply; default: all that the other options select).
    #[arg(long, value_delimiter = ',')]
    pub variants: Vec<String>,
    /// Also check each single block's result against the CPU reference on random `x` (fails
    /// the run past the error budget).
    #[arg(long)]
    pub check: bool,
    /// Skip the dense f16 GEMMs (projections, dense MLPs, LM heads; plain vs matrix units).
    #[arg(long)]
    pub no_dense: bool,
    /// CubeK matmul kernels of the dense GEMMs' check and timings from 64 tokens
    /// (comma-separated `MatmulKernel` names; default all).
    #[arg(long, value_delimiter = ',')]
    pub matmul_kernels: Vec<String>,
    /// Token counts of the dense GEMMs' timings (comma-separated; default 1, 2, 4, 8, 16, 64,
    /// 256, 1024, 2048, or to 16 with `--quick`).
    #[arg(long, value_delimiter = ',')]
    pub dense_tokens: Vec<usize>,
    /// Only the stream read and the dense f16 GEMMs.
    #[arg(long)]
    pub dense_only: bool,
    /// Tokens per step of the grouped expert GEMM's layers (comma-separated; default 8, 32, 64,
    /// 128, 256, or 32 with `--quick`; 0 skips them and its check).
    #[arg(long, value_delimiter = ',')]
    pub grouped_tokens: Vec<usize>,
    /// Only the stream read, the grouped expert GEMM (and with `--check` its check) and the
    /// dense f16 GEMMs unless `--no-dense`.
    #[arg(long)]
    pub grouped_only: bool,
    /// Skip the prefill attention (plain and matrix-unit kernels; with `--check` their check).
    #[arg(long)]
    pub no_attention: bool,
    /// Only the prefill attention.
    #[arg(long)]
    pub attention_only: bool,
}

impl BenchKernelsArgs {
    /// Whether `--models` selects `model` (every model when empty).
    pub(crate) fn wants(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|w| w == model)
    }
}

/// Runs the benchmark on the chosen runtime.
pub fn bench_kernels(a: &BenchKernelsArgs) -> Result<()> {
    let records = match a.device.as_str() {
        #[cfg(feature = "cuda")]
        "cuda" => {
            let device = cubecl::cuda::CudaDevice::new(0);
            let mut records = run::<cubecl::cuda::CudaRuntime>(&device, a)?;
            if !a.no_prefill && !a.dense_only {
                records
                    .extend(crate::prefill::prefill_records::<cubecl::cuda::CudaRuntime>(&device, a.quick)?);
            }
            records
        }
        #[cfg(not(feature = "cuda"))]
        "cuda" => {
            anyhow::bail!("--device cuda: this binary was built without CUDA; rebuild with `--features cuda`")
        }
        "wgpu" => run::<cubecl::wgpu::WgpuRuntime>(&cubecl::wgpu::WgpuDevice::DefaultDevice, a)?,
        d => anyhow::bail!("--device {d}: expected cuda or wgpu"),
    };
    std::fs::write(&a.out, serde_json::to_string_pretty(&records)?)
        .with_context(|| format!("{}", a.out.display()))?;
    Ok(())
}

/// Expert shapes `(model, block, rows, cols)`: gate_up is `[2I, H]`, down `[H, I]`.
const SHAPES: [(&str, &str, usize, usize); 6] = [
    ("mixtral", "w1", 14336, 4096),
    ("mixtral", "w2", 4096, 14336),
    ("qwen2_moe", "gate_up", 2816, 2048),
    ("qwen2_moe", "down", 2048, 1408),
    ("gemma4", "gate_up", 1408, 2816),
    ("gemma4", "down", 2816, 704),
];

/// Layers `(model, experts, hidden, intermediate, tokens, top_k, activation)`.
const LAYERS: [(&str, usize, usize, usize, usize, usize, Activation); 3] = [
    ("mixtral", 8, 4096, 14336, 8, 2, Activation::SiluMul),
    ("qwen2_moe", 60, 2048, 1408, 16, 4, Activation::SiluMul),
    ("gemma4", 128, 2816, 704, 32, 8, Activation::GeluTanhMul),
];

pub(crate) fn gaussian_block(rows: usize, cols: usize, seed: u64) -> Result<ApBlock> {
    // Trained projections are close to Gaussian; a sum of uniforms is enough here.
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut uni = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let w: Vec<f32> = (0..rows * cols).map(|_| (uni() + uni() + uni() + uni()) * 0.02).collect();
    Ok(ApBlock::quantize("bench", &w, None, rows, cols, 3, 8)?)
}

/// `n` values uniform in [-0.5, 0.5) from `seed` (the checks' random inputs).
pub(crate) fn random_x(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// `max |got − want| / max |want|`; infinite where `got` has a NaN (a max would skip it).
pub(crate) fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    got.iter().zip(want).fold(0f32, |m, (a, b)| if a.is_nan() { f32::INFINITY } else { m.max((a - b).abs()) })
        / scale
}

/// Largest `|kernel − reference| / max |reference|` accepted by `bench-kernels --check` (f32
/// accumulation in a different order over up to 14336 columns).
const CHECK_BUDGET: f32 = 1e-4;
/// [`CHECK_BUDGET`] of the GEMV with `x` staged as f16 (`GemmConfig::gemv_x_half`): each `x`
/// rounded to f16 (relative error ≤ 2⁻¹¹).
const CHECK_BUDGET_X_HALF: f32 = 2e-3;

/// `bench-kernels --check`: the kernel's result for one block against the CPU reference on
/// random `x` (the timed runs use a constant `x`); errors past [`CHECK_BUDGET`] fail the run.
fn check_block<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: GemmConfig,
    block: &ApBlock,
    bits: u8,
    tokens: usize,
) -> Result<f32> {
    let (rows, cols) = (block.rows, block.cols);
    let mut pool = PoolImage::default();
    let slot = pool.push(block, bits);
    let x = random_x(tokens * cols, 0x9E37_79B9_7F4A_7C15 ^ ((bits as u64) << 8) ^ (tokens as u64));
    let it = slot.item(0, 0, tokens as u32);
    let planes = DeviceArray::from_slice(client, &pool.planes);
    let luts = DeviceArray::from_slice(client, &pool.luts);
    let xd = DeviceArray::from_slice(client, &x);
    let y = DeviceArray::empty::<R, f32>(client, tokens * rows);
    let desc = upload_items(client, &[it]);
    ap_gemm(client, cfg, &planes, &luts, &[it], &desc, &xd, &y, Activation::None)?;
    let got = kernels_cubecl::read_f32(client, &y)?;
    let mut want = vec![0f32; tokens * rows];
    kernels_cubecl::ap_gemm_reference(&pool, &[it], &x, &mut want, Activation::None);
    let err = relative_error(&got, &want);
    let budget = if cfg.gemv_x_half { CHECK_BUDGET_X_HALF } else { CHECK_BUDGET };
    anyhow::ensure!(
        err <= budget,
        "kernel vs reference: {rows}x{cols} at {bits} bits, {tokens} tokens: relative error {err:.2e} > {budget:.0e}"
    );
    Ok(err)
}

/// The kernel variants to time: the current choice ("specialized": the persistent GEMV for
/// launches of many items of ≤ 2 tokens, the tiled kernel otherwise), and when asked the GEMV
/// wherever it applies, the tiled kernel alone, and ≤ 4-bit LUTs from shared memory instead of
/// the lanes' registers.
fn variants(cfg: GemmConfig, all_variants: bool) -> Vec<(&'static str, GemmConfig)> {
    let mut v = vec![("specialized", cfg)];
    if all_variants {
        v.push(("gemv", GemmConfig { gemv_min_items: 1, ..cfg }));
        v.push(("tiled", GemmConfig { gemv: false, ..cfg }));
        if cfg.lut_in_lanes {
            v.push(("lut_shared", GemmConfig { lut_in_lanes: false, ..cfg }));
        }
        v.push(("gemv_x_half", GemmConfig { gemv_min_items: 1, gemv_x_half: true, ..cfg }));
        v.push((
            "gemv_x_half_w32",
            GemmConfig { gemv_min_items: 1, gemv_x_half: true, gemv_warps_per_sm: 32, ..cfg },
        ));
        v.push(("gemv_prefetch", GemmConfig { gemv_min_items: 1, gemv_prefetch: true, ..cfg }));
        v.push((
            "gemv_x_half_prefetch",
            GemmConfig { gemv_min_items: 1, gemv_x_half: true, gemv_prefetch: true, ..cfg },
        ));
    }
    v
}

/// Per-launch seconds of a timed batch: device events (or wall clock where the runtime
/// has no device timer) and wall clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub device: f64,
    pub wall: f64,
}

/// Median per-launch time of `f` (which enqueues one launch per call) over 7 batches of
/// `launches` calls.
pub(crate) fn time_batches<R: Runtime>(
    client: &ComputeClient<R>,
    launches: usize,
    mut f: impl FnMut(usize) + Send,
) -> Result<Timing> {
    f(0);
    sync(client)?;
    let (mut dev, mut wall) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        let t = Instant::now();
        let (_, d) = client
            .profile(
                || {
                    for i in 0..launches {
                        f(i);
                    }
                },
                "bench",
            )
            .map_err(|e| anyhow::anyhow!("profiling: {e:?}"))?;
        let ticks = cubecl::future::block_on(d.resolve());
        sync(client)?;
        wall.push(t.elapsed().as_secs_f64() / launches as f64);
        dev.push(ticks.duration().as_secs_f64() / launches as f64);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok(Timing { device: median(&mut dev), wall: median(&mut wall) })
}

/// The bound every GPU benchmark compares against: median seconds of one streaming read of
/// `words` u32 words (made on the device; much larger than L2 outside quick runs).
pub(crate) fn stream_read_secs<R: Runtime>(client: &ComputeClient<R>, words: usize) -> Result<f64> {
    let data = DeviceArray::empty::<R, u32>(client, words);
    kernels_cubecl::fill_hash(client, &data, 1);
    let cubes = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(8) * 8;
    let out = DeviceArray::empty::<R, u32>(client, cubes as usize * 256);
    let secs = time_batches(client, 20, |_| kernels_cubecl::stream_read(client, &data, &out, cubes))?.device;
    eprintln!("stream read: {:.0} GB/s", (words * 4) as f64 / secs / 1e9);
    Ok(secs)
}

fn run<R: Runtime>(device: &R::Device, a: &BenchKernelsArgs) -> Result<Vec<Value>> {
    let client = R::client(device);
    let mut cfg = GemmConfig::for_client(&client);
    cfg.warps = a.warps.unwrap_or(cfg.warps);
    cfg.rows_per_warp = a.rows_per_warp.unwrap_or(cfg.rows_per_warp);
    cfg.gemv_words_per_lane = a.gemv_words.unwrap_or(cfg.gemv_words_per_lane);
    cfg.gemv_rows = a.gemv_rows.unwrap_or(cfg.gemv_rows);
    cfg.check().context("--warps / --rows-per-warp / --gemv-rows")?;
    let known: Vec<&str> =
        variants(GemmConfig { lut_in_lanes: true, ..cfg }, true).iter().map(|v| v.0).collect();
    if let Some(v) = a.variants.iter().find(|v| !known.contains(&v.as_str())) {
        anyhow::bail!("--variants {v}: expected some of {}", known.join(", "));
    }
    eprintln!("config: {cfg:?}");
    if a.attention_only {
        return crate::attention::attention_records(&client, a);
    }
    let wanted = |m: &str| a.wants(m);
    let mut records = Vec::new();

    let words = if a.quick { 1 << 22 } else { 1 << 29 };
    let secs = stream_read_secs(&client, words)?;
    let hbm = (words * 4) as f64 / secs / 1e9;
    records.push(
        json!({"kernel": "stream_read", "bytes": words * 4, "time_us": secs * 1e6, "hbm_read_gbps": hbm}),
    );

    let matmuls = if a.matmul_kernels.is_empty() {
        kernels_cubecl::MatmulKernel::ALL.to_vec()
    } else {
        a.matmul_kernels
            .iter()
            .map(|n| {
                kernels_cubecl::MatmulKernel::from_name(n)
                    .ok_or_else(|| anyhow::anyhow!("--matmul-kernels {n}: not a CubeK matmul kernel name"))
            })
            .collect::<Result<Vec<_>>>()?
    };
    if !a.no_dense {
        records.extend(crate::dense::dense_records(&client, a, hbm, &matmuls)?);
    }
    if a.dense_only {
        return Ok(records);
    }
    if !a.no_attention && !a.grouped_only {
        records.extend(crate::attention::attention_records(&client, a)?);
    }
    let grouped_tokens = match a.grouped_tokens.as_slice() {
        [] if a.quick => vec![32],
        [] => vec![8, 32, 64, 128, 256],
        [0] => vec![],
        t => t.to_vec(),
    };
    if !grouped_tokens.is_empty() {
        let bits = if a.bits.is_empty() { vec![4, 3] } else { a.bits.clone() };
        records.extend(crate::grouped::grouped_records(
            &client,
            a.launches,
            hbm,
            a.check,
            &bits,
            &grouped_tokens,
            wanted,
        )?);
    }
    if a.grouped_only {
        return Ok(records);
    }

    let bits_list: Vec<u8> = if !a.bits.is_empty() {
        a.bits.clone()
    } else if a.quick {
        vec![3, 8]
    } else {
        (3..=8).collect()
    };
    let token_list = if a.tokens.is_empty() { vec![1usize, 4, 8, 16] } else { a.tokens.clone() };
    let shapes: &[_] = if a.quick { &SHAPES[2..4] } else { &SHAPES };
    for &(model, block_name, rows, cols) in shapes.iter().filter(|s| wanted(s.0)) {
        let block = gaussian_block(rows, cols, rows as u64 * 31 + cols as u64)?;
        for &bits in &bits_list {
            let (pb, lb) = block.bytes_at(bits);
            let copies = (a.rotate_bytes / (pb + lb)).clamp(2, 4096);
            let mut pool = PoolImage::default();
            let slots: Vec<PoolSlot> = (0..copies).map(|_| pool.push(&block, bits)).collect();
            let planes = DeviceArray::from_slice(&client, &pool.planes);
            let luts = DeviceArray::from_slice(&client, &pool.luts);
            for &tokens in &token_list {
                let x = DeviceArray::from_slice(&client, &vec![0.01f32; tokens * cols]);
                let y = DeviceArray::empty::<R, f32>(&client, tokens * rows);
                let descs: Vec<(WorkItem, DeviceArray)> = slots
                    .iter()
                    .map(|s| {
                        let it = s.item(0, 0, tokens as u32);
                        (it, upload_items(&client, &[it]))
                    })
                    .collect();
                if a.check {
                    // The launch's own choice (the tiled kernel for one block) and the GEMV.
                    for (variant, vcfg) in [
                        ("specialized", cfg),
                        ("gemv", GemmConfig { gemv_min_items: 1, ..cfg }),
                        ("gemv_x_half", GemmConfig { gemv_min_items: 1, gemv_x_half: true, ..cfg }),
                    ] {
                        let err = check_block(&client, vcfg, &block, bits, tokens)?;
                        eprintln!(
                            "check {variant} {model} {block_name} {rows}x{cols} t{tokens} b{bits}: relative error {err:.2e}"
                        );
                        records.push(json!({"kernel": "check", "variant": variant, "model": model,
                            "block": block_name, "shape": [rows, cols], "tokens": tokens, "bits": bits,
                            "max_rel_err": err}));
                    }
                }
                // Named variants are picked from the whole list, `--all-variants` or not.
                for (variant, vcfg) in variants(cfg, a.all_variants || !a.variants.is_empty())
                    .into_iter()
                    .filter(|(v, _)| a.variants.is_empty() || a.variants.iter().any(|w| w == v))
                {
                    let t = time_batches(&client, a.launches, |i| {
                        let (it, d) = &descs[i % descs.len()];
                        ap_gemm(
                            &client,
                            vcfg,
                            &planes,
                            &luts,
                            std::slice::from_ref(it),
                            d,
                            &x,
                            &y,
                            Activation::None,
                        )
                        .expect("valid items");
                    })?;
                    let gbps = (pb + lb) as f64 / t.device / 1e9;
                    eprintln!(
                        "gemv {variant} {model} {block_name} {rows}x{cols} t{tokens} b{bits}: {:.1} us {gbps:.0} GB/s",
                        t.device * 1e6
                    );
                    records.push(
                        json!({"kernel": "gemv", "variant": variant, "model": model, "block": block_name,
                        "shape": [rows, cols], "tokens": tokens, "bits": bits, "time_us": t.device * 1e6,
                        "wall_us": t.wall * 1e6, "effective_gbps": gbps,
                        "bytes": pb + lb, "hbm_read_gbps": hbm}),
                    );
                }
            }
        }
    }

    let layers: &[_] = if a.no_layers {
        &[]
    } else if a.quick {
        &LAYERS[1..2]
    } else {
        &LAYERS
    };
    for &(model, experts, hidden, inter, tokens, top_k, act) in layers.iter().filter(|l| wanted(l.0)) {
        let gu = gaussian_block(2 * inter, hidden, 1)?;
        let dn = gaussian_block(hidden, inter, 2)?;
        // Routed pairs spread evenly: every expert active.
        let pairs = tokens * top_k;
        let per_expert: Vec<usize> =
            (0..experts).map(|e| pairs / experts + usize::from(e < pairs % experts)).collect();
        let mut mixes: Vec<(String, Vec<u8>)> =
            bits_list.iter().map(|&b| (format!("{b}"), vec![b; experts])).collect();
        if !a.quick {
            mixes.push(("mixed_3_4_8".into(), (0..experts).map(|e| [3u8, 4, 8][e % 3]).collect()));
        }
        for (label, bits) in mixes {
            let mut pool = PoolImage::default();
            let mut layer_bytes = 0usize;
            let copies = 2;
            let mut layer_slots = Vec::new();
            for _ in 0..copies {
                let slots: Vec<(PoolSlot, PoolSlot)> =
                    (0..experts).map(|e| (pool.push(&gu, bits[e]), pool.push(&dn, bits[e]))).collect();
                layer_slots.push(slots);
            }
            for (e, &b) in bits.iter().enumerate() {
                let _ = e;
                let (p1, l1) = gu.bytes_at(b);
                let (p2, l2) = dn.bytes_at(b);
                layer_bytes += p1 + l1 + p2 + l2;
            }
            let planes = DeviceArray::from_slice(&client, &pool.planes);
            let luts = DeviceArray::from_slice(&client, &pool.luts);
            let x = DeviceArray::from_slice(&client, &vec![0.01f32; pairs * hidden]);
            let h = DeviceArray::empty::<R, f32>(&client, pairs * 2 * inter);
            let y = DeviceArray::empty::<R, f32>(&client, pairs * hidden);
            let plans: Vec<_> = layer_slots
                .iter()
                .map(|slots| {
                    let (mut gi, mut di, mut t0) = (Vec::new(), Vec::new(), 0u32);
                    for (e, (g, d)) in slots.iter().enumerate() {
                        let t = per_expert[e] as u32;
                        gi.push(g.item(t0 * hidden as u32, t0 * 2 * inter as u32, t));
                        di.push(d.item(t0 * 2 * inter as u32, t0 * hidden as u32, t));
                        t0 += t;
                    }
                    let (gd, dd) = (upload_items(&client, &gi), upload_items(&client, &di));
                    (gi, gd, di, dd)
                })
                .collect();
            for (variant, vcfg) in variants(cfg, a.all_variants) {
                let t = time_batches(&client, a.launches / 4 + 1, |i| {
                    let (gi, gd, di, dd) = &plans[i % plans.len()];
                    ap_gemm(&client, vcfg, &planes, &luts, gi, gd, &x, &h, Activation::None)
                        .expect("valid items");
                    ap_gemm(&client, vcfg, &planes, &luts, di, dd, &h, &y, act).expect("valid items");
                })?;
                let gbps = layer_bytes as f64 / t.device / 1e9;
                eprintln!(
                    "layer {variant} {model} e{experts} t{tokens} bits {label}: {:.1} us {gbps:.0} GB/s",
                    t.device * 1e6
                );
                records.push(json!({"kernel": "grouped_layer", "variant": variant, "model": model,
                    "experts": experts, "tokens": tokens, "top_k": top_k, "bits": label, "launches": 2,
                    "time_us": t.device * 1e6, "wall_us": t.wall * 1e6, "effective_gbps": gbps,
                    "bytes": layer_bytes, "shape": [experts, hidden, inter], "hbm_read_gbps": hbm}));
            }
        }
    }
    Ok(records)
}
