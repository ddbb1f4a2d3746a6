//! Quantizer throughput (weights/s) on Mixtral-8x7B expert shapes.
//!
//! `cargo bench --bench quantize`. The per-core figure comes from a one-thread
//! rayon pool on a slice of rows; the whole 4096×14336 matrix (Mixtral's down
//! projection, rows of 14336) runs on all cores.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_main};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;

/// Roughly Gaussian weights (sum of four uniforms), like trained projections.
fn weights(rows: usize, cols: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(7);
    (0..rows * cols).map(|_| (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>() * 0.03).collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("quantize");
    g.sample_size(10);
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    // Per core: 64 rows of each Mixtral orientation.
    for (name, cols) in [("down_rows_of_14336", 14336usize), ("gate_up_rows_of_4096", 4096)] {
        let rows = 64;
        let w = weights(rows, cols);
        g.throughput(Throughput::Elements((rows * cols) as u64));
        g.bench_function(BenchmarkId::new("one_core", name), |b| {
            b.iter(|| one.install(|| pw_quant::quantize(black_box(&w), None, rows, cols).unwrap()))
        });
    }
    // The whole 4096×14336 matrix on every core.
    let (rows, cols) = (4096, 14336);
    let w = weights(rows, cols);
    g.throughput(Throughput::Elements((rows * cols) as u64));
    g.bench_function(BenchmarkId::new("all_cores", "4096x14336"), |b| {
        b.iter(|| pw_quant::quantize(black_box(&w), None, rows, cols).unwrap())
    });
    g.finish();
}

// criterion_group! generates an undocumented function.
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::bench);
}
use group::benches;
criterion_main!(benches);
