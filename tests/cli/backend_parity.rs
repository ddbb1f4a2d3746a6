//! GPU backends against the ndarray reference, layer by layer (`--features wgpu`; runs on any
//! Vulkan device, lavapipe included: `cargo test --features wgpu --test
//! cli backend_parity`). This is the test that caught Burn fusion's wrong MoE results.
#![cfg(feature = "wgpu")]

use std::path::Path;

use burn::tensor::{Tensor, TensorData, backend::Backend};
use pw_models::generate::ids_tensor;
use pw_models::{AnyModel, CausalLm, Trace};
use pw_nn::{AttentionConfig, GatedMlpConfig, KvCache, RandomInit, Rope, RouterConfig, WeightSource};

type Cpu = burn_ndarray::NdArray<f32>;
type Gpu = burn_wgpu::Wgpu;

/// f32 on both sides; only reduction order differs.
const TOL: f32 = 1e-4;

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

fn diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn input<B: Backend, const D: usize>(shape: [usize; D], dev: &B::Device) -> Tensor<B, D> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    Tensor::from_data(TensorData::new(v, shape), dev)
}

fn attention(window: Option<usize>, k_eq_v: bool, n_kv: usize) -> AttentionConfig {
    AttentionConfig {
        hidden: 16,
        n_heads: 4,
        n_kv_heads: n_kv,
        head_dim: 8,
        qkv_bias: false,
        qk_norm: k_eq_v,
        v_norm: k_eq_v,
        k_eq_v,
        scale: None,
        sliding_window: window,
        norm_eps: 1e-6,
        inv_freq: Rope::new(vec![1.0, 0.3, 0.1, 0.01]).inv_freq,
    }
}

#[test]
fn layers_agree() {
    let (dc, dg) = (Default::default(), Default::default());
    let (sc, sg) = (RandomInit::<Cpu>::new(&dc, 5, 0.3), RandomInit::<Gpu>::new(&dg, 5, 0.3));

    let lc = pw_nn::Linear::load(&sc, "l", 16, 24, true).unwrap();
    let lg = pw_nn::Linear::load(&sg, "l", 16, 24, true).unwrap();
    let e = diff(
        &host(lc.forward(input::<Cpu, 3>([1, 5, 16], &dc))),
        &host(lg.forward(input::<Gpu, 3>([1, 5, 16], &dg))),
    );
    eprintln!("linear {e:e}");

    let rope = Rope::new(vec![1.0, 0.3, 0.1, 0.01]);
    let e = diff(
        &host(rope.apply(input::<Cpu, 4>([1, 2, 5, 8], &dc), 3)),
        &host(rope.apply(input::<Gpu, 4>([1, 2, 5, 8], &dg), 3)),
    );
    eprintln!("rope {e:e}");

    for (w, kv, n_kv) in [(None, false, 4), (None, false, 2), (Some(3), true, 2)] {
        let ac = attention(w, kv, n_kv).load(&sc, "a").unwrap();
        let ag = attention(w, kv, n_kv).load(&sg, "a").unwrap();
        let e = diff(
            &host(ac.forward(input::<Cpu, 3>([1, 6, 16], &dc), &mut KvCache::new())),
            &host(ag.forward(input::<Gpu, 3>([1, 6, 16], &dg), &mut KvCache::new())),
        );
        eprintln!("attention window {w:?} k_eq_v {kv} n_kv {n_kv}: {e:e}");
    }

    let rc = RouterConfig {
        hidden: 16,
        num_experts: 6,
        top_k: 2,
        renormalize: true,
        gemma_scaling: false,
        norm_eps: 1e-6,
    };
    let (routc, routg) = (rc.load(&sc, "r").unwrap(), rc.load(&sg, "r").unwrap());
    let (xc, xg) = (input::<Cpu, 2>([7, 16], &dc), input::<Gpu, 2>([7, 16], &dg));
    let (rtc, rtg) = (routc.forward(xc.clone()), routg.forward(xg.clone()));
    eprintln!("router idx cpu {:?} gpu {:?}", rtc.indices, rtg.indices);
    eprintln!("router weights {:e}", diff(&host(rtc.weights.clone()), &host(rtg.weights.clone())));

    let cfg = GatedMlpConfig { hidden: 16, intermediate: 8, act: pw_nn::Act::Silu };
    let keys = pw_nn::ExpertKeys { fused: vec!["x".into()], per_expert: vec![] };
    let (ec, eg) = (sc.experts(&keys, 6, cfg).unwrap(), sg.experts(&keys, 6, cfg).unwrap());
    let e = diff(&host(ec.forward(xc, &rtc)), &host(eg.forward(xg, &rtg)));
    eprintln!("experts {e:e}");
}

#[test]
fn qwen2_moe_hidden_states_agree() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/pw-models/tests/fixtures/qwen2_moe");
    let (dc, dg) = (Default::default(), Default::default());
    let mc = AnyModel::<Cpu>::load(&dir, &dc).unwrap();
    let mg = AnyModel::<Gpu>::load(&dir, &dg).unwrap();
    let ids: Vec<u32> = (3..15).collect();
    let (mut tc, mut tg) = (Trace::default(), Trace::default());
    let lc = mc.forward(ids_tensor::<Cpu>(&ids, &dc), &mut mc.new_cache(), Some(&mut tc));
    let lg = mg.forward(ids_tensor::<Gpu>(&ids, &dg), &mut mg.new_cache(), Some(&mut tg));
    for (i, (a, b)) in tc.hidden.iter().zip(&tg.hidden).enumerate() {
        eprintln!("hidden {i}: {:e}", diff(&host(a.clone()), &host(b.clone())));
    }
    let e = diff(&host(lc), &host(lg));
    eprintln!("logits {e:e}");
    assert!(e < TOL);
}
