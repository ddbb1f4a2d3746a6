//! The three families against transformers 5.17 reference outputs (see
//! `scripts/make_fixtures.py`), and KV-cached generation against full recomputation.

use std::path::Path;

use burn::tensor::Tensor;
use burn_ndarray::NdArray;
use pw_hf::{Checkpoint, ModelConfig};
use pw_models::generate::{argmax, ids_tensor, last_logits};
use pw_models::{AnyModel, CausalLm, Sampler, SamplingConfig, Trace, generate};
use pw_testkit::{fixture, fixture_copy};

type B = NdArray<f32>;

/// f32 checkpoint vs the f32 PyTorch reference (CPU): only summation order differs
/// (observed at most 8e-6 relative, on Gemma's logits).
const F32_TOL: f32 = 5e-5;
/// Half-precision checkpoints, compared with a reference run in f32 on the same rounded
/// weights: the same bound, the conversion itself must be exact.
const HALF_TOL: f32 = 5e-5;
/// Cached decoding vs recomputing the whole sequence in our own implementation.
const CACHE_TOL: f32 = 2e-5;

fn host(t: Tensor<B, 3>) -> (Vec<usize>, Vec<f32>) {
    let dims = t.dims().to_vec();
    (dims, t.into_data().convert::<f32>().to_vec::<f32>().unwrap())
}

/// Largest absolute difference, relative to the reference's largest magnitude when above one.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1f32, |m, x| m.max(x.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale
}

struct Reference {
    ckpt: Checkpoint,
}

impl Reference {
    fn open(dir: &Path) -> Self {
        let ckpt = Checkpoint::from_files(dir.to_path_buf(), &[dir.join("ref.safetensors")]).unwrap();
        Self { ckpt }
    }
    fn f32(&self, name: &str) -> Vec<f32> {
        self.ckpt.read_f32(name).unwrap().data
    }
    fn ids(&self, name: &str) -> Vec<u32> {
        self.ckpt.read_i64(name).unwrap().1.into_iter().map(|x| x as u32).collect()
    }
    fn i64(&self, name: &str) -> Vec<i64> {
        self.ckpt.read_i64(name).unwrap().1
    }
}

/// Loads `model_dir`, runs the reference prompt and compares every recorded quantity.
fn check_against_reference(model_dir: &str, ref_dir: &str, tol: f32) {
    let device = Default::default();
    let model = AnyModel::<B>::load(fixture(model_dir), &device).unwrap();
    let r = Reference::open(&fixture(ref_dir));
    let ids = r.ids("input_ids");
    let mut trace = Trace::default();
    let mut cache = model.new_cache();
    let logits = model.forward(ids_tensor::<B>(&ids, &device), &mut cache, Some(&mut trace));

    for (i, h) in trace.hidden.iter().enumerate() {
        let (_, got) = host(h.clone());
        let err = rel_err(&got, &r.f32(&format!("hidden.{i}")));
        if std::env::var_os("PW_SHOW_ERR").is_some() {
            eprintln!("{model_dir}: hidden {i} error {err:e}");
        }
        assert!(err <= tol, "{model_dir}: hidden state {i}: error {err:e} > {tol:e}");
    }
    let (_, got) = host(logits);
    let err = rel_err(&got, &r.f32("logits"));
    if std::env::var_os("PW_SHOW_ERR").is_some() {
        eprintln!("{model_dir}: logits error {err:e}");
    }
    assert!(err <= tol, "{model_dir}: logits error {err:e} > {tol:e}");

    let mut moe_layers = 0;
    for (l, routing) in trace.routing.iter().enumerate() {
        let Some(routing) = routing else {
            assert!(!r.ckpt.contains(&format!("router.{l}.idx")), "{model_dir}: layer {l} should be routed");
            continue;
        };
        moe_layers += 1;
        let want_idx = r.i64(&format!("router.{l}.idx"));
        let want_w = r.f32(&format!("router.{l}.weights"));
        let got_w = routing.weights.clone().into_data().convert::<f32>().to_vec::<f32>().unwrap();
        let k = routing.k;
        for (tok, (got, want)) in routing.indices.chunks(k).zip(want_idx.chunks(k)).enumerate() {
            // Same experts with the same weights; the order within a token is irrelevant.
            let mut g: Vec<(usize, f32)> =
                got.iter().copied().zip(got_w[tok * k..(tok + 1) * k].iter().copied()).collect();
            let mut w: Vec<(usize, f32)> = want
                .iter()
                .map(|&x| x as usize)
                .zip(want_w[tok * k..(tok + 1) * k].iter().copied())
                .collect();
            g.sort_by_key(|p| p.0);
            w.sort_by_key(|p| p.0);
            let gi: Vec<usize> = g.iter().map(|p| p.0).collect();
            let wi: Vec<usize> = w.iter().map(|p| p.0).collect();
            assert_eq!(gi, wi, "{model_dir}: layer {l} token {tok}: experts differ");
            for (a, b) in g.iter().zip(&w) {
                assert!(
                    (a.1 - b.1).abs() <= tol,
                    "{model_dir}: layer {l} token {tok}: weight {} vs {}",
                    a.1,
                    b.1
                );
            }
        }
        let probs = routing.probs.clone().into_data().convert::<f32>().to_vec::<f32>().unwrap();
        let err = rel_err(&probs, &r.f32(&format!("router.{l}.probs")));
        assert!(err <= tol, "{model_dir}: layer {l} router probabilities error {err:e}");
    }
    assert!(moe_layers > 0, "{model_dir}: no routed layer checked");
}

