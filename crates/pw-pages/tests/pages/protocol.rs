//! The commit protocol on host arenas, with transfers that finish only when
//! the test says so.

use crate::common::*;
use kernels_cubecl::{Activation, PoolImage, ap_gemm_reference};
use pw_format::{ApBlock, BlockKind, BlockMeta, Checkpoint, CheckpointWriter};
use pw_pages::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

type Table = PagedWeights<ManualMover<HostPool>>;

/// A table whose arenas hold every page at `arena_bits` plus one page at 8
/// bits: a raising holds its new LUT (and, when relocating, its new planes)
/// beside the committed ones until it commits, so exact-fit arenas would
/// defer it.
fn table(blocks: Vec<(String, PageKey, ApBlock)>, budget: u64, arena_bits: u8) -> Table {
    let (_, words, luts) = size_at(&blocks, arena_bits);
    let (_, slack_words, slack_luts) = size_at(&blocks[..1], 8);
    let (words, luts) = (words + slack_words, luts + slack_luts);
    PagedWeights::new(blocks, Accountant::new(budget), ManualMover::new(HostPool::new(words, luts))).unwrap()
}

/// What kernels can see: the last published table, and the arena contents it
/// points at, which must be exactly the committed planes and LUT of each page.
fn check_visible(t: &Table) {
    t.audit().unwrap_or_else(|e| panic!("audit: {e}"));
    let host = &t.mover().inner;
    let usage = t.usage();
    assert!(usage.weights + usage.kv <= usage.budget, "over budget: {usage:?}");
    assert_eq!(usage.weights, t.held_bytes() as u64, "bytes accounted != bytes held");
    if host.publishes == 0 {
        assert!(t.table().iter().all(|s| s.bits == 0), "state committed but never published");
        return;
    }
    assert_eq!(host.table, t.table(), "published table is not the committed one");
    for (i, slot) in host.table.iter().enumerate() {
        let b = slot.bits as u8;
        assert_eq!(b, t.info(PageId(i)).unwrap().committed);
        if b == 0 {
            continue;
        }
        let parent = t.parent(PageId(i)).unwrap();
        let n = parent.rows * parent.words_per_row() * b as usize;
        let planes = &host.image.planes[slot.plane_off as usize..][..n];
        assert!(
            planes == &parent.planes[..n],
            "page {i}: visible planes are not planes 0..{b} of its parent"
        );
        let lut = parent.lut(b);
        let got = &host.image.luts[slot.lut_off as usize..][..lut.len()];
        assert!(
            got.iter().zip(lut).all(|(a, b)| a.to_bits() == b.to_bits()),
            "page {i}: visible LUT is not its {b}-bit LUT"
        );
    }
}

