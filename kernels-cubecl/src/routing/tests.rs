//! Tests of the module's kernels against their CPU references on random inputs (wgpu:
//! Mesa lavapipe in CI, plane size 8, 32 KiB of shared memory).

use cubecl::prelude::ComputeClient;
use cubecl::wgpu::WgpuRuntime;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::testing::{assert_close, client, rand_vec};
use crate::*;

/// An RMSNorm folded into its consumer: the norm's scale is applied after the row's reduction
/// instead of before, and `Σ x²` is summed per lane then across the plane: f32 rounding in
/// another order only.
const NORMED_TOL: f32 = 2e-5;

/// The row gather with and without a fused input RMSNorm (plain and `1 + w`) against
/// [`gather_rows_reference`].
#[test]
fn gather_rows_normed_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(101);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    // Gather with and without the norm: top-3 copies of 5 tokens in a shuffled order; a row
    // narrower than the cube, and one wider (several values per unit, a partial last round).
    for width in [72usize, 3001] {
        let (tokens, k) = (5usize, 3usize);
        let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
        let x = rand_vec(&mut rng, tokens * width, 2.0);
        let g = rand_vec(&mut rng, width, 1.0);
        let idx: Vec<u32> = (0..tokens * k).map(|r| ((r * 7) % tokens) as u32).collect();
        let (xd, gd, id) = (up(&x), up(&g), DeviceArray::from_slice(&client, &idx));
        for off in [None, Some(0.0f32), Some(1.0)] {
            let out = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * k * width);
            let params = up(&[1e-6, off.unwrap_or(0.0)]);
            let norm = off.map(|_| RowNorm { w: &gd, params: &params });
            gather_rows_normed(&client, tokens, k, width, &meta, &xd, norm, &id, &out).unwrap();
            let want = gather_rows_reference(&x, width, &idx, off.map(|o| (g.as_slice(), 1e-6, o)));
            let tol = if off.is_some() { NORMED_TOL } else { 0.0 };
            assert_close(
                &read_f32(&client, &out).unwrap(),
                &want,
                tol,
                &format!("gather width {width}, {off:?}"),
            );
        }
    }
}

