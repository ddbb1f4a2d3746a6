//! The fast decode path against the Burn-ops model (`pw-models`, the reference) on the shipped
//! tiny Mixtral, with the same any-precision experts in both: continuous batches of sequences
//! that join at different steps, prompts fed token by token, every step's logits compared with
//! a full recomputation of each sequence.

use std::path::{Path, PathBuf};

use burn_ndarray::NdArray;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use pw_decode::{DecodeConfig, ExpertBlocks, MixtralDecoder};
use pw_hf::{Checkpoint, ModelConfig};
use pw_models::generate::{argmax, ids_tensor, last_logits};
use pw_models::{CausalLm, HfSource, Mixtral};
use pw_nn::{LoadError, WeightSource};

type B = NdArray<f32>;

/// f32 KV cache: only the summation order differs from the reference.
const F32_KV_TOL: f32 = 2e-4;
/// f16 KV cache (as on the GPU): K/V rounded to 11 significant bits.
const F16_KV_TOL: f32 = 5e-3;

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-mixtral")
}

/// The HF checkpoint with every expert replaced by its dequantized any-precision block.
struct Dequantized<'a> {
    inner: HfSource<'a, B>,
    experts: &'a ExpertBlocks,
    inter: usize,
}

impl WeightSource<B> for Dequantized<'_> {
    fn device(&self) -> burn_ndarray::NdArrayDevice {
        self.inner.device()
    }
    fn has(&self, name: &str) -> bool {
        self.inner.has(name)
    }
    fn read(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, LoadError> {
        let parts: Vec<&str> = name.split('.').collect();
        if let ["model", "layers", l, "block_sparse_moe", "experts", e, w, "weight"] = parts[..] {
            let (l, e): (usize, usize) = (l.parse().unwrap(), e.parse().unwrap());
            let (gu, dn) = &self.experts.blocks[l][e];
            let (bg, bd) = self.experts.bits[l][e];
            let n = self.inter * gu.cols;
            return Ok(match w {
                "w1" => gu.dequantize_reference(bg)[..n].to_vec(),
                "w3" => gu.dequantize_reference(bg)[n..].to_vec(),
                _ => dn.dequantize_reference(bd),
            });
        }
        self.inner.read(name, expected)
    }
}

fn check(kv_f16: bool, tol: f32) {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: set once before any thread reads the environment.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    let dir = model_dir();
    let ModelConfig::Mixtral(mc) = ModelConfig::from_dir(&dir).unwrap() else { panic!("not mixtral") };
    let ckpt = Checkpoint::open(&dir).unwrap();
    // The decoder's own view of the shapes, used to quantize the experts.
    let cfg = DecodeConfig::from_mixtral(&mc);
    // Mixed committed bits, as the planner leaves them: 8, 6, 4 and 3 bits across experts.
    let mut experts = ExpertBlocks::quantize_hf(&ckpt, &cfg, 8).unwrap();
    for (l, layer) in experts.bits.iter_mut().enumerate() {
        for (e, b) in layer.iter_mut().enumerate() {
            let bits = [8u8, 6, 4, 3][(l + e) % 4];
            *b = (bits, bits.max(4));
        }
    }
    let device = Default::default();
    let reference = Mixtral::<B>::load(
        &mc,
        &Dequantized { inner: HfSource::new(&ckpt, &device), experts: &experts, inter: cfg.inter },
    )
    .unwrap();

    let client = cubecl::Runtime::client(&WgpuDevice::DefaultDevice);
    let mut fast = if kv_f16 {
        Box::new(Run::<half::f16>(MixtralDecoder::load(&client, &dir, &experts, 12, 4, 64).unwrap()))
            as Box<dyn Step>
    } else {
        Box::new(Run::<f32>(MixtralDecoder::load(&client, &dir, &experts, 12, 4, 64).unwrap()))
    };

    // Sequence id → (prompt, tokens so far); sequence 3 joins at step 4, sequence 1 leaves after step 7.
    let prompts: [(u64, Vec<u32>, usize); 3] = [
        (1, vec![1, 499, 300, 12, 77], 0),
        (2, vec![1, 90, 91, 92, 93, 94, 95, 96, 97], 0),
        (3, vec![1, 4000, 5], 4),
    ];
    let mut seqs: Vec<(u64, Vec<u32>, Vec<u32>)> = vec![];
    for step in 0..12 {
        for (id, p, start) in &prompts {
            if *start == step {
                fast.add(*id);
                seqs.push((*id, p.clone(), vec![]));
            }
        }
        if step == 8 {
            fast.free(1);
            seqs.retain(|s| s.0 != 1);
        }
        // Next token of each sequence: its prompt first, then its own greedy choice.
        let batch: Vec<(u64, u32)> = seqs
            .iter()
            .map(|(id, p, fed)| (*id, if fed.len() < p.len() { p[fed.len()] } else { *fed.last().unwrap() }))
            .collect();
        let got = fast.step(&batch);
        for ((_, p, fed), ((id, tok), logits)) in seqs.iter_mut().zip(batch.iter().zip(&got)) {
            let mut next = fed.clone();
            if next.len() < p.len() {
                next.push(*tok);
            }
            let all: Vec<u32> = if fed.len() < p.len() { next.clone() } else { fed.clone() };
            let want = last_logits(reference.forward(
                ids_tensor::<B>(&all, &device),
                &mut reference.new_cache(),
                None,
            ));
            let scale = want.iter().fold(1f32, |m, x| m.max(x.abs()));
            let err = logits.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
            assert!(err <= tol, "step {step} seq {id}: logits error {err:e} > {tol:e}");
            assert_eq!(argmax(logits), argmax(&want), "step {step} seq {id}: greedy choice differs");
            if fed.len() < p.len() {
                *fed = next;
            }
            if fed.len() >= p.len() {
                fed.push(argmax(logits));
            }
        }
    }
    assert_eq!(fast.used_blocks(), 2 + 3, "sequences 2 (21 tokens) and 3 (8 tokens) hold their blocks");
}

trait Step {
    fn add(&mut self, id: u64);
    fn free(&mut self, id: u64);
    fn step(&mut self, batch: &[(u64, u32)]) -> Vec<Vec<f32>>;
    fn used_blocks(&self) -> usize;
}

struct Run<KV: cubecl::prelude::Float + cubecl::prelude::CubeElement>(MixtralDecoder<WgpuRuntime, KV>);

impl<KV: cubecl::prelude::Float + cubecl::prelude::CubeElement> Step for Run<KV> {
    fn add(&mut self, id: u64) {
        self.0.add_sequence(id).unwrap()
    }
    fn free(&mut self, id: u64) {
        self.0.free_sequence(id).unwrap()
    }
    fn step(&mut self, batch: &[(u64, u32)]) -> Vec<Vec<f32>> {
        self.0.step(batch).unwrap()
    }
    fn used_blocks(&self) -> usize {
        self.0.kv_tables().used_blocks()
    }
}

#[test]
fn fast_decode_matches_burn_model_f32_cache() {
    check(false, F32_KV_TOL);
}

#[test]
fn fast_decode_matches_burn_model_f16_cache() {
    check(true, F16_KV_TOL);
}