#[test]
fn random_sequences_keep_the_visible_state_committed_and_within_budget() {
    let blocks = moe_blocks(2, 3, 11);
    let (bytes8, _, _) = size_at(&blocks, 8);
    let (bytes3, _, _) = size_at(&blocks, 3);
    let mut deferred_budget = 0;
    let mut raised = 0;
    let mut lowered = 0;
    let mut reclaimed = 0;
    let mut relocated = 0;
    let mut relocations_seen = false;
    for seed in 0..24u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        // Budgets from "everything fits at 3 bits" to "everything fits at 8".
        let budget = rng.random_range(bytes3 as u64..=bytes8 as u64 + 4096);
        // Arenas a bit larger than the budget share, so fragmentation can bite too.
        let mut t = table(blocks.clone(), budget, if seed % 2 == 0 { 8 } else { 6 });
        let ids: Vec<PageId> = t.ids().collect();
        t.set_desired_all(3);
        t.boundary().unwrap();
        t.mover_mut().complete_all().unwrap();
        t.boundary().unwrap();
        check_visible(&t);
        assert!(t.table().iter().all(|s| s.bits == 3), "seed {seed}: not all resident at 3 bits");
        let mut kv: Vec<Lease> = Vec::new();
        for step in 0..300 {
            let before = t.table().to_vec();
            let mut is_boundary = false;
            match rng.random_range(0..100) {
                0..=39 => {
                    let id = ids[rng.random_range(0..ids.len())];
                    t.set_desired(id, rng.random_range(3..=8)).unwrap();
                }
                40..=64 => {
                    let r = t.boundary().unwrap();
                    is_boundary = true;
                    raised += r.raised.len();
                    lowered += r.lowered.len();
                    reclaimed += r.reclaimed.len();
                    relocated += r.relocated.len();
                    for d in &r.deferred {
                        if let DeferReason::Budget(e) = &d.reason {
                            deferred_budget += 1;
                            assert!(e.requested > e.free, "refused although it fitted: {e}");
                        }
                    }
                }
                65..=84 => {
                    let m = t.mover_mut();
                    let fl = m.in_flight();
                    if !fl.is_empty() {
                        m.complete(fl[rng.random_range(0..fl.len())]).unwrap();
                    }
                }
                85..=92 => {
                    let bytes = rng.random_range(1..=budget / 8);
                    match t.accountant().lease(Use::Kv, bytes) {
                        Ok(l) => kv.push(l),
                        Err(e) => assert!(bytes > t.usage().free, "KV lease refused although it fitted: {e}"),
                    }
                }
                _ => {
                    if !kv.is_empty() {
                        kv.swap_remove(rng.random_range(0..kv.len()));
                    }
                }
            }
            if !is_boundary {
                assert_eq!(
                    t.table(),
                    &before[..],
                    "seed {seed} step {step}: table changed outside a boundary"
                );
            }
            check_visible(&t);
            // A relocation shows as a plane offset that moved while bits rose.
            for (a, b) in before.iter().zip(t.table()) {
                if a.bits > 0 && b.bits > a.bits && a.plane_off != b.plane_off {
                    relocations_seen = true;
                }
            }
        }
        // Everything settles: with the KV cache gone and transfers finishing,
        // the table reaches a state where every desire is committed or
        // deferred with a reason, and no transfer is left.
        drop(kv);
        let mut r = t.boundary().unwrap();
        for _ in 0..50 {
            if r.started.is_empty() && r.relocating.is_empty() && t.mover().in_flight().is_empty() {
                break;
            }
            t.mover_mut().complete_all().unwrap();
            r = t.boundary().unwrap();
            relocated += r.relocated.len();
        }
        assert!(t.mover().in_flight().is_empty(), "seed {seed}: does not settle");
        check_visible(&t);
        for id in t.ids() {
            let info = t.info(id).unwrap();
            if info.desired != info.committed {
                assert!(
                    r.deferred.iter().any(|d| d.page == id),
                    "seed {seed}: {} wants {} has {} and was not deferred",
                    info.name,
                    info.desired,
                    info.committed
                );
            }
        }
    }
    // The sequences exercised every path.
    assert!(raised > 100 && lowered > 100, "raised {raised} lowered {lowered}");
    assert!(deferred_budget > 0, "no raising was ever refused for budget");
    assert!(reclaimed > 0, "no cancelled raising was reclaimed");
    assert!(relocations_seen, "no raising relocated a page");
    assert!(relocated > 0, "no compaction move was committed");
}

