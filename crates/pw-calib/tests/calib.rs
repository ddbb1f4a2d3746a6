//! The Fisher accumulation, and whole-model quantization of the tiny transformers fixtures
//! (all three families, both expert layouts, f32/f16/bf16, sharded).

mod common;

use std::path::Path;

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn_ndarray::NdArray;
use common::{calib_ids, fixture};
use pw_calib::{
    CalibError, FisherPass, ImportanceMethod, QuantizeConfig, Stage, expert_gradients, memory_needs,
    quantize_model, streamed_importance,
};
use pw_format::{BlockKind, Checkpoint};
use pw_models::eval::token_windows;
use pw_models::{AnyModel, CausalLm, LoadedModel, Trace};

type Cpu = NdArray<f32>;
type Ad = Autodiff<Cpu>;

/// 8-bit experts vs the original model: largest logit difference relative to the largest
/// logit magnitude. The LUTs are f16, so even a lossless codebook leaves ~5e-4 relative error
/// per weight; observed 3e-4 (Mixtral, Qwen) and 5.1e-3 (Gemma-4, whose six sandwich-normed
/// layers amplify it) — the computation is deterministic, so 2x headroom suffices.
const Q8_LOGIT_TOL: f32 = 1e-2;

fn small_config() -> QuantizeConfig {
    QuantizeConfig {
        min_bits: 3,
        max_bits: 8,
        ctx: 16,
        calib_tokens: 96,
        importance: ImportanceMethod::Fisher,
        ..QuantizeConfig::default()
    }
}

fn logits<B: Backend>(model: &AnyModel<B>, ids: &[u32], device: &B::Device) -> Vec<f32> {
    let mut cache = model.new_cache();
    let out = model.forward(pw_models::generate::ids_tensor::<B>(ids, device), &mut cache, None);
    out.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale
}

/// Quantizes `name` with Fisher importance, reopens the result, and checks blocks, copied
/// tensors and logits.
fn quantize_and_check(name: &str) {
    quantize_and_check_with(name, ImportanceMethod::Fisher);
}

