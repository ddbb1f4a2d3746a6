//! Reductions over a plane (warp) and over a cube, and the unrolled row loads the row kernels
//! share.

use cubecl::prelude::*;

/// `plane_sum` of a plane of `plane_size` lanes (a power of two) as `log2(plane_size)` unrolled
/// XOR shuffles. CubeCL lowers `plane_sum` on CUDA to a loop up to the runtime warp size, a
/// compare, a branch and a shift around each shuffle, and independent sums cannot overlap. The
/// same additions in the same order, so the same result.
#[cube]
pub(crate) fn warp_sum(v: f32, #[comptime] plane_size: usize) -> f32 {
    let mut s = v;
    let mut m = 1u32;
    #[unroll]
    for _ in 0..comptime![plane_size.trailing_zeros() as usize] {
        s += plane_shuffle_xor(s, m);
        m *= 2u32;
    }
    s
}

/// `plane_max` as the unrolled XOR butterfly of [`warp_sum`] (every lane gets the maximum).
#[cube]
pub(crate) fn warp_max(v: f32, #[comptime] plane_size: usize) -> f32 {
    let mut s = v;
    let mut m = 1u32;
    #[unroll]
    for _ in 0..comptime![plane_size.trailing_zeros() as usize] {
        s = max(s, plane_shuffle_xor(s, m));
        m *= 2u32;
    }
    s
}

/// The plane's best `(value, index)` pair, to every lane: the largest value, the lowest index
/// among lanes holding it (a maximum then a minimum over those lanes, as one XOR butterfly over
/// the pairs: CubeCL's `plane_max` / `plane_min` are loops with a branch around each shuffle
/// on CUDA). Lanes with nothing to offer pass their lowest value.
#[cube]
pub(crate) fn warp_arg_max(v: f32, i: u32, #[comptime] plane_size: usize) -> (f32, u32) {
    let mut bv = v;
    let mut bi = i;
    let mut m = 1u32;
    #[unroll]
    for _ in 0..comptime![plane_size.trailing_zeros() as usize] {
        let ov = plane_shuffle_xor(bv, m);
        let oi = plane_shuffle_xor(bi, m);
        let take = ov > bv || (ov == bv && oi < bi);
        bv = select(take, ov, bv);
        bi = select(take, oi, bi);
        m *= 2u32;
    }
    (bv, bi)
}

/// Sum of `v` over all `units` units of the cube, returned to every unit: a plane reduction,
/// then the planes' partial sums through shared memory.
#[cube]
pub fn cube_sum(v: f32, #[comptime] units: usize, #[comptime] plane_size: usize) -> f32 {
    let mut total = warp_sum(v, plane_size);
    if comptime![units > plane_size] {
        let planes = comptime![units / plane_size];
        let mut sh = SharedMemory::<f32>::new(planes);
        let lane = UNIT_POS as usize % plane_size;
        if lane == 0 {
            sh[UNIT_POS as usize / plane_size] = total;
        }
        sync_cube();
        let mut t = 0.0f32;
        #[unroll]
        for p in 0..planes {
            t += sh[p];
        }
        // The next reduction may reuse the memory.
        sync_cube();
        total = t;
    }
    total
}

/// Loads this unit's columns `UNIT_POS + i · units` of the row at `base` into `xv` (zeros past
/// `hidden`), all loads unrolled so they are in flight together; returns their sum of squares.
#[cube]
pub fn load_row(
    x: &Array<f32>,
    base: usize,
    xv: &mut Array<f32>,
    #[comptime] hidden: usize,
    #[comptime] units: usize,
) -> f32 {
    let u = UNIT_POS as usize;
    let mut ss = 0.0f32;
    #[unroll]
    for i in 0..comptime![hidden.div_ceil(units)] {
        let c = u + i * units;
        let mut v = 0.0f32;
        if c < hidden {
            v = x[base + c];
        }
        xv[i] = v;
        ss += v * v;
    }
    ss
}
