//! Issue 28: the Burn reference path (the CPU fallback) serves a PagedWeight checkpoint with its
//! experts as pages under one budget with the KV cache, managed by the planner as on the fast path.

use std::path::Path;

use burn_ndarray::NdArray;
use pw_models::{AnyModel, LoadedModel};
use pw_serve::{BurnStepModel, Engine, MemoryOptions, PageTableView, StepModel, UsageRecorder, WeightPolicy};

use crate::common;
use crate::fast::{alone, mixed_requests, pressure_config, submit_all};

type B = NdArray<f32>;

/// What `pagedweight quantize` writes for the test fixture `name` (layer-streamed importance
/// on a short calibration text), with a word tokenizer, in a temporary directory.
fn pw_checkpoint(name: &str) -> tempfile::TempDir {
    use pw_calib::{ImportanceMethod, QuantizeConfig, quantize_model};
    type Ad = burn::backend::Autodiff<B>;
    let src = pw_testkit::fixture(name);
    let vocab = pw_hf::ModelConfig::from_dir(&src).unwrap().vocab_size();
    let ids: Vec<u32> = (0..96u32).map(|i| 3 + (i * 37) % (vocab as u32 - 3)).collect();
    let cfg = QuantizeConfig {
        ctx: 16,
        calib_tokens: 96,
        importance: ImportanceMethod::Streamed,
        ..Default::default()
    };
    let out = tempfile::tempdir().unwrap();
    quantize_model::<Ad>(&src, out.path(), &ids, &cfg, &Default::default(), |_| {}).unwrap();
    pw_testkit::write_word_tokenizer(out.path(), vocab);
    out
}

/// Expert bytes of the checkpoint in `dir` with every page at `bits`, and the bytes of one KV
/// block of 16 tokens in f32.
fn sizes(dir: &Path, bits: u8) -> (u64, u64) {
    let ckpt = pw_format::Checkpoint::open(dir).unwrap();
    let experts = ckpt
        .manifest()
        .blocks
        .iter()
        .map(|b| {
            let (p, l) = b.bytes_at(bits);
            (p + l) as u64
        })
        .sum();
    let kv = pw_serve::KvLayout::from_config(&pw_hf::ModelConfig::from_dir(dir).unwrap(), 4);
    (experts, 16 * kv.bytes_per_token())
}

/// Serves the PagedWeight checkpoint in `dir` with paged experts at 8 bits and no budget, and
/// checks that the first `requests` of the mixed requests get the tokens of the same checkpoint
/// dequantized at 8 bits into a plain Burn model, with every page committed at 8 bits; returns
/// the page-table view.
fn paged_at_8_bits_match_the_dequantized_model(dir: &Path, requests: usize, what: &str) -> PageTableView {
    let memory = MemoryOptions { policy: WeightPolicy::Pinned, ..Default::default() };
    let (mut paged, _) =
        BurnStepModel::<B, AnyModel<B>>::load_paged(dir, &Default::default(), 8, &memory, 4, 1 << 20)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    let loaded = LoadedModel::<B>::load(dir, Some(8), &Default::default()).unwrap();
    let kv = paged.kv_layout().clone();
    let mut dense = BurnStepModel::<B, AnyModel<B>>::new(loaded.model, Default::default(), kv, 0);
    for (i, (p, n)) in mixed_requests(paged.vocab_size() as u32).iter().take(requests).enumerate() {
        let seq = i as u64;
        assert_eq!(alone(&mut paged, seq, p, *n), alone(&mut dense, seq, p, *n), "{what}, request {i}");
    }
    let v = paged.page_table().unwrap().expect("paged experts have a page table");
    assert!(!v.pages.is_empty() && v.pages.iter().all(|p| p.committed_bits == 8), "{what}");
    v
}

/// Without a budget the paged experts stay at 8 bits and generate the tokens of the same
/// checkpoint dequantized at 8 bits into a plain Burn model; the page table is in the view.
#[test]
fn paged_experts_at_8_bits_generate_what_the_dequantized_model_does() {
    let pw = pw_checkpoint("mixtral");
    let v = paged_at_8_bits_match_the_dequantized_model(pw.path(), 4, "mixtral");
    assert_eq!((v.policy, v.mean_bits), ("pinned", 8.0));
    assert_eq!(v.expert_bytes, sizes(pw.path(), 8).0);
}

/// A Hugging Face directory's experts quantized at load (`pw_decode::write_quantized_hf`, what
/// `serve --device cpu --memory-gb` does) load as pages on the reference path for every family
/// and expert layout (per-expert and fused tensors) and generate, at 8 bits, the tokens of the
/// same checkpoint dequantized into a plain Burn model.
#[test]
fn experts_quantized_at_load_serve_as_pages_for_every_family() {
    for name in ["mixtral", "mixtral_fused", "qwen2_moe", "gemma4"] {
        let out = tempfile::tempdir().unwrap();
        pw_decode::write_quantized_hf(&pw_testkit::fixture(name), out.path()).unwrap();
        paged_at_8_bits_match_the_dequantized_model(out.path(), 2, name);
    }
}

/// 32 concurrent requests with the experts and the KV cache under one budget that holds the
/// 8-bit experts beside 16 KV blocks: the planner lowers pages while they run, every request
/// completes with all its tokens, none fails, and the cache is empty afterwards.
fn thirty_two_requests_with_paged_experts(name: &str) {
    let pw = pw_checkpoint(name);
    let (experts8, block) = sizes(pw.path(), 8);
    let memory = MemoryOptions {
        budget_bytes: Some(experts8 + 16 * block),
        policy: WeightPolicy::Planner,
        threshold_blocks: 4,
        give_back_blocks: 8,
        ..Default::default()
    };
    let (model, kv_capacity) =
        BurnStepModel::<B, AnyModel<B>>::load_paged(pw.path(), &Default::default(), 8, &memory, 16, 0)
            .unwrap();
    let requests = mixed_requests(model.vocab_size() as u32);
    let tok = pw_serve::load_tokenizer(pw.path()).unwrap();
    let engine = Engine::start(
        Box::new(model),
        std::sync::Arc::new(tok),
        pressure_config(kv_capacity),
        Box::new(UsageRecorder::default()),
    )
    .unwrap();
    let h = engine.handle();
    for (i, (s, (_, n))) in submit_all(&h, &requests).into_iter().zip(&requests).enumerate() {
        assert_eq!(s.collect_blocking().unwrap().tokens.len(), *n, "request {i}");
    }
    common::all_served_after_lowering(&h, 32);
    let v = h.blocking_page_table().unwrap().expect("paged experts have a page table");
    assert_eq!((v.policy, v.kv_blocks_used), ("planner", 0));
    assert_eq!(v.pages.iter().map(|p| p.bytes).sum::<u64>(), v.expert_bytes);
}

#[test]
fn thirty_two_mixtral_requests_with_paged_experts_on_the_reference_path_all_complete() {
    thirty_two_requests_with_paged_experts("mixtral");
}

#[test]
fn thirty_two_qwen2_moe_requests_with_paged_experts_on_the_reference_path_all_complete() {
    thirty_two_requests_with_paged_experts("qwen2_moe");
}
