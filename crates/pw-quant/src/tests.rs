use super::*;
use kmeans::{KmeansScratch, Prefix, optimal_partition, optimal_split};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Relative tolerance for comparing optimal costs found two ways (f64 rounding
/// of prefix sums versus direct sums).
const COST_RTOL: f64 = 1e-9;
/// Absolute floor: prefix sums of values in [-1, 1] carry ~1e-16 absolute error.
const COST_ATOL: f64 = 1e-12;

fn direct_cost(v: &[f64], w: &[f64]) -> f64 {
    let tw: f64 = w.iter().sum();
    if tw == 0.0 {
        return 0.0;
    }
    let m = v.iter().zip(w).map(|(x, w)| x * w).sum::<f64>() / tw;
    v.iter().zip(w).map(|(x, w)| w * (x - m) * (x - m)).sum()
}

/// Minimum over all ways to cut `n` sorted points into `k` non-empty runs.
fn brute_force_partition(v: &[f64], w: &[f64], k: usize) -> f64 {
    fn rec(v: &[f64], w: &[f64], start: usize, k: usize) -> f64 {
        let n = v.len();
        if k == 1 {
            return direct_cost(&v[start..], &w[start..]);
        }
        (start + 1..=n - (k - 1))
            .map(|t| direct_cost(&v[start..t], &w[start..t]) + rec(v, w, t, k - 1))
            .fold(f64::INFINITY, f64::min)
    }
    rec(v, w, 0, k)
}

fn random_sorted(rng: &mut StdRng, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    let w = v.iter().map(|_| rng.random_range(0.0..2.0)).collect();
    (v, w)
}

fn assert_close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= COST_RTOL * b.abs() + COST_ATOL, "{what}: {a} vs brute force {b}");
}

#[test]
fn seed_kmeans_matches_brute_force() {
    let mut rng = StdRng::seed_from_u64(1);
    let mut scratch = KmeansScratch::default();
    for trial in 0..300 {
        let n = rng.random_range(1..=13);
        let (v, w) = random_sorted(&mut rng, n);
        let p = Prefix::new(&v, &w);
        for k in 1..=v.len().min(8) {
            let (bounds, cost) = optimal_partition(&p, k, &mut scratch);
            assert_eq!(bounds.len(), k + 1);
            assert!(bounds.windows(2).all(|b| b[0] < b[1]), "empty cluster in {bounds:?}");
            let recomputed: f64 =
                bounds.windows(2).map(|b| direct_cost(&v[b[0]..b[1]], &w[b[0]..b[1]])).sum();
            let brute = brute_force_partition(&v, &w, k);
            assert_close(cost, brute, &format!("trial {trial} n {} k {k}", v.len()));
            assert_close(recomputed, brute, &format!("trial {trial} boundaries"));
        }
    }
}

/// The textbook O(k·n²) dynamic programme, for rows too long to enumerate.
fn quadratic_dp(p: &Prefix, k: usize) -> f64 {
    let n = p.len();
    let mut d: Vec<f64> = (0..=n).map(|j| p.cost(0, j)).collect();
    for m in 1..k {
        let mut e = vec![f64::INFINITY; n + 1];
        for (j, ej) in e.iter_mut().enumerate().skip(m + 1) {
            *ej = (m..j).map(|i| d[i] + p.cost(i, j)).fold(f64::INFINITY, f64::min);
        }
        d = e;
    }
    d[n]
}

#[test]
fn seed_kmeans_matches_quadratic_dp_on_long_rows() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut scratch = KmeansScratch::default();
    for n in [20usize, 63, 64, 65, 100, 257, 400] {
        let (v, w) = random_sorted(&mut rng, n);
        let p = Prefix::new(&v, &w);
        for k in [2usize, 3, 5, 8] {
            let (bounds, cost) = optimal_partition(&p, k, &mut scratch);
            let recomputed: f64 =
                bounds.windows(2).map(|b| direct_cost(&v[b[0]..b[1]], &w[b[0]..b[1]])).sum();
            let want = quadratic_dp(&p, k);
            assert_close(cost, want, &format!("n {n} k {k}"));
            assert_close(recomputed, want, &format!("n {n} k {k} boundaries"));
        }
    }
}