fn quantize_and_check_with(name: &str, importance: ImportanceMethod) {
    let dir = fixture(name);
    let out = tempfile::tempdir().unwrap();
    let ids = calib_ids(200, 96, 1);
    let mut events = Vec::new();
    let cfg = QuantizeConfig { importance, ..small_config() };
    let report =
        quantize_model::<Ad>(&dir, out.path(), &ids, &cfg, &Default::default(), |p| events.push(p)).unwrap();
    // Stages in the order they start (with the streamed importance, quantizing overlaps the
    // layer pass); copying comes after everything else.
    let mut stages = Vec::new();
    for p in &events {
        if !stages.contains(&p.stage) {
            stages.push(p.stage);
        }
    }
    let want_stages = match importance {
        ImportanceMethod::Fisher => {
            [Stage::Loading, Stage::Gradients, Stage::Quantizing, Stage::Copying].to_vec()
        }
        _ => [Stage::Moments, Stage::Quantizing, Stage::Copying].to_vec(),
    };
    assert_eq!(stages, want_stages, "{name}");
    let copying = events.iter().position(|p| p.stage == Stage::Copying).unwrap();
    assert!(events[copying..].iter().all(|p| p.stage == Stage::Copying), "{name}: {events:?}");
    let quantizing: Vec<_> = events.iter().filter(|p| p.stage == Stage::Quantizing).collect();
    assert!(quantizing.windows(2).all(|w| w[0].done < w[1].done), "{name}: {events:?}");
    let last = quantizing.last().unwrap();
    assert_eq!(
        (last.done, last.total),
        (report.manifest.blocks.len(), report.manifest.blocks.len()),
        "{name}"
    );
    assert_eq!(report.importance, importance, "{name}");
    assert_eq!(report.calib_loss.is_some(), importance == ImportanceMethod::Fisher, "{name}");
    // 96 calibration tokens in windows of 16.
    assert_eq!((report.tokens, report.windows), (96, 6), "{name}");

    let ck = Checkpoint::open(out.path()).unwrap();
    let m = ck.manifest();
    assert_eq!(m, &report.manifest);
    let device = Default::default();
    let original = LoadedModel::<Cpu>::load(&dir, None, &device).unwrap();
    let n_blocks: usize = original.banks.iter().map(|b| 2 * b.num_experts).sum();
    assert_eq!(m.blocks.len(), n_blocks, "{name}");
    assert_eq!(m.bit_range(), Some((3, 8)));
    // The calibration routing of every sparse layer: shares averaging 1.
    let layers: Vec<usize> = m.routing.iter().map(|r| r.layer).collect();
    assert_eq!(layers, original.banks.iter().map(|b| b.layer).collect::<Vec<_>>(), "{name}");
    for (r, b) in m.routing.iter().zip(&original.banks) {
        let sum: f64 = r.mass_share.iter().sum();
        assert!((sum - b.num_experts as f64).abs() < 1e-6, "{name} layer {}: {:?}", r.layer, r.mass_share);
    }
    // Every block lists its source tensors, and the blocks plus the dense tensors account for
    // every tensor of the source checkpoint exactly once.
    let hf = pw_hf::Checkpoint::open(&dir).unwrap();
    let mut covered: Vec<String> = m.blocks.iter().flat_map(|b| b.sources.clone()).collect();
    covered.sort();
    covered.dedup();
    covered.extend(m.dense.keys().cloned());
    covered.sort();
    assert_eq!(covered, hf.names().map(str::to_string).collect::<Vec<_>>(), "{name}");
    for t in m.dense.keys() {
        assert_eq!(ck.dense(t).unwrap().data(), hf.raw(t).unwrap().2, "{name}: `{t}` copied unchanged");
    }
    for b in &m.blocks {
        let bank = original.banks.iter().find(|k| k.layer == b.layer).unwrap();
        let (h, i) = (bank.cfg.hidden, bank.cfg.intermediate);
        let shape = match b.kind {
            BlockKind::GateUp => (2 * i, h),
            BlockKind::Down => (h, i),
        };
        assert_eq!((b.rows, b.cols), shape, "{name}: {}", b.name);
        assert!(b.sensitivity.windows(2).all(|s| s[1] <= s[0]), "{name}: {} {:?}", b.name, b.sensitivity);
    }
    for f in ["config.json", "generation_config.json"] {
        assert_eq!(out.path().join(f).exists(), dir.join(f).exists(), "{name}: {f}");
    }

    // 8-bit logits close to the original, 3-bit ones further away.
    let probe = calib_ids(24, 96, 7);
    let want = logits(&original.model, &probe, &device);
    let err_at = |bits| {
        let q = LoadedModel::<Cpu>::load(out.path(), Some(bits), &device).unwrap();
        assert_eq!(q.bits, Some(bits));
        rel_err(&logits(&q.model, &probe, &device), &want)
    };
    let (e8, e3) = (err_at(8), err_at(3));
    if std::env::var_os("PW_SHOW_ERR").is_some() {
        eprintln!("{name}: logits error at 8 bits {e8:e}, at 3 bits {e3:e}");
    }
    assert!(e8 <= Q8_LOGIT_TOL, "{name}: 8-bit logits error {e8:e} > {Q8_LOGIT_TOL:e}");
    assert!(e3 > e8, "{name}: 3-bit error {e3:e} should exceed 8-bit error {e8:e}");
    // The default bit-width of a quantized directory is the highest stored.
    let default = AnyModel::<Cpu>::load(out.path(), &device).unwrap();
    assert_eq!(rel_err(&logits(&default, &probe, &device), &want), e8);
}

#[test]
fn quantizes_mixtral() {
    quantize_and_check("mixtral");
}

#[test]
fn quantizes_mixtral_fused_layout() {
    quantize_and_check("mixtral_fused");
}

#[test]
fn quantizes_mixtral_f16() {
    quantize_and_check("mixtral_f16");
}