/// Routing and the experts' row gather in one launch (`moe_route_gather`, every cube
/// recomputing the routing, its logits inside wider rows) against `moe_route` +
/// `gather_rows_reference`: the same routing
/// outputs bit for bit (weights, positions, gather order, work items, statistics), and the
/// gathered rows exact without a norm, within NORMED_TOL with one.
#[test]
fn moe_route_gather_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(17);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    for shape in [
        MoeShape { experts: 6, k: 2, renormalize: true, hidden: 64, inter: 48 },
        MoeShape { experts: 40, k: 4, renormalize: false, hidden: 300, inter: 16 },
    ] {
        let h = shape.hidden;
        let slot = |rows, cols| PoolSlot { plane_off: 7, lut_off: 3, rows, cols, bits: 4 };
        let slots =
            vec![(slot(2 * shape.inter as u32, h as u32), slot(h as u32, shape.inter as u32)); shape.experts];
        let slot_words = DeviceArray::from_slice(&client, &expert_slot_words(shape, &slots).unwrap());
        let cap = || RouteBuffers::with_capacity(&client, shape, ROUTE_CHUNK, 40).unwrap();
        let (want_bufs, bufs) = (cap(), cap());
        // 40 tokens: past MAX_TOKENS (the routing in a cube of its own, the router's GEMM).
        for tokens in [1usize, 5, 16, 40] {
            let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
            let x = rand_vec(&mut rng, tokens * h, 2.0);
            // Few distinct values, so ties between experts occur.
            let logits: Vec<f32> =
                (0..tokens * shape.experts).map(|_| rng.random_range(0..6) as f32 * 0.5).collect();
            let (xd, ld) = (up(&x), up(&logits));
            let g = rand_vec(&mut rng, h, 1.0);
            let (gd, params) = (up(&g), up(&[1e-5, 1.0]));
            let zeros = || DeviceArray::from_slice(&client, &vec![0u32; 3 * shape.experts]);
            let zf = || up(&vec![0.0; 3 * shape.experts]);
            let (wc, wm, gc, gm) = (zeros(), zf(), zeros(), zf());
            let base = 2 * shape.experts;
            let want_stats = Some(RouteCounters { counts: &wc, mass: &wm, base });
            moe_route_counted(&client, shape, tokens, &meta, &ld, &slot_words, &want_bufs, want_stats)
                .unwrap();
            let idx = read_u32(&client, &want_bufs.gather).unwrap()[..tokens * shape.k].to_vec();
            for norm in [None, Some(RowNorm { w: &gd, params: &params })] {
                let xg = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * shape.k * h);
                let stats = norm.is_none().then_some(RouteCounters { counts: &gc, mass: &gm, base });
                // The logits inside wider rows (beside other outputs of their GEMM).
                let layout = LogitsLayout { stride: shape.experts + 11, offset: 5 };
                let wide: Vec<f32> = (0..tokens * layout.stride)
                    .map(|i| {
                        let (t, c) = (i / layout.stride, i % layout.stride);
                        let e = c.wrapping_sub(layout.offset);
                        if e < shape.experts { logits[t * shape.experts + e] } else { 100.0 }
                    })
                    .collect();
                moe_route_gather(
                    &client,
                    shape,
                    tokens,
                    &meta,
                    (&up(&wide), layout),
                    &slot_words,
                    &bufs,
                    stats,
                    &xd,
                    norm,
                    &xg,
                )
                .unwrap();
                let n = tokens * shape.k;
                for (what, a, b) in
                    [("gather", &want_bufs.gather, &bufs.gather), ("pos", &want_bufs.pos, &bufs.pos)]
                {
                    assert_eq!(
                        read_u32(&client, a).unwrap()[..n],
                        read_u32(&client, b).unwrap()[..n],
                        "{what}"
                    );
                }
                for (a, b) in
                    [(&want_bufs.desc_gate_up, &bufs.desc_gate_up), (&want_bufs.desc_down, &bufs.desc_down)]
                {
                    assert_eq!(
                        live_items(&client, a, &want_bufs),
                        live_items(&client, b, &bufs),
                        "work items"
                    );
                }
                assert_eq!(
                    read_u32(&client, &want_bufs.groups).unwrap(),
                    read_u32(&client, &bufs.groups).unwrap(),
                    "groups"
                );
                assert_eq!(
                    read_f32(&client, &want_bufs.weights).unwrap()[..n],
                    read_f32(&client, &bufs.weights).unwrap()[..n],
                    "weights"
                );
                let want = gather_rows_reference(&x, h, &idx, norm.map(|_| (g.as_slice(), 1e-5, 1.0)));
                let tol = if norm.is_some() { NORMED_TOL } else { 0.0 };
                let what = format!("{shape:?}, {tokens} tokens, norm {}", norm.is_some());
                assert_close(&read_f32(&client, &xg).unwrap(), &want, tol, &what);
            }
            assert_eq!(read_u32(&client, &wc).unwrap(), read_u32(&client, &gc).unwrap(), "statistics counts");
            assert_eq!(read_f32(&client, &wm).unwrap(), read_f32(&client, &gm).unwrap(), "statistics mass");
        }
    }
}

/// Error budget of the router logits folded into the routing launch
/// (`moe_route_gather_router`) against `router_logits_reference`: f32 dot products over
/// `hidden` in another order (planes' partial sums), and the norm's scale applied after them,
/// relative to the largest logit.
const ROUTER_LOGITS_TOL: f32 = 5e-5;

