//! The page table over a CubeCL device pool, with the grouped kernel reading
//! it (wgpu; Mesa lavapipe in CI).

use crate::common::*;
use cubecl::prelude::*;
use cubecl::wgpu::WgpuRuntime;
use half::f16;
use kernels_cubecl::*;
use pw_format::BlockKind;
use pw_pages::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type Table = PagedWeights<ManualMover<CubePool<WgpuRuntime>>>;

fn client() -> ComputeClient<WgpuRuntime> {
    pw_testkit::wgpu_client()
}

const EXPERTS: usize = 3;
const TOKENS: [u32; EXPERTS] = [2, 1, 3];

fn device_table(budget: u64) -> Table {
    let blocks = moe_blocks(1, EXPERTS, 31);
    let (_, words, luts) = size_at(&blocks, 8);
    let (_, sw, sl) = size_at(&blocks[..1], 8);
    let pool = CubePool::new(client(), words + sw, luts + sl);
    PagedWeights::new(blocks, Accountant::new(budget), ManualMover::new(pool)).unwrap()
}

/// One MoE layer's expert work through the page pool: the grouped gate_up
/// GEMM, then the grouped down GEMM with SiLU(gate)·up fused into its load.
/// Returns `[Σ tokens, HIDDEN]`.
fn expert_forward(t: &Table, x: &[f32]) -> Vec<f32> {
    let pool = &t.mover().inner;
    let client = pool.client();
    let cfg = GemmConfig::for_client(client);
    let (mut gu, mut dn) = (Vec::new(), Vec::new());
    let mut tok = 0u32;
    for (e, &n) in TOKENS.iter().enumerate() {
        let off_x = tok * HIDDEN as u32;
        let off_h = tok * 2 * INTER as u32;
        gu.push(Group { expert: e, x_off: off_x, y_off: off_h, tokens: n });
        dn.push(Group { expert: e, x_off: off_h, y_off: off_x, tokens: n });
        tok += n;
    }
    let tok = tok as usize;
    let xd = DeviceArray::from_slice(client, x);
    let h = DeviceArray::from_slice(client, &vec![f32::NAN; tok * 2 * INTER]);
    let y = DeviceArray::from_slice(client, &vec![f32::NAN; tok * HIDDEN]);
    for (kind, groups, src, dst, act) in [
        (BlockKind::GateUp, &gu, &xd, &h, Activation::None),
        (BlockKind::Down, &dn, &h, &y, Activation::SiluMul),
    ] {
        let items = t.items(0, kind, groups).unwrap();
        let desc = upload_items(client, &items);
        ap_gemm(client, cfg, pool.planes(), pool.luts(), &items, &desc, src, dst, act).unwrap();
    }
    read_f32(client, &y).unwrap()
}

/// CPU reference of [`expert_forward`] from the pages' host parents at the committed bits.
fn expert_reference(t: &Table, x: &[f32]) -> Vec<f32> {
    let mut out = Vec::new();
    let mut tok = 0;
    for (e, &n) in TOKENS.iter().enumerate() {
        let n = n as usize;
        let gu = t.page(PageKey { layer: 0, expert: e, kind: BlockKind::GateUp }).unwrap();
        let dn = t.page(PageKey { layer: 0, expert: e, kind: BlockKind::Down }).unwrap();
        let xs = &x[tok * HIDDEN..(tok + n) * HIDDEN];
        let h = t.parent(gu).unwrap().matmul_reference(t.info(gu).unwrap().committed, xs, n);
        let a: Vec<f32> = h
            .chunks(2 * INTER)
            .flat_map(|r| (0..INTER).map(|c| silu(r[c]) * r[INTER + c]).collect::<Vec<_>>())
            .collect();
        out.extend(t.parent(dn).unwrap().matmul_reference(t.info(dn).unwrap().committed, &a, n));
        tok += n;
    }
    out
}

fn settle(t: &mut Table) {
    for _ in 0..2 * t.len() {
        t.mover_mut().complete_all().unwrap();
        t.boundary().unwrap();
    }
    assert!(t.mover().in_flight().is_empty());
}