#[test]
fn two_means_split_matches_brute_force() {
    let mut rng = StdRng::seed_from_u64(2);
    for _ in 0..300 {
        let n = rng.random_range(2..=40);
        let (v, w) = random_sorted(&mut rng, n);
        if v.len() < 2 {
            continue;
        }
        let p = Prefix::new(&v, &w);
        let lo = rng.random_range(0..v.len() - 1);
        let hi = rng.random_range(lo + 2..=v.len());
        let (t, cost) = optimal_split(&p, lo, hi);
        let brute = (lo + 1..hi)
            .map(|t| direct_cost(&v[lo..t], &w[lo..t]) + direct_cost(&v[t..hi], &w[t..hi]))
            .fold(f64::INFINITY, f64::min);
        assert_close(cost, brute, "2-means split");
        let at_t = direct_cost(&v[lo..t], &w[lo..t]) + direct_cost(&v[t..hi], &w[t..hi]);
        assert_close(at_t, brute, "2-means split point");
    }
}

/// Weighted error of a row recomputed from indices and LUTs.
fn row_error(x: &[f32], imp: &[f32], q: &RowCodebook, bits: u8) -> f64 {
    let lut = &q.luts[(bits - MIN_BITS) as usize];
    x.iter()
        .zip(imp)
        .zip(&q.indices)
        .map(|((&x, &w), &i)| {
            let d = x as f64 - lut[(i >> (MAX_BITS - bits)) as usize].to_f64();
            w as f64 * d * d
        })
        .sum()
}

#[test]
fn indices_nest_and_error_never_increases_with_bits() {
    let mut rng = StdRng::seed_from_u64(3);
    for trial in 0..60 {
        let k = rng.random_range(1..600);
        // Mix of distributions: gaussian-ish, heavy-tailed, few distinct values.
        let x: Vec<f32> = (0..k)
            .map(|_| match trial % 3 {
                0 => (rng.random::<f32>() + rng.random::<f32>() + rng.random::<f32>() - 1.5) * 0.05,
                1 => (rng.random::<f32>() - 0.5).powi(5) * 10.0,
                _ => (rng.random_range(0..20) as f32) * 0.25,
            })
            .collect();
        let imp: Vec<f32> = (0..k).map(|_| rng.random::<f32>() * 3.0).collect();
        let q = quantize_row(&x, Some(&imp)).unwrap();
        let mut prev = f64::INFINITY;
        for bits in MIN_BITS..=MAX_BITS {
            let lut = &q.luts[(bits - MIN_BITS) as usize];
            assert_eq!(lut.len(), 1 << bits);
            assert!(lut.windows(2).all(|p| p[0] <= p[1]), "LUT at {bits} bits not ascending");
            // Nesting: the (b+1)-bit cluster of every weight lies inside its b-bit cluster,
            // i.e. the b-bit clusters are unions of consecutive (b+1)-bit clusters and
            // the values of cluster c all lie below those of cluster c+1.
            let shift = MAX_BITS - bits;
            let mut ranges = vec![(f32::INFINITY, f32::NEG_INFINITY); 1 << bits];
            for (&v, &i) in x.iter().zip(&q.indices) {
                let r = &mut ranges[(i >> shift) as usize];
                r.0 = r.0.min(v);
                r.1 = r.1.max(v);
            }
            let used: Vec<_> = ranges.iter().filter(|r| r.0 <= r.1).collect();
            assert!(used.windows(2).all(|p| p[0].1 < p[1].0), "clusters at {bits} bits overlap");
            let err = row_error(&x, &imp, &q, bits);
            assert!(
                (err - q.sse[(bits - MIN_BITS) as usize]).abs() <= 1e-9 * err.max(1e-12),
                "reported sse differs from recomputed at {bits} bits"
            );
            assert!(
                err <= prev * (1.0 + 1e-12),
                "trial {trial}: error rose from {prev} to {err} at {bits} bits"
            );
            prev = err;
        }
    }
}

#[test]
fn seed_of_quantize_row_is_the_optimal_3_bit_clustering() {
    let mut rng = StdRng::seed_from_u64(4);
    for _ in 0..50 {
        let k = rng.random_range(9..14);
        let x: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let q = quantize_row(&x, None).unwrap();
        let mut v: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        v.sort_by(f64::total_cmp);
        let brute = brute_force_partition(&v, &vec![1.0; v.len()], 8);
        // The stored error uses f16 centroids; compare with exact-mean clusters.
        let mut clusters = vec![vec![]; 8];
        for (&xv, &i) in x.iter().zip(&q.indices) {
            clusters[(i >> 5) as usize].push(xv as f64);
        }
        let cost: f64 = clusters.iter().map(|c| direct_cost(c, &vec![1.0; c.len()])).sum();
        assert_close(cost, brute, "3-bit seed");
    }
}