#[test]
fn lowering_commits_at_once_and_raising_only_after_its_transfer() {
    let blocks = moe_blocks(1, 2, 3);
    let mut t = table(blocks, u64::MAX / 2, 8);
    let id = t.page(PageKey { layer: 0, expert: 1, kind: BlockKind::Down }).unwrap();
    assert!(!t.copies_pending());
    t.set_desired_all(6);
    assert!(t.copies_pending());
    let r = t.boundary().unwrap();
    assert_eq!(r.started.len(), 4);
    assert!(!t.copies_pending(), "the raisings are in flight: nothing to copy until they finish");
    assert!(r.raised.is_empty() && !r.published, "committed before the transfer finished");
    // The boundary's host time by part: the starts, the mover's share within them.
    let times = r.times;
    assert!(times.start >= times.start_mover && times.start_mover > Duration::ZERO, "{times:?}");
    assert_eq!(t.plane_location(id, 0).unwrap(), Location::InTransfer);
    assert_eq!(t.lut_location(id, 6).unwrap(), Location::InTransfer);
    // Boundaries never wait.
    let r = t.boundary().unwrap();
    assert!(r.raised.is_empty());
    assert_eq!(t.info(id).unwrap().committed, 0);
    t.mover_mut().complete_all().unwrap();
    let r = t.boundary().unwrap();
    assert_eq!(r.raised.len(), 4);
    assert!(r.published);
    assert!(r.times.finished > Duration::ZERO && r.times.publish > Duration::ZERO, "{:?}", r.times);
    assert_eq!(t.info(id).unwrap().committed, 6);
    assert_eq!(t.plane_location(id, 5).unwrap(), Location::Gpu);
    assert_eq!(t.plane_location(id, 6).unwrap(), Location::Host);
    check_visible(&t);

    assert!(!t.copies_pending());
    let before = t.usage().weights;
    t.set_desired(id, 4).unwrap();
    assert!(t.copies_pending(), "a lowering writes its LUT");
    let r = t.boundary().unwrap();
    assert_eq!(r.lowered, vec![id]);
    assert!(!t.copies_pending());
    assert!(r.times.lower > Duration::ZERO, "{:?}", r.times);
    assert_eq!(t.info(id).unwrap().committed, 4);
    let (p6, l6) = t.parent(id).unwrap().bytes_at(6);
    let (p4, l4) = t.parent(id).unwrap().bytes_at(4);
    assert_eq!(before - t.usage().weights, (p6 + l6 - p4 - l4) as u64, "lowering freed the wrong bytes");
    assert_eq!(t.lut_location(id, 4).unwrap(), Location::Gpu);
    assert_eq!(t.lut_location(id, 6).unwrap(), Location::Host);
    check_visible(&t);

    // Raise, then lower below the committed bits while the raise is in flight:
    // the raise is cancelled and its memory reclaimed when it finishes.
    t.set_desired(id, 8).unwrap();
    t.boundary().unwrap();
    assert_eq!(t.info(id).unwrap().raising_to, Some(8));
    t.set_desired(id, 3).unwrap();
    assert!(t.copies_pending(), "a lowering under a raising in flight");
    let r = t.boundary().unwrap();
    assert_eq!(r.lowered, vec![id]);
    assert_eq!(t.info(id).unwrap().raising_to, None);
    check_visible(&t);
    t.set_desired(id, 5).unwrap();
    assert!(t.copies_pending(), "the cancelled transfer may have finished: a raising may start");
    let r = t.boundary().unwrap();
    assert_eq!(r.deferred[0].reason, DeferReason::InFlight);
    t.mover_mut().complete_all().unwrap();
    let r = t.boundary().unwrap();
    assert_eq!(r.reclaimed, vec![id]);
    assert_eq!(r.started, vec![id]);
    check_visible(&t);
}

