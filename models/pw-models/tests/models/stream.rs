//! The layer-at-a-time pass against the whole model's forward.

use burn::tensor::{Int, Tensor, TensorData};
use burn_ndarray::NdArray;
use pw_hf::{Checkpoint, ModelConfig};
use pw_models::{AnyModel, CausalLm, LayerStream, Trace};
use pw_nn::KvCache;
use pw_testkit::fixture;

type B = NdArray<f32>;

fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// Two sequences of 12 tokens through the model, then layer by layer through the stream: the
/// same hidden state after every layer, the same router choices, and an expert bank exactly
/// where the model routes.
fn check_stream(name: &str) {
    let device = Default::default();
    let dir = fixture(name);
    let model = AnyModel::<B>::load(&dir, &device).unwrap();
    let vocab = model.vocab_size();
    let ids: Vec<i64> = (0..24).map(|i| ((i * 7919 + 13) % vocab) as i64).collect();
    let ids = || Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [2, 12]), &device);
    let mut trace = Trace::default();
    model.forward(ids(), &mut model.new_cache(), Some(&mut trace));

    let ckpt = Checkpoint::open(&dir).unwrap();
    let stream = LayerStream::<B>::new(ModelConfig::from_dir(&dir).unwrap(), &ckpt, &device);
    assert_eq!(stream.num_layers() + 1, trace.hidden.len(), "{name}");
    let mut h = stream.embed(vec![ids()]).unwrap().remove(0);
    // Same operations in the same order: only the embedding gather could differ, and it does not.
    assert_eq!(host(h.clone()), host(trace.hidden[0].clone()), "{name}: embedding");
    for l in 0..stream.num_layers() {
        let (layer, bank) = stream.layer(l).unwrap();
        let (next, tap) = layer.forward(h, &mut KvCache::new());
        h = next;
        assert_eq!(host(h.clone()), host(trace.hidden[l + 1].clone()), "{name}: layer {l}");
        match (&trace.routing[l], tap, bank) {
            (Some(r), Some(tap), Some(bank)) => {
                assert_eq!(tap.routing.indices, r.indices, "{name}: layer {l} choices");
                assert_eq!(tap.input.dims()[0], 24, "{name}: layer {l} tap");
                assert_eq!(bank.layer, l, "{name}: layer {l} bank");
            }
            (None, None, None) => {}
            (r, tap, bank) => panic!(
                "{name}: layer {l}: routing {} tap {} bank {}",
                r.is_some(),
                tap.is_some(),
                bank.is_some()
            ),
        }
    }
}

#[test]
fn streamed_layers_match_the_whole_model() {
    for name in ["mixtral", "mixtral_fused", "qwen2_moe", "gemma4", "gemma4_mm"] {
        check_stream(name);
    }
}
