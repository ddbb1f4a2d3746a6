//! `plan` on model-sized page tables: it runs between decode steps, so it must cost far less
//! than a step. Mixtral-8x7B: 32 layers × 8 experts × 2 kinds; Qwen1.5-MoE-A2.7B: 24 × 60 × 2;
//! Gemma-4-26B-A4B: 30 × 128 × 2.
//!
//! `cargo bench -p pw-planner --bench plan -- --warm-up-time 1 --measurement-time 3`; figures go
//! to `benches/results/planner-cpu.md`. Calls repeat on one thread, as a server's calls between
//! steps do, so `plan`'s per-thread buffers are warm after the first.

use criterion::{Criterion, criterion_main};
use pw_format::{BlockEntry, BlockKind};
use pw_planner::{MemoryTarget, PageState, PlannerConfig, RoutingConfig, RoutingStats, Snapshot, plan};
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::hint::black_box;

/// Pages at 8 bits with sensitivities ~4× per bit and ±30% noise (non-convex at places).
fn table(layers: usize, experts: usize, hidden: usize, inter: usize, rng: &mut StdRng) -> Snapshot {
    let mut pages = Vec::new();
    for layer in 0..layers {
        for expert in 0..experts {
            for (kind, rows, cols) in
                [(BlockKind::GateUp, 2 * inter, hidden), (BlockKind::Down, hidden, inter)]
            {
                let base = rng.random_range(0.5..2.0) * (rows * cols) as f64;
                let sensitivity =
                    (3..=8).map(|b| base * 0.25f64.powi(b) * rng.random_range(0.7..1.3)).collect();
                let e = BlockEntry {
                    name: String::new(),
                    layer,
                    expert,
                    kind,
                    rows,
                    cols,
                    min_bits: 3,
                    max_bits: 8,
                    file: String::new(),
                    sensitivity,
                    sources: vec![],
                };
                pages.push(PageState::from_entry(&e, 8, 8));
            }
        }
    }
    Snapshot { pages }
}

fn routing(layers: usize, experts: usize, rng: &mut StdRng) -> RoutingStats {
    let mut r = RoutingStats::new(layers, experts, RoutingConfig::default()).unwrap();
    for _ in 0..32 {
        let counts: Vec<u32> = (0..layers * experts).map(|_| rng.random_range(0..16)).collect();
        let mass: Vec<f32> = counts.iter().map(|&c| c as f32 * 0.4).collect();
        r.update(16, &counts, &mass).unwrap();
    }
    r
}

fn bench(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(7);
    for (name, l, e, h, i) in
        [("mixtral", 32, 8, 4096, 14336), ("qwen2_moe", 24, 60, 2048, 1408), ("gemma4", 30, 128, 2816, 704)]
    {
        let snap = table(l, e, h, i, &mut rng);
        let r = routing(l, e, &mut rng);
        let cfg = PlannerConfig::default();
        let total = snap.desired_bytes();
        // Fixed cost: validation, the damage model, byte sums.
        c.bench_function(&format!("plan_{name}_hold"), |b| {
            b.iter(|| plan(black_box(&snap), Some(&r), None, MemoryTarget::Hold, &cfg).unwrap())
        });
        // One KV block's worth (a typical per-step target) and a large cut (cold start).
        let kv_block = 2 * 1024 * 1024;
        c.bench_function(&format!("plan_{name}_free_one_kv_block"), |b| {
            b.iter(|| plan(black_box(&snap), Some(&r), None, MemoryTarget::Free(kv_block), &cfg).unwrap())
        });
        c.bench_function(&format!("plan_{name}_free_40pct"), |b| {
            b.iter(|| {
                plan(black_box(&snap), Some(&r), None, MemoryTarget::Free(total * 2 / 5), &cfg).unwrap()
            })
        });
        let mut low = snap.clone();
        let p = plan(&snap, Some(&r), None, MemoryTarget::Free(total * 2 / 5), &cfg).unwrap();
        for (pg, d) in low.pages.iter_mut().zip(&p.desired) {
            pg.desired = *d;
            pg.committed = *d;
        }
        c.bench_function(&format!("plan_{name}_spare_20pct"), |b| {
            b.iter(|| plan(black_box(&low), Some(&r), None, MemoryTarget::Spare(total / 5), &cfg).unwrap())
        });
    }
}

// criterion_group! generates an undocumented function.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::bench);
}
criterion_main!(group::benches);
