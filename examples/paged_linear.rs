//! Swapping a Burn `Linear` for a `PagedLinear` in your own model.
//!
//! `cargo run --release --example paged_linear`
//!
//! A small two-layer MLP is built with Burn's `Linear`; its second layer is
//! replaced by a `PagedLinear` quantized from the same weights, and the output
//! error and device bytes are printed at every bit-width.

use anyhow::Result;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_ndarray::NdArray;
use pw_linear::PagedLinear;

/// The user's model, generic over the second layer.
#[derive(Module, Debug)]
struct Mlp<B: Backend, L: Module<B>> {
    up: Linear<B>,
    act: Relu,
    down: L,
}

fn main() -> Result<()> {
    type B = NdArray;
    let device = Default::default();
    let (hidden, inner) = (256, 1024);
    let up = LinearConfig::new(hidden, inner).init::<B>(&device);
    let down = LinearConfig::new(inner, hidden).init::<B>(&device);
    let x = Tensor::<B, 2>::random([4, hidden], Distribution::Normal(0.0, 1.0), &device);

    let dense = Mlp { up: up.clone(), act: Relu::new(), down: down.clone() };
    let reference = dense.down.forward(dense.act.forward(dense.up.forward(x.clone())));

    // The swap: same weights, quantized once to the nested 3..8-bit format.
    let mut paged = Mlp { up, act: Relu::new(), down: PagedLinear::from_linear(&down, 8)? };
    let f16_bytes = inner * hidden * 2;
    println!("bits  rel_err   device bytes (f16: {f16_bytes})");
    for bits in (3..=8).rev() {
        paged.down.set_bits(bits)?;
        let y = paged.down.forward(paged.act.forward(paged.up.forward(x.clone())));
        let err: f32 = (y - reference.clone()).powf_scalar(2.0).sum().sqrt().into_scalar();
        let norm: f32 = reference.clone().powf_scalar(2.0).sum().sqrt().into_scalar();
        println!("{bits:>4}  {:.5}   {}", err / norm, paged.down.device_bytes());
    }
    Ok(())
}