#[test]
fn a_raising_that_does_not_fit_is_deferred_with_the_reason() {
    let blocks = moe_blocks(1, 2, 5);
    let (bytes3, _, _) = size_at(&blocks, 3);
    let mut t =
        PagedWeights::new(blocks, Accountant::new(bytes3 as u64 + 100), HostPool::new(1 << 16, 1 << 16))
            .unwrap();
    t.set_desired_all(3);
    t.boundary().unwrap();
    assert_eq!(t.usage().weights, bytes3 as u64);
    let id = PageId(0);
    t.set_desired(id, 8).unwrap();
    let r = t.boundary().unwrap();
    assert_eq!(r.deferred.len(), 1);
    let DeferReason::Budget(e) = &r.deferred[0].reason else { panic!("{:?}", r.deferred) };
    assert_eq!(e.free, 100);
    assert!(r.deferred[0].reason.to_string().contains("exceed the budget"), "{}", r.deferred[0].reason);
    assert_eq!(t.info(id).unwrap().committed, 3);
    // Lowering others gives room, and the raise goes through.
    for other in 1..t.len() {
        t.set_desired(PageId(other), 3).unwrap();
    }
    let (bytes8, _, _) = size_at(&moe_blocks(1, 2, 5), 8);
    t.accountant().set_budget(bytes8 as u64).unwrap();
    let r = t.boundary().unwrap();
    assert_eq!(r.raised, vec![id]);
    // The KV cache draws from the same budget.
    let free = t.usage().free;
    let kv = t.accountant().lease_kv_blocks(free / 64, 64).unwrap();
    t.set_desired(PageId(1), 8).unwrap();
    assert!(matches!(t.boundary().unwrap().deferred[0].reason, DeferReason::Budget(_)));
    drop(kv);
    assert_eq!(t.boundary().unwrap().raised, vec![PageId(1)]);
}

#[test]
fn a_full_arena_defers_with_fragmentation_and_relocates_when_it_can() {
    let blocks = moe_blocks(1, 1, 8);
    let pw_gu = blocks[0].2.rows * blocks[0].2.words_per_row();
    let pw_down = blocks[1].2.rows * blocks[1].2.words_per_row();
    // Room for both pages at 4 bits and nothing more.
    let words = 4 * (pw_gu + pw_down);
    let mut t = PagedWeights::new(blocks, Accountant::new(1 << 30), HostPool::new(words, 1 << 16)).unwrap();
    t.set_desired_all(4);
    t.boundary().unwrap();
    // gate_up sits first, down right after it: gate_up cannot grow in place,
    // nor relocate (no run of 5 planes).
    t.set_desired(PageId(0), 5).unwrap();
    let r = t.boundary().unwrap();
    let DeferReason::Fragmented { arena, needed, .. } = r.deferred[0].reason else { panic!("{r:?}") };
    assert_eq!((arena, needed), ("plane", 5 * pw_gu));
    // Lowering down to 3 frees its last plane, but growing gate_up in place is
    // still blocked by down's planes 0..3; lowering gate_up to 3 and raising
    // down is in place.
    t.set_desired(PageId(0), 3).unwrap();
    t.set_desired(PageId(1), 3).unwrap();
    t.boundary().unwrap();
    let off_down = t.table()[1].plane_off;
    t.set_desired(PageId(1), 4).unwrap();
    t.boundary().unwrap();
    assert_eq!(t.table()[1].plane_off, off_down, "down should have grown in place");
    assert_eq!(t.table()[1].bits, 4);
    t.audit().unwrap();
}

