//! Routing statistics (decay, buckets, accumulation) and the KV-pressure memory target.

use pw_planner::{
    Bucket, KvPressureConfig, MemoryTarget, PlanError, RoutingConfig, RoutingStats, accumulate_choices,
    kv_block_bytes,
};

fn cfg(half_life: f64) -> RoutingConfig {
    RoutingConfig { half_life_steps: half_life, ..RoutingConfig::default() }
}

#[test]
fn decay_is_bias_corrected_and_halves_at_the_half_life() {
    let mut r = RoutingStats::new(1, 2, cfg(8.0)).unwrap();
    assert_eq!(r.frequency(0, 0), 0.0);
    // A constant input reads back exactly from the first step on.
    r.update(10, &[6, 4], &[3.0, 2.0]).unwrap();
    assert!((r.frequency(0, 0) - 0.6).abs() < 1e-12);
    assert!((r.mass(0, 1) - 0.2).abs() < 1e-12);
    for _ in 0..199 {
        r.update(10, &[6, 4], &[3.0, 2.0]).unwrap();
    }
    assert!((r.frequency(0, 0) - 0.6).abs() < 1e-12);
    // Switch to 0.2: after exactly one half-life the estimate is the weighted mix
    // (a·λ^h·(1−λ^N) + b·(1−λ^h)) / (1 − λ^(N+h)) with λ^h = 1/2.
    let n = 200;
    for _ in 0..8 {
        r.update(10, &[2, 8], &[1.0, 4.0]).unwrap();
    }
    let lam = 0.5f64.powf(1.0 / 8.0);
    let expect = (0.6 * 0.5 * (1.0 - lam.powi(n)) + 0.2 * 0.5) / (1.0 - lam.powi(n + 8));
    assert!((r.frequency(0, 0) - expect).abs() < 1e-12, "{} vs {expect}", r.frequency(0, 0));
    assert!((expect - 0.4).abs() < 1e-3, "close to the midpoint after a long history");
    assert_eq!(r.steps(), 208);
    // Steps without tokens change nothing.
    let before = r.clone();
    r.update(0, &[0, 0], &[0.0, 0.0]).unwrap();
    assert_eq!(r, before);
}

#[test]
fn buckets_floors_and_multipliers_follow_the_mass_share() {
    let mut r = RoutingStats::new(2, 4, RoutingConfig::default()).unwrap();
    assert!((0..4).all(|e| r.bucket(0, e) == Bucket::Warm), "no observation: all warm");
    // Layer 0 shares: 2.4, 1.2, 0.32, 0.08; layer 1 uniform.
    let mass = [6.0, 3.0, 0.8, 0.2, 1.0, 1.0, 1.0, 1.0];
    r.update(10, &[6, 3, 1, 1, 3, 3, 2, 2], &mass).unwrap();
    assert!((r.share(0, 0) - 2.4).abs() < 1e-6);
    assert_eq!(
        (0..4).map(|e| r.bucket(0, e)).collect::<Vec<_>>(),
        [Bucket::Hot, Bucket::Warm, Bucket::Cold, Bucket::Cold]
    );
    assert!((0..4).all(|e| r.bucket(1, e) == Bucket::Warm));
    let d = RoutingConfig::default();
    assert_eq!(r.floor_bits(0, 0), d.hot_floor_bits);
    assert_eq!(r.floor_bits(0, 3), d.cold_floor_bits);
    assert_eq!(r.multiplier(0, 0), d.hot_multiplier);
    assert_eq!(r.multiplier(0, 1), d.warm_multiplier);
    assert_eq!(r.multiplier(0, 2), d.cold_multiplier);
    // Share exactly at the edges: hot is inclusive, cold exclusive.
    let mut r = RoutingStats::new(1, 4, RoutingConfig::default()).unwrap();
    r.update(4, &[1; 4], &[2.0, 1.0, 0.5, 0.5]).unwrap();
    assert_eq!(r.bucket(0, 0), Bucket::Hot);
    assert_eq!(r.bucket(0, 2), Bucket::Warm);
}

#[test]
fn multipliers_follow_the_share_relative_to_calibration() {
    let d = RoutingConfig::default();
    let mut r = RoutingStats::new(2, 4, d.clone()).unwrap();
    // Calibration: layer 0 saw expert 0 at 2.4 and expert 3 never; layer 1 uniform.
    r.set_calibration_shares(vec![2.4, 1.2, 0.4, 0.0, 1.0, 1.0, 1.0, 1.0]).unwrap();
    assert!((0..4).all(|e| r.multiplier(0, e) == d.warm_multiplier), "no observation: neutral");
    // Online: layer 0 at 2.4, 1.2, 0.32, 0.08 (as calibration but for expert 3); layer 1 skewed.
    r.update(10, &[6, 3, 1, 1, 3, 3, 2, 2], &[6.0, 3.0, 0.8, 0.2, 3.0, 0.5, 0.25, 0.25]).unwrap();
    assert!((r.relative_share(0, 0) - 1.0).abs() < 1e-6, "used as in calibration: 1");
    assert_eq!(r.multiplier(0, 0), d.warm_multiplier, "not counted twice");
    assert_eq!(r.bucket(0, 0), Bucket::Hot, "the floor still follows the plain share");
    assert_eq!(r.floor_bits(0, 0), d.hot_floor_bits);
    assert_eq!(r.multiplier(0, 2), d.warm_multiplier, "0.32 of 0.4");
    assert_eq!(r.multiplier(0, 3), d.hot_multiplier, "calibration never reached it");
    assert_eq!(r.multiplier(1, 0), d.hot_multiplier, "3.0 against 1.0");
    assert_eq!(r.multiplier(1, 2), d.cold_multiplier);
    // Without calibration the same step gives the plain buckets.
    let mut plain = RoutingStats::new(2, 4, d.clone()).unwrap();
    plain.update(10, &[6, 3, 1, 1, 3, 3, 2, 2], &[6.0, 3.0, 0.8, 0.2, 3.0, 0.5, 0.25, 0.25]).unwrap();
    assert_eq!(plain.multiplier(0, 0), d.hot_multiplier);
    assert!(!plain.has_calibration() && r.has_calibration());
    // Bad shares are named.
    let e = r.set_calibration_shares(vec![1.0; 7]).unwrap_err().to_string();
    assert!(e.contains("calibration routing shares") && e.contains("7 entries"), "{e}");
    let e = r.set_calibration_shares(vec![1.0, f64::NAN, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]).unwrap_err();
    assert!(e.to_string().contains("layer 0 expert 1"), "{e}");
}