/// The router GEMM, routing and gather in one launch (`moe_route_gather_router`): its logits
/// within ROUTER_LOGITS_TOL of `router_logits_reference`; its routing outputs bit for bit those
/// of `moe_route_counted` over the logits it wrote (weights, positions, gather order, work
/// items, statistics); the gathered rows as `gather_rows_reference` (exact without a norm,
/// NORMED_TOL with one). Mixtral's router shape, and a width that leaves units idle.
#[test]
fn moe_route_gather_router_matches_reference() {
    let client = client();
    let mut rng = StdRng::seed_from_u64(23);
    let up = |v: &[f32]| DeviceArray::from_slice(&client, v);
    let too_big = MoeShape { experts: 128, k: 8, renormalize: true, hidden: 2816, inter: 704 };
    assert!(!router_fusable(&client, too_big), "Gemma-4's router stays a GEMM");
    for shape in [
        MoeShape { experts: 8, k: 2, renormalize: true, hidden: 4096, inter: 64 },
        MoeShape { experts: 6, k: 3, renormalize: false, hidden: 300, inter: 16 },
    ] {
        assert!(router_fusable(&client, shape), "{shape:?}");
        let h = shape.hidden;
        let slot = |rows, cols| PoolSlot { plane_off: 7, lut_off: 3, rows, cols, bits: 4 };
        let slots =
            vec![(slot(2 * shape.inter as u32, h as u32), slot(h as u32, shape.inter as u32)); shape.experts];
        let slot_words = DeviceArray::from_slice(&client, &expert_slot_words(shape, &slots).unwrap());
        let cap = || RouteBuffers::with_capacity(&client, shape, ROUTE_CHUNK, 40).unwrap();
        let (want_bufs, bufs) = (cap(), cap());
        let router: Vec<half::f16> =
            (0..shape.experts * h).map(|_| half::f16::from_f32(rng.random_range(-0.1f32..0.1))).collect();
        let rd = DeviceArray::from_slice(&client, &router);
        // 40 tokens: past MAX_TOKENS (the routing in a cube of its own, the router's GEMM).
        for tokens in [1usize, 5, 16, 40] {
            let meta = DeviceArray::from_slice(&client, &[tokens as u32]);
            let x = rand_vec(&mut rng, tokens * h, 2.0);
            let xd = up(&x);
            let g = rand_vec(&mut rng, h, 1.0);
            let (gd, params) = (up(&g), up(&[1e-5, 1.0]));
            for norm in [None, Some(RowNorm { w: &gd, params: &params })] {
                let what = format!("{shape:?}, {tokens} tokens, norm {}", norm.is_some());
                let zeros = || DeviceArray::from_slice(&client, &vec![0u32; 2 * shape.experts]);
                let zf = || up(&vec![0.0; 2 * shape.experts]);
                let (wc, wm, gc, gm) = (zeros(), zf(), zeros(), zf());
                let base = shape.experts;
                let stats = Some(RouteCounters { counts: &gc, mass: &gm, base });
                let xg = DeviceArray::empty::<WgpuRuntime, f32>(&client, tokens * shape.k * h);
                let ld = up(&vec![f32::NAN; tokens * shape.experts]);
                moe_route_gather_router(
                    &client,
                    shape,
                    tokens,
                    &meta,
                    (&rd, &ld),
                    &slot_words,
                    &bufs,
                    stats,
                    &xd,
                    norm,
                    &xg,
                )
                .unwrap();
                let logits = read_f32(&client, &ld).unwrap();
                let nref = norm.map(|_| (g.as_slice(), 1e-5, 1.0));
                let want = router_logits_reference(&x, &router, h, nref);
                assert_close(&logits, &want, ROUTER_LOGITS_TOL, &format!("logits of {what}"));
                // The routing of the logits the kernel computed (every cube's are the same).
                let want_stats = Some(RouteCounters { counts: &wc, mass: &wm, base });
                moe_route_counted(&client, shape, tokens, &meta, &ld, &slot_words, &want_bufs, want_stats)
                    .unwrap();
                let n = tokens * shape.k;
                for (w, a, b) in
                    [("gather", &want_bufs.gather, &bufs.gather), ("pos", &want_bufs.pos, &bufs.pos)]
                {
                    assert_eq!(
                        read_u32(&client, a).unwrap()[..n],
                        read_u32(&client, b).unwrap()[..n],
                        "{w}: {what}"
                    );
                }
                for (a, b) in
                    [(&want_bufs.desc_gate_up, &bufs.desc_gate_up), (&want_bufs.desc_down, &bufs.desc_down)]
                {
                    assert_eq!(live_items(&client, a, &want_bufs), live_items(&client, b, &bufs), "items");
                }
                assert_eq!(
                    read_f32(&client, &want_bufs.weights).unwrap()[..n],
                    read_f32(&client, &bufs.weights).unwrap()[..n],
                    "weights: {what}"
                );
                assert_eq!(read_u32(&client, &wc).unwrap(), read_u32(&client, &gc).unwrap(), "counts");
                assert_eq!(read_f32(&client, &wm).unwrap(), read_f32(&client, &gm).unwrap(), "mass");
                let idx = read_u32(&client, &want_bufs.gather).unwrap()[..n].to_vec();
                let want = gather_rows_reference(&x, h, &idx, nref);
                let tol = if norm.is_some() { NORMED_TOL } else { 0.0 };
                assert_close(&read_f32(&client, &xg).unwrap(), &want, tol, &what);
            }
        }
    }
}

