//! The prefill half of `bench-kernels`: a block expanded to dense f16 by
//! [`kernels_cubecl::ap_dequantize`] and multiplied with Burn's own matmul, against Burn's
//! f16 matmul on an already dense weight (the bound: at most 1.3× its time).

use anyhow::Result;
use burn::tensor::{DType, Distribution, Shape, Tensor, TensorPrimitive};
use burn_cubecl::{CubeBackend, CubeRuntime, tensor::CubeTensor};
use half::f16;
use kernels_cubecl::{DeviceArray, PoolImage, ap_dequantize, sync};
use serde_json::{Value, json};

use crate::kernels::{gaussian_block, time_batches};

type B<R> = CubeBackend<R, f16, i32, u8>;

/// Prefill shapes `(model, block, rows, cols)`.
const PREFILL_SHAPES: [(&str, &str, usize, usize); 2] =
    [("mixtral", "w1", 14336, 4096), ("mixtral", "w2", 4096, 14336)];

/// Times dequantize + matmul and matmul alone for 64..4096 tokens.
pub(crate) fn prefill_records<R: CubeRuntime>(device: &R::Device, quick: bool) -> Result<Vec<Value>> {
    let client = R::client(device);
    let mut records = Vec::new();
    let shapes: &[_] = if quick { &[("tiny", "w", 256, 320)] } else { &PREFILL_SHAPES };
    let token_list: &[usize] = if quick { &[64] } else { &[64, 256, 1024, 4096] };
    for &(model, block_name, rows, cols) in shapes {
        let block = gaussian_block(rows, cols, 7)?;
        for bits in [3u8, 4, 8] {
            let mut pool = PoolImage::default();
            let slot = pool.push(&block, bits);
            let planes = DeviceArray::from_slice(&client, &pool.planes);
            let luts = DeviceArray::from_slice(&client, &pool.luts);
            let dense = DeviceArray::empty::<R, f16>(&client, rows * cols);
            ap_dequantize(&client, &planes, &luts, slot, &dense)?;
            let prim = CubeTensor::new_contiguous(
                client.clone(),
                device.clone(),
                Shape::new([rows, cols]),
                dense.handle.clone(),
                DType::F16,
            );
            let w = Tensor::<B<R>, 2>::from_primitive(TensorPrimitive::Float(prim));
            for &tokens in token_list {
                let x = Tensor::<B<R>, 2>::random([tokens, cols], Distribution::Uniform(-1.0, 1.0), device);
                // Autotune picks the matmul on the first calls of a shape.
                for _ in 0..3 {
                    let _ = x.clone().matmul(w.clone().transpose());
                }
                sync(&client)?;
                let launches = if quick { 2 } else { 10 };
                let fp16 = time_batches(&client, launches, |_| {
                    let _ = x.clone().matmul(w.clone().transpose());
                })?;
                let ours = time_batches(&client, launches, |_| {
                    ap_dequantize(&client, &planes, &luts, slot, &dense).expect("checked slot");
                    let _ = x.clone().matmul(w.clone().transpose());
                })?;
                let ratio = ours.device / fp16.device;
                eprintln!(
                    "prefill {model} {block_name} {rows}x{cols} t{tokens} b{bits}: {:.1} us vs f16 matmul {:.1} us ({ratio:.2}x)",
                    ours.device * 1e6,
                    fp16.device * 1e6
                );
                let (pb, lb) = block.bytes_at(bits);
                records.push(json!({"kernel": "prefill", "model": model, "block": block_name,
                    "shape": [rows, cols], "tokens": tokens, "bits": bits, "time_us": ours.device * 1e6,
                    "wall_us": ours.wall * 1e6, "fp16_time_us": fp16.device * 1e6, "ratio_to_fp16": ratio,
                    "effective_gbps": (pb + lb) as f64 / ours.device / 1e9}));
            }
        }
    }
    Ok(records)
}