#[test]
fn router_choices_accumulate_into_flat_counts() {
    let (layers, experts) = (2, 3);
    let mut counts = vec![0u32; layers * experts];
    let mut mass = vec![0f32; layers * experts];
    // Layer 1, two tokens, top-2.
    accumulate_choices(&mut counts, &mut mass, experts, 1, &[2, 0, 0, 1], &[0.7, 0.3, 0.6, 0.4]).unwrap();
    assert_eq!(counts, [0, 0, 0, 2, 1, 1]);
    assert!((mass[3] - 0.9).abs() < 1e-6 && (mass[5] - 0.7).abs() < 1e-6);
    let e = accumulate_choices(&mut counts, &mut mass, experts, 1, &[3], &[1.0]).unwrap_err();
    assert!(e.to_string().contains("layer 1") && e.to_string().contains("expert index 3"), "{e}");
    let e = accumulate_choices(&mut counts, &mut mass, experts, 2, &[0], &[1.0]).unwrap_err();
    assert!(matches!(e, PlanError::Shape { .. }));
}

#[test]
fn bad_routing_input_is_an_error() {
    let mut r = RoutingStats::new(2, 2, RoutingConfig::default()).unwrap();
    let e = r.update(1, &[1, 0, 1], &[1.0, 0.0, 1.0, 0.0]).unwrap_err();
    assert!(e.to_string().contains("routing counts") && e.to_string().contains("expected"), "{e}");
    let e = r.update(1, &[1, 0, 1, 0], &[1.0, 0.0, f32::NAN, 0.0]).unwrap_err();
    assert!(e.to_string().contains("layer 1 expert 0"), "{e}");
    let e = RoutingStats::new(1, 1, cfg(0.0)).unwrap_err();
    assert!(e.to_string().contains("half_life_steps"), "{e}");
}

#[test]
fn kv_pressure_target_follows_the_design_formula() {
    let b = 1000;
    let rule = KvPressureConfig {
        threshold_blocks: 8,
        give_back_margin_blocks: 4,
        bytes_per_block: b,
        min_give_back_bytes: 0,
    };
    // D = max(0, T + 1 − F) · B.
    assert_eq!(rule.target(8, (0, 0)), MemoryTarget::Free(b));
    assert_eq!(rule.target(5, (0, 0)), MemoryTarget::Free(4 * b));
    assert_eq!(rule.target(0, (0, 0)), MemoryTarget::Free(9 * b));
    // Blocks the next steps take beyond the free ones count in full.
    assert_eq!(rule.target(-20, (0, 0)), MemoryTarget::Free(29 * b));
    // Inside the band: hold.
    for f in 9..=12 {
        assert_eq!(rule.target(f, (0, 0)), MemoryTarget::Hold, "F = {f}");
    }
    // Above it: (F − T − H) · B goes back.
    assert_eq!(rule.target(15, (0, 0)), MemoryTarget::Spare(3 * b));
    // Pending lowerings count against D, pending raisings for it.
    assert_eq!(rule.target(5, (2500, 0)), MemoryTarget::Free(1500));
    assert_eq!(rule.target(5, (4000, 0)), MemoryTarget::Hold);
    assert_eq!(rule.target(8, (0, 300)), MemoryTarget::Free(1300));
    assert_eq!(rule.target(15, (500, 1000)), MemoryTarget::Spare(2500));
    let small = KvPressureConfig { min_give_back_bytes: 5000, ..rule.clone() };
    assert_eq!(small.target(15, (0, 0)), MemoryTarget::Hold);
    assert_eq!(small.target(17, (0, 0)), MemoryTarget::Spare(5000));
    let d = KvPressureConfig::new(b);
    assert_eq!((d.threshold_blocks, d.give_back_margin_blocks), (16, 16));
    let e = KvPressureConfig { give_back_margin_blocks: 0, ..d }.validate().unwrap_err();
    assert!(e.to_string().contains("give_back_margin_blocks"), "{e}");
}

#[test]
fn kv_block_bytes_counts_k_and_v_of_every_layer() {
    // Mixtral: 32 layers, 8 KV heads × 128, 16-token blocks, fp16: 2 MiB.
    assert_eq!(kv_block_bytes(32, 8, 128, 16, 2), 2 * 1024 * 1024);
}
