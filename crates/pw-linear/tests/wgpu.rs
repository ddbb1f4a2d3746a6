//! `PagedLinear` and `PagedExperts` on Burn's wgpu backend (the CubeCL kernels; Mesa lavapipe
//! in CI) against the CPU reference.

use burn::tensor::{Distribution, Tensor, TensorData, backend::Backend};
use burn_ndarray::NdArray;
use burn_wgpu::{Wgpu, WgpuDevice};
use pw_format::{ApBlock, BlockKind};
use pw_linear::{Accountant, PageKey, PageTable, PagedExperts, PagedLinear, arena_size_at};
use pw_nn::{Act, ExpertBank, GatedMlpConfig, Routing};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type Gpu = Wgpu;
type Cpu = NdArray<f32>;

/// f32 accumulation in another order than the reference, relative to the largest output.
const KERNEL_RTOL: f32 = 1e-4;

fn device() -> WgpuDevice {
    WgpuDevice::DefaultDevice
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

fn random(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn block(rng: &mut StdRng, name: &str, rows: usize, cols: usize) -> ApBlock {
    ApBlock::quantize(name, &random(rng, rows * cols), None, rows, cols, 3, 8).unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())) + 1e-6;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= KERNEL_RTOL * scale, "{what}: y[{i}] = {g}, reference {w} (scale {scale})");
    }
}

#[test]
fn paged_linear_cubecl_matches_reference() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(5);
    // Odd K and N; token counts below, at and above one work item (16).
    for (rows, cols) in [(33, 70), (48, 97)] {
        let b = block(&mut rng, "w", rows, cols);
        let mut paged = PagedLinear::<Gpu>::from_block(b.clone(), None, 8, &dev).unwrap();
        assert_eq!(paged.table().device_kind(), "wgpu");
        assert!(paged.table().runs_kernels::<Gpu>(&dev), "Burn's wgpu tensors take the kernel path");
        for tokens in [1, 5, 16, 19] {
            let xv = random(&mut rng, tokens * cols);
            let x = Tensor::<Gpu, 2>::from_data(TensorData::new(xv.clone(), [tokens, cols]), &dev);
            for bits in 3..=8 {
                paged.set_bits(bits).unwrap();
                assert_eq!(paged.bits(), bits);
                let y = host(paged.forward(x.clone()));
                let want = b.matmul_reference(bits, &xv, tokens);
                assert_close(&y, &want, &format!("[{rows}x{cols}] {tokens} tokens {bits} bits"));
            }
        }
    }
}

#[test]
fn paged_linear_with_bias_and_batch_dims_on_wgpu() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(6);
    let b = block(&mut rng, "w", 20, 40);
    let bias: Vec<f32> = random(&mut rng, 20);
    let bias_t = Tensor::<Gpu, 1>::from_data(TensorData::new(bias.clone(), [20]), &dev);
    let paged = PagedLinear::<Gpu>::from_block(b.clone(), Some(bias_t), 5, &dev).unwrap();
    let x = Tensor::<Gpu, 3>::random([2, 3, 40], Distribution::Uniform(-1.0, 1.0), &dev);
    let xv = host(x.clone());
    let y = host(paged.forward(x));
    let mut want = b.matmul_reference(5, &xv, 6);
    for (i, w) in want.iter_mut().enumerate() {
        *w += bias[i % 20];
    }
    assert_close(&y, &want, "bias, [2, 3, 40]");
}

const H: usize = 24;
const I: usize = 40;
const E: usize = 5;

fn bank_blocks(rng: &mut StdRng) -> Vec<(String, PageKey, ApBlock)> {
    let mut out = Vec::new();
    for e in 0..E {
        for (kind, r, c) in [(BlockKind::GateUp, 2 * I, H), (BlockKind::Down, H, I)] {
            let name = format!("l0.{e}.{kind:?}");
            out.push((name.clone(), PageKey { layer: 0, expert: e, kind }, block(rng, &name, r, c)));
        }
    }
    out
}

fn bank<B: Backend>(
    blocks: &[(String, PageKey, ApBlock)],
    act: Act,
    bits: &[u8],
    dev: &B::Device,
) -> PagedExperts<B> {
    let arena = arena_size_at(blocks.iter().map(|b| &b.2), 8);
    let table =
        PageTable::new(blocks.to_vec(), Accountant::new(u64::MAX / 2), (arena.0, 2 * arena.1), dev).unwrap();
    for (i, (_, key, _)) in blocks.iter().enumerate() {
        table.set_desired(table.page(*key).unwrap(), bits[i % bits.len()]).unwrap();
    }
    table.settle().unwrap();
    table.audit().unwrap();
    let ids = |k: BlockKind| {
        (0..E).map(|e| table.page(PageKey { layer: 0, expert: e, kind: k }).unwrap()).collect()
    };
    let cfg = GatedMlpConfig { hidden: H, intermediate: I, act };
    PagedExperts::new(table.clone(), ids(BlockKind::GateUp), ids(BlockKind::Down), cfg).unwrap()
}

