//! Exact weighted 1-D k-means on sorted data.
//!
//! Everything here works on a row that has already been sorted and merged into
//! distinct values with summed weights. Clusters of an optimal 1-D partition are
//! contiguous in sorted order, so a clustering is a list of boundaries and the
//! cost of a cluster `[i, j)` is O(1) from prefix sums of `w`, `w·x` and `w·x²`.

/// Prefix sums over distinct sorted values, used for O(1) cluster costs.
///
/// Values are stored centred on the row's weighted mean: the cost is invariant
/// to a shift and centring keeps `Σw·x² − (Σw·x)²/Σw` from cancelling badly.
#[derive(Debug, Clone, Default)]
pub struct Prefix {
    w: Vec<f64>,
    wx: Vec<f64>,
    wx2: Vec<f64>,
}

impl Prefix {
    /// Builds the prefix sums of `values` (sorted, distinct) with `weights`.
    pub fn new(values: &[f64], weights: &[f64]) -> Self {
        let mut p = Self::default();
        p.rebuild(values, weights);
        p
    }

    /// Recomputes the sums in place, reusing the allocations.
    pub fn rebuild(&mut self, values: &[f64], weights: &[f64]) {
        let total: f64 = weights.iter().sum();
        let centre = if total > 0.0 {
            values.iter().zip(weights).map(|(x, w)| x * w).sum::<f64>() / total
        } else {
            0.0
        };
        let n = values.len();
        for v in [&mut self.w, &mut self.wx, &mut self.wx2] {
            v.clear();
            v.reserve(n + 1);
            v.push(0.0);
        }
        let (mut a, mut b, mut c) = (0.0, 0.0, 0.0);
        for (&x, &w) in values.iter().zip(weights) {
            let d = x - centre;
            a += w;
            b += w * d;
            c += w * d * d;
            self.w.push(a);
            self.wx.push(b);
            self.wx2.push(c);
        }
    }

    /// Number of points covered.
    pub fn len(&self) -> usize {
        self.w.len().saturating_sub(1)
    }

    /// True when there are no points.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Weighted squared error of the cluster `[i, j)` around its weighted mean.
    #[inline(always)]
    pub fn cost(&self, i: usize, j: usize) -> f64 {
        let w = self.w[j] - self.w[i];
        if w <= 0.0 {
            return 0.0;
        }
        let s = self.wx[j] - self.wx[i];
        let q = self.wx2[j] - self.wx2[i];
        (q - s * s / w).max(0.0)
    }

    /// Total weight of the cluster `[i, j)`.
    pub fn weight(&self, i: usize, j: usize) -> f64 {
        self.w[j] - self.w[i]
    }
}

/// Reusable buffers of the dynamic programme, one set per worker thread.
#[derive(Debug, Default)]
pub struct KmeansScratch {
    prev: Vec<f64>,
    cur: Vec<f64>,
    /// `arg[m * (n + 1) + j]`: start of the last cluster in the best split of
    /// the first `j` points into `m + 1` clusters.
    arg: Vec<u32>,
}

/// Optimal partition of `n = prefix.len()` sorted points into `k` contiguous
/// non-empty clusters (`1 <= k <= n`), minimising the total weighted squared error.
///
/// Returns the `k + 1` boundaries `0 = b_0 < b_1 < … < b_k = n` and the cost.
/// Each layer of the programme is filled by divide and conquer over the
/// monotone argmin (the cost is Monge), so the work is O(k · n log n).
pub fn optimal_partition(prefix: &Prefix, k: usize, scratch: &mut KmeansScratch) -> (Vec<usize>, f64) {
    let n = prefix.len();
    assert!(k >= 1 && k <= n, "k-means needs 1 <= k ({k}) <= n ({n})");
    let KmeansScratch { prev, cur, arg } = scratch;
    prev.clear();
    prev.extend((0..=n).map(|j| prefix.cost(0, j)));
    cur.clear();
    cur.resize(n + 1, f64::INFINITY);
    arg.clear();
    arg.resize(k * (n + 1), 0);

    for m in 1..k {
        // Only `j` values that can still be extended to `k` clusters matter.
        let j_hi = n - (k - 1 - m);
        let lo = m + 1;
        let row = &mut arg[m * (n + 1)..(m + 1) * (n + 1)];
        if m + 1 == k {
            // The last layer needs only `j = n`.
            let (best, arg_best) = best_start(prefix, prev, n, m, n - 1);
            cur[n] = best;
            row[n] = arg_best as u32;
        } else {
            fill_layer(prefix, prev, cur, row, lo, j_hi, m, j_hi - 1);
        }
        std::mem::swap(prev, cur);
    }

    let cost = prev[n];
    let mut bounds = vec![0usize; k + 1];
    bounds[k] = n;
    let mut j = n;
    for m in (1..k).rev() {
        j = arg[m * (n + 1) + j] as usize;
        bounds[m] = j;
    }
    (bounds, cost)
}

/// Best start `i` in `[lo, hi]` of the last cluster `[i, j)`.
#[inline(always)]
fn best_start(prefix: &Prefix, prev: &[f64], j: usize, lo: usize, hi: usize) -> (f64, usize) {
    let mut best = f64::INFINITY;
    let mut arg = lo;
    for (i, &p) in prev.iter().enumerate().take(hi + 1).skip(lo) {
        let c = p + prefix.cost(i, j);
        if c < best {
            best = c;
            arg = i;
        }
    }
    (best, arg)
}

/// Fills `cur[j]` for `j in jlo..=jhi` knowing the argmin lies in `[olo, ohi]`.
#[allow(clippy::too_many_arguments)]
fn fill_layer(
    prefix: &Prefix,
    prev: &[f64],
    cur: &mut [f64],
    arg: &mut [u32],
    jlo: usize,
    jhi: usize,
    olo: usize,
    ohi: usize,
) {
    if jlo > jhi {
        return;
    }
    let mid = (jlo + jhi) / 2;
    let (best, a) = best_start(prefix, prev, mid, olo, ohi.min(mid - 1));
    cur[mid] = best;
    arg[mid] = a as u32;
    if mid > jlo {
        fill_layer(prefix, prev, cur, arg, jlo, mid - 1, olo, a);
    }
    fill_layer(prefix, prev, cur, arg, mid + 1, jhi, a, ohi);
}

/// Optimal split of the cluster `[lo, hi)` into `[lo, t)` and `[t, hi)`
/// (both non-empty); needs `hi - lo >= 2`. Returns `(t, cost)`; ties go to
/// the smallest `t` so the result is deterministic.
pub fn optimal_split(prefix: &Prefix, lo: usize, hi: usize) -> (usize, f64) {
    assert!(hi >= lo + 2, "a split needs at least two points");
    let mut best = f64::INFINITY;
    let mut arg = lo + 1;
    for t in lo + 1..hi {
        let c = prefix.cost(lo, t) + prefix.cost(t, hi);
        if c < best {
            best = c;
            arg = t;
        }
    }
    (arg, best)
}