#[test]
fn raise_lower_raise_restores_bit_identical_outputs_on_the_cpu_reference() {
    let blocks = moe_blocks(1, 3, 13);
    let mut t = table(blocks, u64::MAX / 2, 8);
    let mut rng = StdRng::seed_from_u64(1);
    t.set_desired_all(8);
    t.boundary().unwrap();
    t.mover_mut().complete_all().unwrap();
    t.boundary().unwrap();
    let groups: Vec<Group> = (0..3)
        .map(|e| Group {
            expert: e,
            x_off: (e * 2 * HIDDEN) as u32,
            y_off: (e * 2 * 2 * INTER) as u32,
            tokens: 2,
        })
        .collect();
    let x: Vec<f32> = (0..6 * HIDDEN).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let run = |t: &Table| {
        let items = t.items(0, BlockKind::GateUp, &groups).unwrap();
        let mut y = vec![0f32; 6 * 2 * INTER];
        ap_gemm_reference(&t.mover().inner.image, &items, &x, &mut y, Activation::None);
        y
    };
    let y8 = run(&t);
    for low in [3u8, 5] {
        for e in 0..3 {
            t.set_desired(t.page(PageKey { layer: 0, expert: e, kind: BlockKind::GateUp }).unwrap(), low)
                .unwrap();
        }
        t.boundary().unwrap();
        let ylow = run(&t);
        // The lowered output is that of the block at `low` bits.
        let mut fresh = PoolImage::default();
        let items: Vec<_> = (0..3)
            .map(|e| {
                fresh.push(t.parent(PageId(2 * e)).unwrap(), low).item(groups[e].x_off, groups[e].y_off, 2)
            })
            .collect();
        let mut want = vec![0f32; ylow.len()];
        ap_gemm_reference(&fresh, &items, &x, &mut want, Activation::None);
        assert_eq!(ylow, want, "lowered to {low}");
        assert_ne!(ylow, y8);
        t.set_desired_all(8);
        t.boundary().unwrap();
        assert_eq!(run(&t), ylow, "committed before the raising finished");
        // The arenas' slack holds one raising page's new LUT beside its old
        // one, so the three raisings go through one after the other.
        let mut raised = 0;
        for _ in 0..6 {
            t.mover_mut().complete_all().unwrap();
            let r = t.boundary().unwrap();
            raised += r.raised.len();
            assert!(r.deferred.iter().all(|d| matches!(d.reason, DeferReason::Fragmented { .. })), "{r:?}");
            check_visible(&t);
        }
        assert_eq!(raised, 3);
        let back = run(&t);
        assert!(
            back.iter().zip(&y8).all(|(a, b)| a.to_bits() == b.to_bits()),
            "8 → {low} → 8 changed outputs"
        );
    }
}

#[test]
fn builds_from_a_checkpoint_and_reports_bad_requests_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = moe_blocks(2, 2, 21);
    let mut w = CheckpointWriter::create(dir.path()).unwrap();
    for (name, key, b) in &blocks {
        let meta = BlockMeta {
            name: name.clone(),
            layer: key.layer,
            expert: key.expert,
            kind: key.kind,
            sources: vec![],
        };
        w.add_block(meta, b).unwrap();
    }
    w.finish().unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let (words, luts) = PagedWeights::<HostPool>::arena_size_for(&ck, 8);
    let (bytes8, w8, l8) = size_at(&blocks, 8);
    assert_eq!((words, luts), (w8, l8));
    let mut t =
        PagedWeights::from_checkpoint(&ck, Accountant::new(bytes8 as u64), HostPool::new(words, luts))
            .unwrap();
    assert_eq!(t.len(), 8);
    let key = PageKey { layer: 1, expert: 0, kind: BlockKind::Down };
    let id = t.page(key).unwrap();
    assert_eq!(t.parent(id).unwrap(), &blocks[5].2);
    let e = t.set_desired(id, 9).unwrap_err().to_string();
    assert!(e.contains("model.layers.1.experts.0.Down") && e.contains("9 bits"), "{e}");
    let e = t.page(PageKey { layer: 3, ..key }).unwrap_err().to_string();
    assert!(e.contains("layer 3 expert 0 down"), "{e}");
    let g = [Group { expert: 0, x_off: 0, y_off: 0, tokens: 1 }];
    let e = t.items(1, BlockKind::Down, &g).unwrap_err().to_string();
    assert!(e.contains("not resident"), "{e}");
    // Everything fits at 8 bits exactly.
    t.set_desired_all(8);
    let r = t.boundary().unwrap();
    assert_eq!(r.raised.len(), 8);
    assert_eq!(t.usage().free, 0);
    assert_eq!(t.items(1, BlockKind::Down, &g).unwrap()[0].bits, 8);
    let dup = vec![blocks[0].clone(), blocks[0].clone()];
    let e = PagedWeights::new(dup, Accountant::new(1), HostPool::new(1, 1)).err().unwrap().to_string();
    assert!(e.contains("appears twice"), "{e}");
}

