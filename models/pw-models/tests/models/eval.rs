//! The perplexity convention: windows, positions, batching, f64 totals.

use burn::tensor::Tensor;
use burn_ndarray::NdArray;
use pw_models::eval::{Perplexity, perplexity, token_nll, token_windows};
use pw_models::generate::ids_tensor;
use pw_models::{AnyModel, CausalLm};
use pw_testkit::fixture;

type B = NdArray<f32>;

/// Batched vs one-window forwards: same arithmetic up to summation order.
const BATCH_RTOL: f64 = 1e-6;
/// Our NLL vs a host log-softmax in f64 from the logits: f32 log-softmax rounding.
const NLL_RTOL: f64 = 1e-5;

fn ids(n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + 11) % 96) as u32).collect()
}

#[test]
fn windows_are_disjoint_and_keep_a_last_partial_of_two_or_more() {
    let v = ids(10);
    let w = token_windows(&v, 4);
    assert_eq!(w.iter().map(|w| w.len()).collect::<Vec<_>>(), [4, 4, 2]);
    assert_eq!(w.concat(), v);
    // A last window of one token predicts nothing and is dropped.
    assert_eq!(token_windows(&ids(9), 4).iter().map(|w| w.len()).collect::<Vec<_>>(), [4, 4]);
    assert!(token_windows(&ids(1), 4).is_empty());
}

/// Per-window NLL from full logits, with the log-softmax done on the host in f64.
fn host_nll(model: &AnyModel<B>, window: &[u32]) -> f64 {
    let device = Default::default();
    let mut cache = model.new_cache();
    let logits = model.forward(ids_tensor::<B>(window, &device), &mut cache, None);
    let [_, t, v] = logits.dims();
    let l = logits.into_data().to_vec::<f32>().unwrap();
    (0..t - 1)
        .map(|p| {
            let row = &l[p * v..(p + 1) * v];
            let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            lse - row[window[p + 1] as usize] as f64
        })
        .sum()
}

#[test]
fn perplexity_follows_the_convention_for_every_family_and_batch_size() {
    let device = Default::default();
    for name in ["mixtral", "qwen2_moe", "gemma4"] {
        let model = AnyModel::<B>::load(fixture(name), &device).unwrap();
        let v = ids(43);
        // Windows of 8: five full ones and a partial of 3 (predicting 2 tokens).
        let want_nll: f64 = token_windows(&v, 8).iter().map(|w| host_nll(&model, w)).sum();
        let want = Perplexity { nll: want_nll, tokens: 5 * 7 + 2 };
        for batch in [1, 2, 4, 16] {
            let mut calls = Vec::new();
            let got = perplexity(&model, &v, 8, batch, &device, |n| calls.push(n));
            assert_eq!(got.tokens, want.tokens, "{name} batch {batch}");
            assert_eq!(calls.iter().sum::<usize>(), 6, "{name} batch {batch}");
            assert!(calls.iter().all(|&n| n <= batch));
            let rel = (got.nll - want.nll).abs() / want.nll;
            let tol = if batch == 1 { NLL_RTOL } else { NLL_RTOL + BATCH_RTOL };
            assert!(rel <= tol, "{name} batch {batch}: nll {} vs {} ({rel:e})", got.nll, want.nll);
            assert!((got.ppl() - (want.nll / 37.0).exp()).abs() / got.ppl() < 1e-4);
        }
        // Position j of the NLL is the prediction of token j + 1.
        let w = &v[..5];
        let nll: Tensor<B, 2> = token_nll(&model, &[w], &device);
        assert_eq!(nll.dims(), [1, 4]);
    }
}