#[test]
fn quantizes_qwen2_moe_with_a_dense_layer() {
    quantize_and_check("qwen2_moe");
}

#[test]
fn quantizes_sharded_bf16_qwen2_moe() {
    quantize_and_check("qwen2_moe_bf16");
}

#[test]
fn quantizes_gemma4() {
    quantize_and_check("gemma4");
}

#[test]
fn quantizes_gemma4_multimodal_layout() {
    quantize_and_check("gemma4_mm");
}

#[test]
fn quantizes_every_family_with_streamed_importance() {
    for name in ["mixtral", "mixtral_fused", "qwen2_moe", "gemma4_mm"] {
        quantize_and_check_with(name, ImportanceMethod::Streamed);
    }
}

/// The streamed pass sees the same routing as the whole model (mass and windows per expert,
/// as the Fisher pass records them) and gives each expert one importance per input column:
/// positive exactly for the experts some token chose, and larger for a projection's inputs
/// where the routed tokens' activations are larger (the moments of a reference computed from
/// the model's own trace, on Mixtral whose expert input is the post-attention norm).
#[test]
fn streamed_importance_follows_the_routing_of_the_whole_model() {
    let device = Default::default();
    for name in ["mixtral", "qwen2_moe", "gemma4"] {
        let dir = fixture(name);
        let ids = calib_ids(40, 96, 5);
        let windows = token_windows(&ids, 8);
        let streamed = streamed_importance::<Cpu>(&dir, &windows, &device, |_, _| {}).unwrap();
        let loaded = LoadedModel::<Ad>::load(&dir, None, &device).unwrap();
        let mut fisher = FisherPass::new(&loaded.banks);
        for w in &windows {
            fisher.add_window(&loaded.model, &loaded.banks, w, &device);
        }
        let want = fisher.finish(&loaded.banks);
        assert_eq!(streamed.len(), want.len(), "{name}");
        for ((s, f), bank) in streamed.iter().zip(&want).zip(&loaded.banks) {
            assert_eq!(s.layer, bank.layer, "{name}");
            assert_eq!(s.routed_windows, f.routed_windows, "{name} layer {}", s.layer);
            for (a, b) in s.routing_mass.iter().zip(&f.routing_mass) {
                assert!((a - b).abs() <= 1e-5 * b.abs() + 1e-9, "{name} layer {}: mass {a} vs {b}", s.layer);
            }
            for e in 0..bank.num_experts {
                assert_eq!(s.gate_up[e].len(), bank.cfg.hidden);
                assert_eq!(s.down[e].len(), bank.cfg.intermediate);
                let routed = s.routed_windows[e] > 0;
                assert_eq!(
                    s.gate_up[e].iter().all(|&x| x > 0.0),
                    routed,
                    "{name} layer {} expert {e}",
                    s.layer
                );
                assert_eq!(s.down[e].iter().any(|&x| x > 0.0), routed, "{name} layer {} expert {e}", s.layer);
            }
        }
    }
}

#[test]
fn auto_importance_picks_fisher_when_it_fits_and_streams_otherwise() {
    let dir = fixture("mixtral");
    let cfg = small_config();
    let needs = memory_needs(&dir, &cfg).unwrap();
    assert!(needs.streamed < needs.fisher, "{needs:?}");
    let ids = calib_ids(64, 96, 3);
    for (memory_bytes, want) in
        [(needs.fisher, ImportanceMethod::Fisher), (needs.fisher - 1, ImportanceMethod::Streamed)]
    {
        let out = tempfile::tempdir().unwrap();
        let cfg = QuantizeConfig { importance: ImportanceMethod::Auto { memory_bytes }, ..small_config() };
        let report = quantize_model::<Ad>(&dir, out.path(), &ids, &cfg, &Default::default(), |_| {}).unwrap();
        assert_eq!(report.importance, want, "{memory_bytes} bytes");
        assert_eq!(report.memory, needs);
    }
}