/// CPU reference of the grouping of a step's `choices` (`[tokens, k]` experts): each expert's
/// choices get consecutive gathered rows in token order, experts in order. Returns the gather
/// (row → token), the positions (choice → row) and the groups table (first row, count).
fn grouping_reference(shape: MoeShape, choices: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let (n, k) = (choices.len(), shape.k);
    let (mut gather, mut pos, mut groups) = (vec![0u32; n], vec![0u32; n], vec![]);
    let mut row = 0u32;
    for e in 0..shape.experts as u32 {
        let first = row;
        for (i, _) in choices.iter().enumerate().filter(|(_, c)| **c == e) {
            gather[row as usize] = (i / k) as u32;
            pos[i] = row;
            row += 1;
        }
        groups.extend([first, row - first]);
    }
    (gather, pos, groups)
}

/// The live work items of a routing's table and the header's count (the items past them are
/// not written).
fn live_items(client: &ComputeClient<WgpuRuntime>, desc: &DeviceArray, bufs: &RouteBuffers) -> Vec<u32> {
    let words = read_u32(client, desc).unwrap();
    let items = bufs.chunks() * bufs.groups.len / 2;
    let live = words[items * DESC_WORDS] as usize;
    assert!(live <= items, "{live} live items of {items}");
    [&words[..live * DESC_WORDS], &[live as u32]].concat()
}

/// CPU reference of the work-item tables (gate_up, down) of a grouping (see
/// `moe_route_kernel`): per expert in order, items of at most `chunk` rows, then the count of
/// those live items (as [`live_items`] reads a table).
fn work_items_reference(shape: MoeShape, slots: &[u32], groups: &[u32], chunk: usize) -> [Vec<u32>; 2] {
    let (h, i2) = (shape.hidden as u32, 2 * shape.inter as u32);
    let (mut gu, mut dn) = (vec![], vec![]);
    let mut live = 0;
    for e in 0..shape.experts {
        let (first, count) = (groups[2 * e], groups[2 * e + 1]);
        for c in (0..count).step_by(chunk) {
            let (f, n) = (first + c, (count - c).min(chunk as u32));
            let s = &slots[6 * e..][..6];
            gu.extend([s[0], s[1], i2, h, s[2], f * h, f * i2, n]);
            dn.extend([s[3], s[4], h, i2 / 2, s[5], f * i2, f * h, n]);
            live += 1;
        }
    }
    gu.push(live);
    dn.push(live);
    [gu, dn]
}

