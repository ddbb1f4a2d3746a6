//! Expert placement across GPUs: balance, per-GPU plans, and relieving a short GPU.

use pw_planner::{
    BlockKind, MemoryTarget, PageId, PageState, Placement, PlannerConfig, RoutingConfig, RoutingStats,
    Snapshot, plan, plan_per_gpu,
};

/// Both pages of every expert: `bytes(layer, expert)` per page at 8 bits, halving per bit below.
fn table(layers: usize, experts: usize, size: impl Fn(usize, usize) -> u64) -> Snapshot {
    let mut pages = Vec::new();
    for l in 0..layers {
        for e in 0..experts {
            for kind in [BlockKind::GateUp, BlockKind::Down] {
                let top = size(l, e);
                let bytes: Vec<u64> = (3..=8u32).map(|b| top * b as u64 / 8).collect();
                let sensitivity =
                    (3..=8).map(|b| (1u64 << (2 * (8 - b))) as f64 * (1 + l + e) as f64).collect();
                pages.push(PageState {
                    id: PageId { layer: l, expert: e, kind },
                    desired: 8,
                    committed: 8,
                    min_bits: 3,
                    max_bits: 8,
                    bytes,
                    sensitivity,
                });
            }
        }
    }
    Snapshot { pages }
}

fn routing(layers: usize, experts: usize, mass: impl Fn(usize, usize) -> f32) -> RoutingStats {
    let mut r = RoutingStats::new(layers, experts, RoutingConfig::default()).unwrap();
    let mass: Vec<f32> = (0..layers * experts).map(|i| mass(i / experts, i % experts)).collect();
    let counts: Vec<u32> = mass.iter().map(|m| (*m * 10.0) as u32).collect();
    r.update(100, &counts, &mass).unwrap();
    r
}

#[test]
fn one_gpu_holds_everything_and_plans_as_the_single_planner() {
    let s = table(3, 4, |l, e| 1000 * (1 + l + e) as u64);
    let p = Placement::single(&s);
    assert_eq!(p.gpus(), 1);
    assert_eq!(p.committed_bytes(&s), vec![s.committed_bytes()]);
    let cfg = PlannerConfig { use_routing: false, use_residual: false, ..PlannerConfig::default() };
    let target = MemoryTarget::Free(s.committed_bytes() / 3);
    let (desired, plans) = plan_per_gpu(&s, &p, None, None, &[target], &cfg).unwrap();
    assert_eq!(desired, plan(&s, None, None, target, &cfg).unwrap().desired);
    assert_eq!(plans.len(), 1);
}

#[test]
fn balanced_placement_splits_each_layers_routing_and_the_bytes() {
    // Layer 0: two hot experts (shares ~3) among 8; sizes differ by expert.
    let (layers, experts, gpus) = (4, 8, 2);
    let s = table(layers, experts, |l, e| 1000 + 100 * ((e + l) % 3) as u64);
    let r = routing(layers, experts, |l, e| if l == 0 && e < 2 { 6.0 } else { 1.0 });
    let p = Placement::balanced(&s, Some(&r), gpus).unwrap();
    for l in 0..layers {
        let on = |g| (0..experts).filter(|&e| p.gpu_of(l, e) == g).count();
        assert_eq!((on(0), on(1)), (4, 4), "layer {l}: equal expert counts");
        let share = |g| (0..experts).filter(|&e| p.gpu_of(l, e) == g).map(|e| r.share(l, e)).sum::<f64>();
        let total = share(0) + share(1);
        assert!(
            (share(0) - share(1)).abs() <= 0.35 * total,
            "layer {l}: shares {} vs {}",
            share(0),
            share(1)
        );
    }
    // The two hot experts of layer 0 are on different GPUs.
    assert_ne!(p.gpu_of(0, 0), p.gpu_of(0, 1));
    let bytes = p.committed_bytes(&s);
    let (lo, hi) = (*bytes.iter().min().unwrap(), *bytes.iter().max().unwrap());
    assert!(hi - lo <= s.committed_bytes() / 20, "bytes per GPU {bytes:?}");
    assert_eq!(bytes.iter().sum::<u64>(), s.committed_bytes());
    // Both pages of an expert on one GPU: the pages per GPU partition the table.
    let by_gpu = p.pages_by_gpu(&s);
    let mut all: Vec<usize> = by_gpu.concat();
    all.sort();
    assert_eq!(all, (0..s.pages.len()).collect::<Vec<_>>());
}

#[test]
fn each_gpu_plans_toward_its_own_target_and_only_over_its_pages() {
    let s = table(2, 4, |_, e| 800 + 200 * e as u64);
    let p = Placement::balanced(&s, None, 2).unwrap();
    let before = p.committed_bytes(&s);
    let cfg = PlannerConfig { use_routing: false, use_residual: false, ..PlannerConfig::default() };
    // GPU 0 must free a quarter of its bytes; GPU 1 holds.
    let targets = [MemoryTarget::Free(before[0] / 4), MemoryTarget::Hold];
    let (desired, plans) = plan_per_gpu(&s, &p, None, None, &targets, &cfg).unwrap();
    assert!(plans[0].met && plans[0].freed() as u64 >= before[0] / 4, "{:?}", plans[0]);
    for (page, &d) in s.pages.iter().zip(&desired) {
        if p.gpu_of(page.id.layer, page.id.expert) == 1 {
            assert_eq!(d, page.desired, "GPU 1 holds: {:?}", page.id);
        }
    }
    assert!(desired.iter().any(|&d| d < 8));
    // The per-GPU plan is the single planner's on that GPU's pages.
    let sub = Snapshot { pages: p.pages_by_gpu(&s)[0].iter().map(|&i| s.pages[i].clone()).collect() };
    assert_eq!(plans[0].desired, plan(&sub, None, None, targets[0], &cfg).unwrap().desired);
    let wrong = plan_per_gpu(&s, &p, None, None, &targets[..1], &cfg).unwrap_err().to_string();
    assert!(wrong.contains("1 targets for 2 GPUs"), "{wrong}");
}

#[test]
fn a_short_gpu_hands_an_expert_to_the_one_with_room() {
    let s = table(1, 4, |_, e| 1000 * (e as u64 + 1));
    let mut p = Placement::balanced(&s, None, 2).unwrap();
    let short = p.gpu_of(0, 3);
    let other = 1 - short;
    // The smallest expert on the short GPU that covers what it needs, onto the GPU with room.
    let sizes: Vec<(usize, u64)> =
        (0..4).filter(|&e| p.gpu_of(0, e) == short).map(|e| (e, 2 * 1000 * (e as u64 + 1))).collect();
    let need = sizes.iter().map(|s| s.1).min().unwrap();
    let mut spare = vec![0u64; 2];
    spare[other] = 1_000_000;
    let m = p.relieve(&s, short, need, &spare).unwrap();
    assert_eq!((m.from, m.to), (short, other));
    assert_eq!(m.bytes, need);
    assert_eq!(p.gpu_of(0, m.expert), other);
    // Nothing fits a GPU without spare bytes.
    let mut q = Placement::balanced(&s, None, 2).unwrap();
    assert_eq!(q.relieve(&s, short, need, &[0, 0]), None);
    assert!(Placement::balanced(&s, None, 0).is_err());
}