/// A run stopped part-way through the blocks, rerun with the same inputs, keeps the blocks of
/// the shards it closed and ends with the checkpoint an uninterrupted run writes; a rerun with
/// other settings starts over.
#[test]
fn an_interrupted_quantization_resumes_after_its_closed_shards() {
    let dir = fixture("qwen2_moe");
    let ids = calib_ids(96, 96, 4);
    // Small shards: a few blocks each.
    let cfg = QuantizeConfig { importance: ImportanceMethod::Streamed, shard_bytes: 4096, ..small_config() };
    let device = Default::default();
    let whole = tempfile::tempdir().unwrap();
    let want = quantize_model::<Ad>(&dir, whole.path(), &ids, &cfg, &device, |_| {}).unwrap().manifest;
    let total = want.blocks.len();
    assert!(total >= 8, "{total} blocks");

    let out = tempfile::tempdir().unwrap();
    let stop = total / 2;
    let interrupted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        quantize_model::<Ad>(&dir, out.path(), &ids, &cfg, &device, |p| {
            assert!(!(p.stage == Stage::Quantizing && p.done == stop), "interrupted");
        })
    }));
    assert!(interrupted.is_err());
    assert!(out.path().join(pw_format::PARTIAL_FILE).is_file());
    assert!(!out.path().join(pw_format::MANIFEST_FILE).exists());

    // The rerun reports the kept blocks as done from its first quantizing step.
    let mut first_done = None;
    let got = quantize_model::<Ad>(&dir, out.path(), &ids, &cfg, &device, |p| {
        if p.stage == Stage::Quantizing && first_done.is_none() {
            first_done = Some(p.done);
        }
    })
    .unwrap()
    .manifest;
    let first_done = first_done.unwrap();
    assert!(first_done > 1 && first_done < stop + 1, "resumed at block {first_done} of {total}");
    // The same checkpoint; only the shards holding each tensor may be numbered differently (the
    // interrupted run's last, unclosed shard is redone from the next number).
    let unsharded = |m: &pw_format::Manifest| {
        let mut m = m.clone();
        m.blocks.iter_mut().for_each(|b| b.file.clear());
        m.dense.values_mut().for_each(String::clear);
        m
    };
    assert_eq!(unsharded(&got), unsharded(&want));
    assert!(!out.path().join(pw_format::PARTIAL_FILE).exists());
    let ck = Checkpoint::open(out.path()).unwrap();
    let reference = Checkpoint::open(whole.path()).unwrap();
    for b in &want.blocks {
        assert_eq!(ck.block(&b.name).unwrap(), reference.block(&b.name).unwrap(), "{}", b.name);
    }

    // Another calibration text is another run: nothing is kept.
    let other = calib_ids(96, 96, 5);
    let out2 = tempfile::tempdir().unwrap();
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        quantize_model::<Ad>(&dir, out2.path(), &ids, &cfg, &device, |p| {
            assert!(!(p.stage == Stage::Quantizing && p.done == stop), "interrupted");
        })
    }));
    let mut first_done = None;
    quantize_model::<Ad>(&dir, out2.path(), &other, &cfg, &device, |p| {
        if p.stage == Stage::Quantizing && first_done.is_none() {
            first_done = Some(p.done);
        }
    })
    .unwrap();
    assert_eq!(first_done, Some(1));
}