/// Greedy generation with the cache equals transformers' greedy `generate`, and equals
/// argmax of a full recomputation at every step (logits too, within `CACHE_TOL`).
fn check_generation(model_dir: &str, ref_dir: &str) {
    let device = Default::default();
    let model = AnyModel::<B>::load(fixture(model_dir), &device).unwrap();
    let r = Reference::open(&fixture(ref_dir));
    let prompt = r.ids("input_ids");
    let want = r.ids("generated");
    let mut sampler = Sampler::new(SamplingConfig { max_tokens: want.len(), ..Default::default() });
    let mut step_logits = Vec::new();
    // Re-run the cached loop by hand to keep each step's logits.
    let mut cache = model.new_cache();
    let mut logits = last_logits(model.forward(ids_tensor::<B>(&prompt, &device), &mut cache, None));
    let mut got = Vec::new();
    for _ in 0..want.len() {
        let tok = argmax(&logits);
        got.push(tok);
        step_logits.push(logits.clone());
        logits = last_logits(model.forward(ids_tensor::<B>(&[tok], &device), &mut cache, None));
    }
    assert_eq!(got, want, "{model_dir}: greedy tokens differ from transformers");
    let via_api = generate(&model, &prompt, &mut sampler, &device, |_| true);
    assert_eq!(via_api, got, "{model_dir}: generate() differs from the manual loop");

    let mut seq = prompt.clone();
    for (step, tok) in got.iter().enumerate() {
        let mut fresh = model.new_cache();
        let full = last_logits(model.forward(ids_tensor::<B>(&seq, &device), &mut fresh, None));
        assert_eq!(argmax(&full), *tok, "{model_dir}: step {step}: cache changes the choice");
        let err = rel_err(&step_logits[step], &full);
        assert!(err <= CACHE_TOL, "{model_dir}: step {step}: cached logits error {err:e}");
        seq.push(*tok);
    }
}

#[test]
fn mixtral_matches_transformers() {
    check_against_reference("mixtral", "mixtral", F32_TOL);
}

#[test]
fn mixtral_fused_expert_layout_matches() {
    check_against_reference("mixtral_fused", "mixtral", F32_TOL);
}

#[test]
fn mixtral_f16_checkpoint_matches() {
    check_against_reference("mixtral_f16", "mixtral_f16", HALF_TOL);
}

#[test]
fn mixtral_cached_generation() {
    check_generation("mixtral", "mixtral");
}

#[test]
fn qwen2_moe_matches_transformers() {
    check_against_reference("qwen2_moe", "qwen2_moe", F32_TOL);
}

#[test]
fn qwen2_moe_sharded_bf16_checkpoint_matches() {
    check_against_reference("qwen2_moe_bf16", "qwen2_moe_bf16", HALF_TOL);
}

#[test]
fn qwen2_moe_cached_generation() {
    check_generation("qwen2_moe", "qwen2_moe");
}

#[test]
fn gemma4_matches_transformers() {
    check_against_reference("gemma4", "gemma4", F32_TOL);
}

#[test]
fn gemma4_multimodal_layout_matches() {
    check_against_reference("gemma4_mm", "gemma4", F32_TOL);
}

#[test]
fn gemma4_cached_generation_past_the_window() {
    check_generation("gemma4", "gemma4");
}