/// Steps past `ROUTE_SHARED_CHOICES` choices route in two launches (selection, then grouping):
/// their weights, gather order, positions, groups, work items and statistics equal the CPU
/// references (weights within 1e-6: the same f32 softmax); below it, the two-launch path gives
/// the one-cube kernel's outputs bit for bit. Few distinct logits, so ties between experts occur;
/// 2, 40 and 128 experts.
#[test]
fn moe_route_in_two_launches_matches_reference() {
    use super::route::route_two_launches;
    let client = client();
    let mut rng = StdRng::seed_from_u64(29);
    let up_f = |v: &[f32]| DeviceArray::from_slice(&client, v);
    let up_u = |v: &[u32]| DeviceArray::from_slice(&client, v);
    for shape in [
        MoeShape { experts: 2, k: 2, renormalize: true, hidden: 64, inter: 48 },
        MoeShape { experts: 40, k: 4, renormalize: false, hidden: 300, inter: 16 },
        MoeShape { experts: 128, k: 8, renormalize: true, hidden: 32, inter: 8 },
    ] {
        let big = ROUTE_SHARED_CHOICES / shape.k + 37;
        let slot =
            |rows, cols, e: u32| PoolSlot { plane_off: 7 + e, lut_off: 3 * e, rows, cols, bits: 3 + e % 6 };
        let h = shape.hidden as u32;
        let slots: Vec<_> = (0..shape.experts as u32)
            .map(|e| (slot(2 * shape.inter as u32, h, e), slot(h, shape.inter as u32, e + 1)))
            .collect();
        let words = expert_slot_words(shape, &slots).unwrap();
        let slot_words = up_u(&words);
        let bufs = || RouteBuffers::with_capacity(&client, shape, ROUTE_CHUNK, big).unwrap();
        let (one, two) = (bufs(), bufs());
        let layout = LogitsLayout { stride: shape.experts, offset: 0 };
        for tokens in [1usize, 5, 40, big] {
            let meta = up_u(&[tokens as u32]);
            let logits: Vec<f32> =
                (0..tokens * shape.experts).map(|_| rng.random_range(0..6) as f32 * 0.5).collect();
            let ld = up_f(&logits);
            let zeros = || (up_u(&vec![0u32; 2 * shape.experts]), up_f(&vec![0.0; 2 * shape.experts]));
            let ((c1, m1), (c2, m2)) = (zeros(), zeros());
            let st = |c, m| Some(RouteCounters { counts: c, mass: m, base: shape.experts });
            route_two_launches(&client, shape, tokens, &meta, (&ld, layout), &slot_words, &two, st(&c2, &m2));
            let n = tokens * shape.k;
            let what = format!("{shape:?}, {tokens} tokens");
            let read = |a: &DeviceArray, len: usize| read_u32(&client, a).unwrap()[..len].to_vec();
            if tokens * shape.k <= ROUTE_SHARED_CHOICES {
                moe_route_counted(&client, shape, tokens, &meta, &ld, &slot_words, &one, st(&c1, &m1))
                    .unwrap();
                for (name, a, b, len) in [
                    ("gather", &one.gather, &two.gather, n),
                    ("pos", &one.pos, &two.pos, n),
                    ("groups", &one.groups, &two.groups, 2 * shape.experts),
                    ("counts", &c1, &c2, 2 * shape.experts),
                ] {
                    assert_eq!(read(a, len), read(b, len), "{name}, {what}");
                }
                for (a, b) in [(&one.desc_gate_up, &two.desc_gate_up), (&one.desc_down, &two.desc_down)] {
                    assert_eq!(live_items(&client, a, &one), live_items(&client, b, &two), "items, {what}");
                }
                for (name, a, b) in [("weights", &one.weights, &two.weights), ("mass", &m1, &m2)] {
                    let len = if name == "weights" { n } else { 2 * shape.experts };
                    let (x, y) = (read_f32(&client, a).unwrap(), read_f32(&client, b).unwrap());
                    assert_eq!(x[..len], y[..len], "{name}, {what}");
                }
            }
            let (sel, wts) = route_reference(shape, &logits);
            assert_close(&read_f32(&client, &two.weights).unwrap()[..n], &wts, 1e-6, &what);
            let (gather, pos, groups) = grouping_reference(shape, &sel);
            assert_eq!(read(&two.gather, n), gather, "gather, {what}");
            assert_eq!(read(&two.pos, n), pos, "pos, {what}");
            assert_eq!(read(&two.groups, 2 * shape.experts), groups, "groups, {what}");
            let [gu, dn] = work_items_reference(shape, &words, &groups, ROUTE_CHUNK);
            assert_eq!(live_items(&client, &two.desc_gate_up, &two), gu, "gate_up items, {what}");
            assert_eq!(live_items(&client, &two.desc_down, &two), dn, "down items, {what}");
            let (mut counts, mut mass) = (vec![0u32; 2 * shape.experts], vec![0f32; 2 * shape.experts]);
            let choices: Vec<usize> = sel.iter().map(|&e| e as usize).collect();
            route_stats_reference(shape.experts, 1, &choices, &wts, &mut counts, &mut mass);
            assert_eq!(read(&c2, 2 * shape.experts), counts, "statistics counts, {what}");
            assert_close(&read_f32(&client, &m2).unwrap(), &mass, 1e-5, &format!("statistics mass, {what}"));
        }
    }
}