#[test]
fn fisher_is_the_sum_of_squared_gradients_and_nonzero_exactly_for_routed_experts() {
    let dir = fixture("qwen2_moe");
    let device = Default::default();
    let loaded = LoadedModel::<Ad>::load(&dir, None, &device).unwrap();
    let ids = calib_ids(24, 96, 5);
    let windows = token_windows(&ids, 8);
    let mut fisher = FisherPass::new(&loaded.banks);
    // Expected: Σ over windows of squared gradients, and which experts saw tokens.
    let mut want: Vec<Vec<(Vec<f64>, Vec<f64>)>> = loaded
        .banks
        .iter()
        .map(|b| {
            let (h, i) = (b.cfg.hidden, b.cfg.intermediate);
            vec![(vec![0.0; 2 * i * h], vec![0.0; h * i]); b.num_experts]
        })
        .collect();
    // Per bank and expert: chosen for some token, and chosen for a token whose output reaches
    // the loss (every position but a window's last, whose prediction has no target).
    let mut routed: Vec<Vec<bool>> = loaded.banks.iter().map(|b| vec![false; b.num_experts]).collect();
    let mut in_loss = routed.clone();
    let mut mass: Vec<Vec<f64>> = loaded.banks.iter().map(|b| vec![0.0; b.num_experts]).collect();
    let plain = LoadedModel::<Cpu>::load(&dir, None, &device).unwrap();
    for w in &windows {
        fisher.add_window(&loaded.model, &loaded.banks, w, &device);
        let (_, grads) = expert_gradients(&loaded.model, &loaded.banks, w, &device);
        for (bank, g) in want.iter_mut().zip(grads) {
            for ((gu, dn), g) in bank.iter_mut().zip(g) {
                if let Some(g) = g {
                    let (a, b) = g.to_rows();
                    gu.iter_mut().zip(a).for_each(|(s, x)| *s += (x as f64).powi(2));
                    dn.iter_mut().zip(b).for_each(|(s, x)| *s += (x as f64).powi(2));
                }
            }
        }
        let mut trace = Trace::default();
        let mut cache = plain.model.new_cache();
        plain.model.forward(pw_models::generate::ids_tensor::<Cpu>(w, &device), &mut cache, Some(&mut trace));
        let moe_routes = trace.routing.iter().flatten();
        for (((r, l), m), routing) in routed.iter_mut().zip(&mut in_loss).zip(&mut mass).zip(moe_routes) {
            let weights = routing.weights.clone().into_data().convert::<f64>().to_vec::<f64>().unwrap();
            for (slot, &e) in routing.indices.iter().enumerate() {
                r[e] = true;
                l[e] |= slot / routing.k + 1 < w.len();
                m[e] += weights[slot];
            }
        }
    }
    let imp = fisher.finish(&loaded.banks);
    assert_eq!(imp.len(), loaded.banks.len());
    for (l, (bank, want)) in imp.iter().zip(&want).enumerate() {
        for e in 0..bank.gate_up.len() {
            let nonzero = bank.gate_up[e].iter().chain(&bank.down[e]).any(|&x| x > 0.0);
            assert_eq!(
                nonzero, in_loss[l][e],
                "bank {l} expert {e}: importance nonzero iff it shaped the loss"
            );
            assert_eq!(bank.routed_windows[e] > 0, routed[l][e], "bank {l} expert {e}");
            let m = mass[l][e];
            assert!((bank.routing_mass[e] - m).abs() <= 1e-5 * m + 1e-9, "bank {l} expert {e} mass");
            let got = bank.gate_up[e].iter().chain(&bank.down[e]);
            for (got, want) in got.zip(want[e].0.iter().chain(&want[e].1)) {
                let ok = (*got as f64 - want).abs() <= 1e-5 * want.abs() + 1e-30;
                assert!(ok, "bank {l} expert {e}: {got} vs {want}");
            }
        }
    }
}

#[test]
fn never_routed_experts_quantize_with_zero_sensitivity() {
    // Two tokens: one prediction, at most top-k experts per layer see them.
    let dir = fixture("mixtral");
    let out = tempfile::tempdir().unwrap();
    let cfg = QuantizeConfig { ctx: 2, calib_tokens: 2, ..small_config() };
    let report =
        quantize_model::<Ad>(&dir, out.path(), &calib_ids(2, 96, 9), &cfg, &Default::default(), |_| {})
            .unwrap();
    let m = &report.manifest;
    // Mixtral fixture: 4 experts, top-2, 2 tokens in one window: per layer at most 4 routed
    // (token, slot) pairs; every layer where fewer than 4 distinct experts were chosen has
    // an expert with zero importance, hence zero sensitivity at every bit-width.
    let zero = m.blocks.iter().filter(|b| b.sensitivity.iter().all(|&s| s == 0.0)).count();
    let positive = m.blocks.iter().filter(|b| b.sensitivity[0] > 0.0).count();
    assert!(zero > 0 && positive > 0, "zero {zero}, positive {positive}");
    assert_eq!(zero + positive, m.blocks.len());
    // Their blocks are still real codebooks: 8-bit weights close to the original.
    let ck = Checkpoint::open(out.path()).unwrap();
    let b = m.blocks.iter().find(|b| b.sensitivity[0] == 0.0).unwrap();
    let block = ck.block(&b.name).unwrap();
    let deq = block.dequantize_reference(8);
    assert!(deq.iter().any(|&x| x != 0.0));
}