#[test]
fn gemma4_config_from_multimodal_checkpoint() {
    let ModelConfig::Gemma4(c) = ModelConfig::from_dir(fixture("gemma4_mm")).unwrap() else {
        panic!("not gemma4");
    };
    assert!(c.multimodal);
    assert_eq!(c.layers[2].head_dim, 16);
    assert_eq!(c.layers[2].num_key_value_heads, 1);
    assert!(c.layers[2].k_eq_v && !c.layers[2].sliding);
}

fn load_err(dir: &Path) -> String {
    match AnyModel::<B>::load(dir, &Default::default()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_checkpoints_give_errors_that_name_the_culprit() {
    // Missing shard.
    let tmp = fixture_copy("qwen2_moe_bf16");
    std::fs::remove_file(tmp.path().join("model-00002-of-00004.safetensors")).unwrap();
    let e = load_err(tmp.path());
    assert!(e.contains("model-00002-of-00004.safetensors"), "{e}");

    // Wrong shape for the config.
    let tmp = fixture_copy("mixtral");
    let cfg = std::fs::read_to_string(tmp.path().join("config.json")).unwrap();
    std::fs::write(
        tmp.path().join("config.json"),
        cfg.replace("\"intermediate_size\": 48", "\"intermediate_size\": 40"),
    )
    .unwrap();
    let e = load_err(tmp.path());
    assert!(e.contains("experts.0.w1.weight") && e.contains("[40, 32]"), "{e}");

    // Missing config field.
    let cfg = cfg.replace("\"num_local_experts\": 4,", "");
    std::fs::write(tmp.path().join("config.json"), cfg).unwrap();
    let e = load_err(tmp.path());
    assert!(e.contains("config.json") && e.contains("num_local_experts"), "{e}");

    // No weights at all.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("mixtral/config.json"), tmp.path().join("config.json")).unwrap();
    let e = load_err(tmp.path());
    assert!(e.contains("model.safetensors"), "{e}");

    // Missing tensor.
    let tmp = fixture_copy("gemma4");
    std::fs::copy(fixture("mixtral/model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
    let e = load_err(tmp.path());
    assert!(e.contains("missing") && e.contains("model.layers.0"), "{e}");
}

#[test]
fn random_init_models_run() {
    let device = Default::default();
    let ModelConfig::Gemma4(cfg) = ModelConfig::from_dir(fixture("gemma4")).unwrap() else { panic!() };
    let model = pw_models::Gemma4::<B>::init(&cfg, &device);
    let mut cache = model.new_cache();
    let logits = model.forward(ids_tensor::<B>(&[3, 4, 5], &device), &mut cache, None);
    assert_eq!(logits.dims(), [1, 3, cfg.vocab_size]);
    let values = logits.into_data().convert::<f32>().to_vec::<f32>().unwrap();
    assert!(values.iter().all(|x| x.is_finite()));
    // Soft-capping bounds every logit by the cap.
    let cap = cfg.final_logit_softcapping.unwrap() as f32;
    assert!(values.iter().all(|x| x.abs() <= cap));
}

/// The shipped models (`assets/`, trained by `scripts/train_tiny_moe.py`) against transformers'
/// own f32 logits (`scripts/shipped_model_refs.py`, TF32 off), and their tokenizer against the
/// ids transformers was given.
fn check_shipped(name: &str) {
    const PROMPT: &str =
        "HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind";
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets").join(name);
    let r = Checkpoint::from_files(dir.clone(), &[dir.join("ref_logits.safetensors")]).unwrap();
    let ids: Vec<u32> = r.read_i64("input_ids").unwrap().1.into_iter().map(|x| x as u32).collect();
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    assert_eq!(tok.encode(PROMPT, true).unwrap().get_ids(), &ids[..], "{name}: tokenizer disagrees");

    let device = Default::default();
    let model = AnyModel::<B>::load(&dir, &device).unwrap();
    let logits = model.forward(ids_tensor::<B>(&ids, &device), &mut model.new_cache(), None);
    let err = rel_err(&host(logits).1, &r.read_f32("logits").unwrap().data);
    assert!(err <= HALF_TOL, "{name}: logits error {err:e} > {HALF_TOL:e}");
}

#[test]
fn shipped_tiny_mixtral_matches_transformers() {
    check_shipped("tiny-mixtral");
}

#[test]
fn shipped_tiny_qwen2_moe_matches_transformers() {
    check_shipped("tiny-qwen2-moe");
}

// ---- Paged experts (issue 6): the quantized checkpoint through the page table -------------

/// Every page at 8 bits vs the dense forward of the source checkpoint: the 8-bit
/// quantization error of the expert weights, relative to the largest logit.
const PAGED_Q8_TOL: f32 = 5e-3;
/// The wgpu kernels vs the CPU reference of the same (mixed) configuration: f32 summation
/// order only, carried through every layer.
const PAGED_KERNEL_TOL: f32 = 1e-4;
/// Logits after 8 → mixed → 8 against the first 8-bit logits: only Burn's matmul order may differ.
const PAGED_RESTORE_TOL: f32 = 1e-5;

/// Quantizes every expert block of a fixture (uniform importance) into a PagedWeight
/// checkpoint in `out`: the same layout `pagedweight quantize` writes, without the Fisher pass.
fn quantize_fixture(name: &str, out: &Path) {
    use pw_format::{ApBlock, BlockKind, BlockMeta, CheckpointWriter};
    use pw_models::{HfSource, LoadedModel, expert_block_name};
    let dir = fixture(name);
    let loaded = LoadedModel::<B>::load(&dir, None, &Default::default()).unwrap();
    let hf = Checkpoint::open(&dir).unwrap();
    let src = HfSource::<B>::new(&hf, &Default::default());
    let mut w = CheckpointWriter::create(out).unwrap();
    let mut expert_tensors = std::collections::HashSet::new();
    for bank in &loaded.banks {
        let (h, i) = (bank.cfg.hidden, bank.cfg.intermediate);
        let rows = bank.layout.read_rows(&src, bank.num_experts, bank.cfg).unwrap();
        expert_tensors.extend(bank.layout.tensor_names(bank.num_experts));
        for e in 0..bank.num_experts {
            let (gu_src, dn_src) = bank.layout.expert_sources(e);
            for (kind, m, r, c, sources) in [
                (BlockKind::GateUp, &rows.gate_up[e], 2 * i, h, gu_src),
                (BlockKind::Down, &rows.down[e], h, i, dn_src),
            ] {
                let name = expert_block_name(bank.layout.prefix(), e, kind);
                let block = ApBlock::quantize(&name, m, None, r, c, 3, 8).unwrap();
                w.add_block(BlockMeta { name, layer: bank.layer, expert: e, kind, sources }, &block).unwrap();
            }
        }
    }
    for n in hf.names().filter(|n| !expert_tensors.contains(*n)).collect::<Vec<_>>() {
        let (dtype, shape, bytes) = hf.raw(n).unwrap();
        w.add_dense(n, dtype, shape.to_vec(), bytes.to_vec()).unwrap();
    }
    w.copy_file(&dir.join("config.json")).unwrap();
    w.finish().unwrap();
}

fn wgpu_device() -> burn_wgpu::WgpuDevice {
    burn_wgpu::WgpuDevice::DefaultDevice
}

fn logits<Bk: burn::tensor::backend::Backend>(m: &AnyModel<Bk>, ids: &[u32], dev: &Bk::Device) -> Vec<f32> {
    let out = m.forward(ids_tensor::<Bk>(ids, dev), &mut m.new_cache(), None);
    out.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// Per family: the paged model at q = 8 on wgpu (grouped kernels) against the dense forward;
/// then a mixed configuration (pages at 3..8 bits, set through the boundary API) on wgpu
/// against the same configuration on the CPU reference path.
fn check_paged(name: &str) {
    use pw_models::{LoadedModel, PagedOptions};
    type Gpu = burn_wgpu::Wgpu;
    let tmp = tempfile::tempdir().unwrap();
    let q = tmp.path().join("q");
    quantize_fixture(name, &q);
    let ids: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % 64).collect();
    let cpu_dev = Default::default();
    let dense = logits(&AnyModel::<B>::load(fixture(name), &cpu_dev).unwrap(), &ids, &cpu_dev);

    let gdev = wgpu_device();
    let opts = PagedOptions { bits: Some(8), weight_budget: None };
    let gpu = LoadedModel::<Gpu>::load_paged(&q, opts, &gdev).unwrap();
    let pages = gpu.pages.clone().unwrap();
    assert!(pages.runs_kernels::<Gpu>(&gdev), "{name}: wgpu tensors take the kernel path");
    assert!(pages.committed_bits().iter().all(|&b| b == 8));
    let g8 = logits(&gpu.model, &ids, &gdev);
    let e8 = rel_err(&g8, &dense);
    assert!(e8 < PAGED_Q8_TOL, "{name}: paged q=8 vs dense: {e8}");
    assert!(e8 > 0.0, "{name}: the paged model is not the dense one");

    let cpu = LoadedModel::<B>::load_paged(&q, opts, &cpu_dev).unwrap();
    let cpages = cpu.pages.clone().unwrap();
    assert_eq!(cpages.device_kind(), "host");
    for p in [&pages, &cpages] {
        for i in 0..p.len() {
            p.set_desired(pw_linear::PageId(i), [3, 8, 5, 4, 7, 6][(i * 5 + 1) % 6]).unwrap();
        }
    }
    // Lowerings commit at the boundary; the mixed state is then what both sides read.
    let rep = gpu.boundary().unwrap().unwrap();
    assert!(!rep.lowered.is_empty() && rep.published, "{name}: {rep:?}");
    cpu.boundary().unwrap();
    assert_eq!(pages.committed_bits(), cpages.committed_bits());
    pages.audit().unwrap();
    let gm = logits(&gpu.model, &ids, &gdev);
    let cm = logits(&cpu.model, &ids, &cpu_dev);
    let em = rel_err(&gm, &cm);
    assert!(em < PAGED_KERNEL_TOL, "{name}: mixed bits, wgpu vs CPU reference: {em}");
    assert!(rel_err(&gm, &g8) > em, "{name}: lowering pages changed nothing");
    eprintln!("{name}: paged q=8 vs dense {e8:.2e}; mixed bits wgpu vs CPU {em:.2e}");
    // Raising back restores the 8-bit outputs. The expert kernels are bit-exact after a raise
    // (pw-linear's wgpu tests assert that); the model around them runs Burn's autotuned matmuls,
    // which may switch kernels between calls and reorder sums, so logits get a float budget.
    pages.set_desired_all(8);
    pages.settle().unwrap();
    assert!(pages.committed_bits().iter().all(|&b| b == 8));
    let back = logits(&gpu.model, &ids, &gdev);
    let eb = rel_err(&back, &g8);
    assert!(eb < PAGED_RESTORE_TOL, "{name}: 8 → mixed → 8 differs by {eb}");
}

#[test]
fn paged_mixtral_matches_dense_and_cpu_reference() {
    check_paged("mixtral");
}

#[test]
fn paged_qwen2_moe_matches_dense_and_cpu_reference() {
    check_paged("qwen2_moe");
}

#[test]
fn paged_gemma4_matches_dense_and_cpu_reference() {
    check_paged("gemma4");
}

#[test]
fn paged_weight_budget_picks_the_highest_bits_that_fit() {
    use pw_models::{LoadedModel, ModelError, PagedOptions};
    let tmp = tempfile::tempdir().unwrap();
    let q = tmp.path().join("q");
    quantize_fixture("mixtral", &q);
    let ck = pw_format::Checkpoint::open(&q).unwrap();
    let at = |b: u8| -> u64 {
        ck.manifest().blocks.iter().map(|e| e.bytes_at(b)).map(|(p, l)| (p + l) as u64).sum()
    };
    let dev = Default::default();
    let opts = |bits, budget| PagedOptions { bits, weight_budget: Some(budget) };
    // Just under the 6-bit size: 5 bits.
    let m = LoadedModel::<B>::load_paged(&q, opts(None, at(6) - 1), &dev).unwrap();
    assert_eq!(m.bits, Some(5));
    let usage = m.pages.as_ref().unwrap().usage();
    assert_eq!((usage.weights, usage.budget), (at(5), at(6) - 1));
    assert_eq!(m.expert_bytes, at(5));
    // Too small for 3 bits, or for the bits asked for: errors with the numbers.
    let e = LoadedModel::<B>::load_paged(&q, opts(None, at(3) - 1), &dev).unwrap_err();
    assert!(matches!(e, ModelError::Budget { bits: 3, .. }), "{e}");
    assert!(e.to_string().contains(&format!("need {} bytes at 3 bits", at(3))), "{e}");
    let e = LoadedModel::<B>::load_paged(&q, opts(Some(7), at(6)), &dev).unwrap_err();
    assert!(e.to_string().contains(&format!("need {} bytes at 7 bits", at(7))), "{e}");
}