/// A mover whose copies leave the kernels' queue: its first copy of a boundary waits for that
/// queue unless the caller already did ([`Mover::queue_drained`]).
struct QueueMover {
    inner: HostPool,
    drained: bool,
    /// Waits of its own.
    waits: usize,
}

impl QueueMover {
    fn wait(&mut self) {
        if !self.drained {
            self.waits += 1;
            self.drained = true;
        }
    }
}

impl Mover for QueueMover {
    fn capacity(&self) -> (usize, usize) {
        self.inner.capacity()
    }
    fn write_ordered(&mut self, writes: &[Write<'_>]) -> Result<(), MoveError> {
        self.wait();
        self.inner.write_ordered(writes)
    }
    fn start(&mut self, writes: &[Write<'_>]) -> Result<Ticket, MoveError> {
        self.wait();
        self.inner.start(writes)
    }
    fn finished(&mut self, ticket: Ticket) -> Result<bool, MoveError> {
        self.inner.finished(ticket)
    }
    fn publish(&mut self, table: &[kernels_cubecl::PoolSlot]) -> Result<(), MoveError> {
        self.inner.publish(table)
    }
    fn end_boundary(&mut self) -> Result<(), MoveError> {
        self.drained = false;
        Ok(())
    }
    fn waits_for_queue(&self) -> bool {
        true
    }
    fn queue_drained(&mut self) {
        self.drained = true;
    }
}

/// Several tables' boundaries wait for the kernels' queue once, and only when one of them
/// copies; each table on its own waits once per boundary that copies.
#[test]
fn boundaries_of_several_tables_wait_for_the_queue_once() {
    let layer = |l: usize| -> PagedWeights<QueueMover> {
        let blocks = moe_blocks(1, 2, 10 + l as u64);
        let (_, words, luts) = size_at(&blocks, 8);
        let (_, slack_words, slack_luts) = size_at(&blocks[..1], 8);
        let mover = QueueMover {
            inner: HostPool::new(words + slack_words, luts + slack_luts),
            drained: false,
            waits: 0,
        };
        PagedWeights::new(blocks, Accountant::new(u64::MAX / 2), mover).unwrap()
    };
    let mut tables: Vec<_> = (0..3).map(layer).collect();
    let drains = std::cell::Cell::new(0);
    let drain = || {
        drains.set(drains.get() + 1);
        Ok(())
    };
    for t in &mut tables {
        t.set_desired_all(8);
    }
    let (reports, _) = boundaries(&mut tables, drain).unwrap();
    // Host transfers finish at once: the raisings start and commit in this boundary.
    assert!(reports.iter().all(|r| r.started.len() == 4 && r.raised.len() == 4));
    assert_eq!(drains.get(), 1);
    assert!(tables.iter().all(|t| t.mover().waits == 0));
    // Nothing to copy: no wait.
    let (reports, waited) = boundaries(&mut tables, || Err(MoveError("no copy, no wait".into()))).unwrap();
    assert!(reports.iter().all(|r| r.started.is_empty() && r.lowered.is_empty()));
    assert_eq!(waited, Duration::ZERO);
    // Lowerings in two tables: one wait for both.
    for t in &mut tables[1..] {
        t.set_desired_all(5);
    }
    let (reports, _) = boundaries(&mut tables, drain).unwrap();
    assert_eq!((reports[0].lowered.len(), reports[1].lowered.len(), reports[2].lowered.len()), (0, 4, 4));
    assert_eq!(drains.get(), 2);
    assert!(tables.iter().all(|t| t.mover().waits == 0));
    // On their own, the tables wait once each per boundary that copies.
    for t in &mut tables {
        t.set_desired_all(4);
        t.boundary().unwrap();
    }
    assert!(tables.iter().all(|t| t.mover().waits == 1));
}