#[test]
fn bad_inputs_are_named() {
    let device = Default::default();
    let ids = calib_ids(64, 96, 2);
    let run = |dir: &Path, out: &Path, ids: &[u32], cfg: &QuantizeConfig| {
        quantize_model::<Ad>(dir, out, ids, cfg, &device, |_| {}).unwrap_err()
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");

    // A non-MoE model type.
    let llama = tmp.path().join("llama");
    std::fs::create_dir(&llama).unwrap();
    let cfg_text = std::fs::read_to_string(fixture("mixtral").join("config.json")).unwrap();
    std::fs::write(llama.join("config.json"), cfg_text.replace("\"mixtral\"", "\"llama\"")).unwrap();
    let e = run(&llama, &out, &ids, &small_config()).to_string();
    assert!(e.contains("config.json") && e.contains("model_type") && e.contains("llama"), "{e}");

    // Gemma-4 with its MoE block disabled: a dense model, nothing to quantize.
    let dense = tmp.path().join("dense");
    std::fs::create_dir(&dense).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("gemma4").join(f), dense.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dense.join("config.json")).unwrap()).unwrap();
    cfg["enable_moe_block"] = false.into();
    std::fs::write(dense.join("config.json"), cfg.to_string()).unwrap();
    let e = run(&dense, &out, &ids, &small_config());
    assert!(matches!(e, CalibError::NoExperts { .. }), "{e:?}");
    assert!(e.to_string().contains("dense") && e.to_string().contains("no MoE expert layers"), "{e}");
    let streamed = QuantizeConfig { importance: ImportanceMethod::Streamed, ..small_config() };
    let e = run(&dense, &out, &ids, &streamed);
    assert!(matches!(e, CalibError::NoExperts { .. }), "streamed: {e:?}");

    let mix = fixture("mixtral");
    let e = run(&mix, &out, &ids[..1], &small_config()).to_string();
    assert!(e.contains("1 tokens"), "{e}");
    let e = run(&mix, &out, &[1, 2, 500], &small_config()).to_string();
    assert!(e.contains("500") && e.contains("vocabulary of 96"), "{e}");
    let e = run(&mix, &out, &ids, &QuantizeConfig { min_bits: 2, ..small_config() }).to_string();
    assert!(e.contains("min_bits = 2"), "{e}");
    let e = run(&mix, &out, &ids, &QuantizeConfig { min_bits: 5, max_bits: 4, ..small_config() }).to_string();
    assert!(e.contains("max_bits = 4"), "{e}");
    let e = run(&mix, &mix, &ids, &small_config()).to_string();
    assert!(e.contains("is the model directory"), "{e}");

    // Quantizing a quantized checkpoint.
    let q = tmp.path().join("q");
    quantize_model::<Ad>(&mix, &q, &ids, &small_config(), &device, |_| {}).unwrap();
    let e = run(&q, &out, &ids, &small_config()).to_string();
    assert!(e.contains("already a quantized"), "{e}");
    // ...and asking a quantized checkpoint for a bit-width it does not store.
    let e = LoadedModel::<Cpu>::load(&q, Some(2), &device).unwrap_err().to_string();
    assert!(e.contains("bit-width 2") && e.contains("3..=8"), "{e}");
    let e = LoadedModel::<Cpu>::load(&mix, Some(4), &device).unwrap_err().to_string();
    assert!(e.contains("no pagedweight.json"), "{e}");
}
