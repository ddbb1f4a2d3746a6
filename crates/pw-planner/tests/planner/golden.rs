//! Snapshot test: a fixed page table, routing state and residual factors, planned for a
//! sequence of targets; the plans must match `tests/snapshots/plans.txt` byte for byte.
//! A deliberate change of the planner's choices regenerates the file with
//! `UPDATE_SNAPSHOTS=1 cargo test -p pw-planner --test planner golden` (review the diff).

use std::fmt::Write;

use pw_planner::{
    BlockKind, MemoryTarget, PageId, PageState, PlannerConfig, ResidualFactors, RoutingConfig, RoutingStats,
    Snapshot, plan,
};

/// Deterministic table: 4 layers × 4 experts × 2 kinds, bits 3..=8, a non-convex wiggle in the
/// sensitivity of every third page.
fn table() -> Snapshot {
    let mut seed = 2026u64;
    let mut next = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as f64 / (1u64 << 31) as f64
    };
    let mut pages = vec![];
    for layer in 0..4 {
        for expert in 0..4 {
            for (k, kind) in [BlockKind::GateUp, BlockKind::Down].into_iter().enumerate() {
                let rows = if k == 0 { 256 } else { 128 };
                let bytes = (3..=8u64).map(|b| b * rows * 4 * 4 + rows * (1 << b) * 2).collect();
                let base = 1000.0 * (0.5 + next());
                let mut sens: Vec<f64> =
                    (0..6).map(|i| base * 0.25f64.powi(i) * (0.8 + 0.4 * next())).collect();
                if (layer * 8 + expert * 2 + k) % 3 == 0 {
                    sens[1] = sens[0] * 0.98;
                }
                pages.push(PageState {
                    id: PageId { layer, expert, kind },
                    desired: 8,
                    committed: 8,
                    min_bits: 3,
                    max_bits: 8,
                    bytes,
                    sensitivity: sens,
                });
            }
        }
    }
    Snapshot { pages }
}

#[test]
fn plans_match_the_snapshot() {
    let mut snap = table();
    let mut routing = RoutingStats::new(4, 4, RoutingConfig::default()).unwrap();
    routing
        .update(
            8,
            &[8, 4, 3, 1, 4, 4, 4, 4, 1, 1, 1, 13, 6, 5, 4, 1],
            &[6.0, 1.5, 0.4, 0.1, 2.0, 2.0, 2.0, 2.0, 0.2, 0.2, 0.3, 7.3, 3.0, 2.5, 2.0, 0.5],
        )
        .unwrap();
    let residual = ResidualFactors::new(4, vec![1.0, 2.0, 0.5, 1.0, 1.5, 0.7, 1.0, 1.0]).unwrap();
    let cfg = PlannerConfig::default();
    let total = snap.desired_bytes();
    let targets = [
        MemoryTarget::Free(total / 10),
        MemoryTarget::Free(total / 5),
        MemoryTarget::Hold,
        MemoryTarget::Spare(total / 20),
        MemoryTarget::Free(total / 4),
        MemoryTarget::Spare(u64::MAX),
    ];
    let mut out = String::new();
    for t in targets {
        let p = plan(&snap, Some(&routing), Some(&residual), t, &cfg).unwrap();
        let bits: String = p.desired.iter().map(|b| char::from(b'0' + b)).collect();
        writeln!(
            out,
            "{t:?}: met={} freed={} damage_delta={:.6e} bits={bits}",
            p.met,
            p.freed(),
            p.damage_delta
        )
        .unwrap();
        for (pg, d) in snap.pages.iter_mut().zip(&p.desired) {
            pg.desired = *d;
            pg.committed = *d;
        }
    }
    // The crate's directory at run time: a test binary reused from a target directory shared
    // with another checkout would otherwise look in that checkout.
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into());
    let path = std::path::Path::new(&dir).join("tests/snapshots/plans.txt");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &out).unwrap();
    }
    let want =
        std::fs::read_to_string(path).expect("tests/snapshots/plans.txt (UPDATE_SNAPSHOTS=1 writes it)");
    assert_eq!(out, want, "plans differ from the snapshot");
}
