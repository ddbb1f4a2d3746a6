//! The asynchronous CUDA mover (feature `cuda`; needs an NVIDIA GPU, run with
//! `cargo test -p pw-pages --features cuda --test pages cuda`).
#![cfg(feature = "cuda")]

use crate::common::*;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::*;
use pw_format::BlockKind;
use pw_pages::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

const EXPERTS: usize = 4;

fn table(layers: usize) -> PagedWeights<CudaMover> {
    let blocks = moe_blocks(layers, EXPERTS, 41);
    let (_, words, luts) = size_at(&blocks, 8);
    let (_, sw, sl) = size_at(&blocks[..2], 8);
    let client = CudaRuntime::client(&CudaDevice::new(0));
    let mover = CudaMover::new(client, 0, words + sw, luts + sl).unwrap();
    PagedWeights::new(blocks, Accountant::new(u64::MAX / 2), mover).unwrap()
}

/// Boundaries until no transfer is in flight (polling, never blocking in the table).
fn settle(t: &mut PagedWeights<CudaMover>) {
    let t0 = Instant::now();
    loop {
        let r = t.boundary().unwrap();
        let busy = t.ids().any(|id| {
            let i = t.info(id).unwrap();
            i.desired != i.committed
        });
        if !busy && r.started.is_empty() && r.relocating.is_empty() {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "transfers did not finish: {r:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn gate_up(t: &PagedWeights<CudaMover>, x: &[f32]) -> Vec<f32> {
    let pool = t.mover().pool();
    let client = pool.client();
    let groups: Vec<Group> = (0..EXPERTS)
        .map(|e| Group { expert: e, x_off: (e * HIDDEN) as u32, y_off: (e * 2 * INTER) as u32, tokens: 1 })
        .collect();
    let items = t.items(0, BlockKind::GateUp, &groups).unwrap();
    let xd = DeviceArray::from_slice(client, x);
    let y = DeviceArray::from_slice(client, &vec![f32::NAN; EXPERTS * 2 * INTER]);
    let desc = upload_items(client, &items);
    let cfg = GemmConfig::for_client(client);
    ap_gemm(client, cfg, pool.planes(), pool.luts(), &items, &desc, &xd, &y, Activation::None).unwrap();
    read_f32(client, &y).unwrap()
}

#[test]
fn async_transfers_commit_the_parent_data_and_restore_bit_identical_outputs() {
    let mut t = table(2);
    let mut rng = StdRng::seed_from_u64(9);
    let x: Vec<f32> = (0..EXPERTS * HIDDEN).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    t.set_desired_all(8);
    settle(&mut t);
    let y8 = gate_up(&t, &x);
    for low in [3u8, 5] {
        t.set_desired_all(low);
        t.boundary().unwrap();
        assert_ne!(gate_up(&t, &x), y8);
        t.set_desired_all(8);
        settle(&mut t);
        let back = gate_up(&t, &x);
        assert!(back.iter().zip(&y8).all(|(a, b)| a.to_bits() == b.to_bits()), "8 → {low} → 8");
    }
    // Random desires: the device arenas hold exactly the committed state.
    let ids: Vec<PageId> = t.ids().collect();
    for _ in 0..20 {
        for _ in 0..4 {
            t.set_desired(ids[rng.random_range(0..ids.len())], rng.random_range(3..=8)).unwrap();
        }
        settle(&mut t);
        t.audit().unwrap();
        let pool = t.mover().pool();
        let planes = read_u32(pool.client(), pool.planes()).unwrap();
        let luts = f16::from_bytes(&pool.client().read_one(pool.luts().handle.clone()).unwrap()).to_vec();
        for (i, slot) in t.table().iter().enumerate() {
            let parent = t.parent(PageId(i)).unwrap();
            let n = slot.bits as usize * parent.rows * parent.words_per_row();
            assert!(planes[slot.plane_off as usize..][..n] == parent.planes[..n], "page {i} planes");
            let lut = parent.lut(slot.bits as u8);
            assert!(luts[slot.lut_off as usize..][..lut.len()] == *lut, "page {i} LUT");
        }
    }
}