#[test]
fn constant_and_zero_rows_are_exact() {
    for value in [0.0f32, 0.375, -2.5] {
        let x = vec![value; 100];
        let q = quantize_row(&x, None).unwrap();
        assert!(q.indices.iter().all(|&i| i == q.indices[0]));
        for bits in MIN_BITS..=MAX_BITS {
            assert_eq!(q.sse[(bits - MIN_BITS) as usize], 0.0);
            let lut = &q.luts[(bits - MIN_BITS) as usize];
            assert_eq!(lut[(q.indices[0] >> (8 - bits)) as usize].to_f32(), value);
        }
    }
}

#[test]
fn rows_with_fewer_than_eight_distinct_values_are_exact_at_three_bits() {
    let x: Vec<f32> = (0..50).map(|i| [0.5f32, -1.0, 0.25, 2.0, 0.5][i % 5]).collect();
    let q = quantize_row(&x, None).unwrap();
    assert_eq!(q.sse[0], 0.0);
    let lut = &q.luts[0];
    for (&v, &i) in x.iter().zip(&q.indices) {
        assert_eq!(lut[(i >> 5) as usize].to_f32(), v);
    }
    // Single element and two elements.
    assert_eq!(quantize_row(&[1.5], None).unwrap().sse, [0.0; NUM_WIDTHS]);
    assert_eq!(quantize_row(&[1.5, -3.0], None).unwrap().sse, [0.0; NUM_WIDTHS]);
}

#[test]
fn zero_importance_row_falls_back_to_uniform() {
    let mut rng = StdRng::seed_from_u64(5);
    let x: Vec<f32> = (0..200).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let zero = quantize_row(&x, Some(&vec![0.0; 200])).unwrap();
    let ones = quantize_row(&x, None).unwrap();
    assert_eq!(zero.indices, ones.indices);
    assert_eq!(zero.luts, ones.luts);
    // ...but its importance-weighted error is zero, not the unweighted one.
    assert_eq!(zero.sse, [0.0; NUM_WIDTHS]);
    assert!(ones.sse[0] > 0.0);
    // Partially zero importance still gives sane, finite centroids.
    let imp: Vec<f32> = (0..200).map(|i| if i % 2 == 0 { 0.0 } else { 1.0 }).collect();
    let part = quantize_row(&x, Some(&imp)).unwrap();
    assert!(part.luts.iter().flatten().all(|v| v.is_finite()));
}

#[test]
fn non_finite_input_is_a_clear_error() {
    let mut w = vec![0.1f32; 64];
    w[37] = f32::NAN;
    let err = quantize(&w, None, 2, 32).unwrap_err();
    assert!(matches!(err, QuantError::NonFiniteWeight { row: 1, col: 5, .. }), "{err:?}");
    assert!(err.to_string().contains("row 1, column 5"));
    w[37] = f32::INFINITY;
    assert!(matches!(quantize(&w, None, 2, 32), Err(QuantError::NonFiniteWeight { row: 1, col: 5, .. })));
    let w = vec![0.1f32; 64];
    let mut imp = vec![1.0f32; 64];
    imp[3] = -1.0;
    assert!(matches!(quantize(&w, Some(&imp), 2, 32), Err(QuantError::BadImportance { row: 0, col: 3, .. })));
    imp[3] = f32::NAN;
    assert!(matches!(quantize(&w, Some(&imp), 2, 32), Err(QuantError::BadImportance { row: 0, col: 3, .. })));
    assert!(matches!(quantize(&w, Some(&imp[..10]), 2, 32), Err(QuantError::ImportanceShape { .. })));
    assert!(matches!(quantize(&w, None, 3, 32), Err(QuantError::Shape { .. })));
    assert!(matches!(quantize(&[1e6; 8], None, 1, 8), Err(QuantError::F16Overflow { .. })));
}

#[test]
fn quantization_is_deterministic_across_thread_counts() {
    let mut rng = StdRng::seed_from_u64(6);
    let (rows, cols) = (37, 300);
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.1f32..0.1)).collect();
    let imp: Vec<f32> = (0..rows * cols).map(|_| rng.random::<f32>()).collect();
    let run = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| quantize(&w, Some(&imp), rows, cols).unwrap())
    };
    let a = run(1);
    assert_eq!(a, run(3));
    assert_eq!(a, quantize(&w, Some(&imp), rows, cols).unwrap());
}