fn routing<B: Backend>(indices: Vec<usize>, weights: Vec<f32>, k: usize, dev: &B::Device) -> Routing<B> {
    let t = indices.len() / k;
    Routing {
        indices,
        weights: Tensor::from_data(TensorData::new(weights, [t, k]), dev),
        probs: Tensor::zeros([t, E], dev),
        k,
    }
}

/// Mixed bit-widths in one grouped launch, both activations, an expert with more than one work
/// item of tokens and experts with none: the wgpu kernels against the CPU reference of the
/// same configuration.
#[test]
fn paged_experts_mixed_bits_match_the_cpu_reference() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(9);
    let blocks = bank_blocks(&mut rng);
    let bits = [3u8, 8, 5, 4, 7, 6, 8];
    let (t, k) = (21, 2);
    // Expert 1 gets every token (21 rows: two work items), expert 4 none.
    let indices: Vec<usize> = (0..t).flat_map(|i| [1, [0, 2, 3][i % 3]]).collect();
    let weights = random(&mut rng, t * k);
    let xv = random(&mut rng, t * H);
    for act in [Act::Silu, Act::GeluTanh] {
        let gpu = bank::<Gpu>(&blocks, act, &bits, &dev);
        let cpu = bank::<Cpu>(&blocks, act, &bits, &Default::default());
        assert_eq!(cpu.table().device_kind(), "host");
        assert!(
            gpu.table().runs_kernels::<Gpu>(&dev) && !cpu.table().runs_kernels::<Cpu>(&Default::default())
        );
        assert_eq!(gpu.table().committed_bits(), cpu.table().committed_bits());
        let y = host(ExpertBank::forward(
            &gpu,
            Tensor::from_data(TensorData::new(xv.clone(), [t, H]), &dev),
            &routing(indices.clone(), weights.clone(), k, &dev),
        ));
        let cdev = Default::default();
        let want = host(ExpertBank::forward(
            &cpu,
            Tensor::<Cpu, 2>::from_data(TensorData::new(xv.clone(), [t, H]), &cdev),
            &routing(indices.clone(), weights.clone(), k, &cdev),
        ));
        assert_close(&y, &want, &format!("{act:?}"));
        // An expert's view is the same page: its forward through the single-block path agrees
        // with the parent at the committed bits.
        let view = &gpu.expert(2).gate_up;
        let xs = random(&mut rng, 3 * H);
        let yv = host(view.forward(Tensor::<Gpu, 2>::from_data(TensorData::new(xs.clone(), [3, H]), &dev)));
        assert_close(&yv, &view.block().matmul_reference(view.bits(), &xs, 3), "view");
    }
}

/// Lowering and raising pages between forwards (the boundary API) changes the outputs and
/// restores them bit for bit.
#[test]
fn boundary_lowering_then_raising_restores_outputs() {
    let dev = device();
    let mut rng = StdRng::seed_from_u64(10);
    let blocks = bank_blocks(&mut rng);
    let gpu = bank::<Gpu>(&blocks, Act::Silu, &[8], &dev);
    let (t, k) = (4, 2);
    let indices: Vec<usize> = (0..t).flat_map(|i| [i % E, (i + 2) % E]).collect();
    let r = routing::<Gpu>(indices, random(&mut rng, t * k), k, &dev);
    let x = Tensor::<Gpu, 2>::from_data(TensorData::new(random(&mut rng, t * H), [t, H]), &dev);
    let y8 = host(ExpertBank::forward(&gpu, x.clone(), &r));
    let table = gpu.table();
    let full = table.usage().weights;
    table.set_desired_all(3);
    let rep = table.boundary().unwrap();
    assert_eq!(rep.lowered.len(), 2 * E);
    assert!(table.usage().weights < full / 2, "3-bit pages hold under half the 8-bit bytes");
    let y3 = host(ExpertBank::forward(&gpu, x.clone(), &r));
    assert_ne!(y3, y8);
    table.set_desired_all(8);
    table.settle().unwrap();
    table.audit().unwrap();
    let back = host(ExpertBank::forward(&gpu, x, &r));
    assert!(back.iter().zip(&y8).all(|(a, b)| a.to_bits() == b.to_bits()), "8 → 3 → 8 changed outputs");
}