#[test]
fn raise_lower_raise_restores_bit_identical_kernel_outputs() {
    let mut t = device_table(u64::MAX / 2);
    let mut rng = StdRng::seed_from_u64(7);
    let tokens: u32 = TOKENS.iter().sum();
    let x: Vec<f32> = (0..tokens as usize * HIDDEN).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    t.set_desired_all(8);
    settle(&mut t);
    let y8 = expert_forward(&t, &x);
    // Not garbage: the CPU reference of the same bits, within f32 reordering.
    let want = expert_reference(&t, &x);
    let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max) + 1.0;
    for (g, w) in y8.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-4 * scale, "8 bits: kernel {g}, reference {w}");
    }
    for low in [3u8, 6] {
        t.set_desired_all(low);
        let r = t.boundary().unwrap();
        assert_eq!(r.lowered.len(), 2 * EXPERTS, "lowerings commit at once");
        let ylow = expert_forward(&t, &x);
        assert_ne!(ylow, y8);
        let want = expert_reference(&t, &x);
        for (g, w) in ylow.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-4 * scale, "{low} bits: kernel {g}, reference {w}");
        }
        t.set_desired_all(8);
        t.boundary().unwrap();
        // In flight (poisoned on the device): the kernels still read `low` bits.
        assert!(!t.mover().in_flight().is_empty());
        let mid = expert_forward(&t, &x);
        assert!(
            mid.iter().zip(&ylow).all(|(a, b)| a.to_bits() == b.to_bits()),
            "a raising in flight changed the outputs"
        );
        settle(&mut t);
        let back = expert_forward(&t, &x);
        assert!(t.table().iter().all(|s| s.bits == 8), "not all raised back: {:?}", t.table());
        assert!(
            back.iter().zip(&y8).all(|(a, b)| a.to_bits() == b.to_bits()),
            "8 → {low} → 8 changed outputs"
        );
    }
}

fn read_luts(pool: &CubePool<WgpuRuntime>) -> Vec<f16> {
    let bytes = pool.client().read_one(pool.luts().handle.clone()).unwrap();
    f16::from_bytes(&bytes)[..pool.luts().len].to_vec()
}

#[test]
fn random_sequences_on_the_device_keep_committed_state_visible() {
    let mut rng = StdRng::seed_from_u64(3);
    let blocks = moe_blocks(1, EXPERTS, 31);
    let (bytes8, _, _) = size_at(&blocks, 8);
    let mut t = device_table(bytes8 as u64 * 2 / 3);
    let ids: Vec<PageId> = t.ids().collect();
    t.set_desired_all(3);
    settle(&mut t);
    for step in 0..40 {
        for _ in 0..3 {
            let id = ids[rng.random_range(0..ids.len())];
            t.set_desired(id, rng.random_range(3..=8)).unwrap();
        }
        let in_flight = t.mover().in_flight();
        for tk in in_flight {
            if rng.random_bool(0.5) {
                t.mover_mut().complete(tk).unwrap();
            }
        }
        t.boundary().unwrap();
        t.audit().unwrap();
        let usage = t.usage();
        assert!(usage.weights <= usage.budget);
        // What the kernels read on the device is exactly the committed state.
        let pool = &t.mover().inner;
        let planes = read_u32(pool.client(), pool.planes()).unwrap();
        let luts = read_luts(pool);
        let desc = read_u32(pool.client(), pool.descriptors()).unwrap();
        for (i, slot) in t.table().iter().enumerate() {
            assert_eq!(
                &desc[5 * i..5 * i + 5],
                &[slot.plane_off, slot.lut_off, slot.rows, slot.cols, slot.bits]
            );
            let parent = t.parent(PageId(i)).unwrap();
            let b = slot.bits as u8;
            let n = b as usize * parent.rows * parent.words_per_row();
            assert!(
                planes[slot.plane_off as usize..][..n] == parent.planes[..n],
                "step {step} page {i} planes"
            );
            let lut = parent.lut(b);
            assert!(luts[slot.lut_off as usize..][..lut.len()] == *lut, "step {step} page {i} LUT");
        }
    }
}
