//! The weight page table and its commit protocol.

use crate::PageError;
use crate::accountant::{Accountant, BudgetError, Lease, MemoryUsage, Use};
use crate::extent::{Extent, ExtentAllocator};
use crate::mover::{MoveError, Mover, Ticket, Write};
use cubecl::prelude::CubeElement;
use kernels_cubecl::{PoolSlot, WorkItem};
use pw_format::{ApBlock, BlockKind, Checkpoint};
use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

/// Bytes of one plane word and one LUT entry.
const WORD_BYTES: usize = 4;
const LUT_BYTES: usize = 2;

/// Which page: (layer, expert, block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageKey {
    /// Decoder layer.
    pub layer: usize,
    /// Expert within the layer.
    pub expert: usize,
    /// gate_up or down.
    pub kind: BlockKind,
}

impl fmt::Display for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "layer {} expert {} {}", self.layer, self.expert, self.kind.name())
    }
}

/// Index of a page in its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageId(pub usize);

/// Where a plane or LUT of a page lives. The host always has every plane and
/// LUT (the max-bit parent); this says whether the GPU has it too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// On the GPU and part of the committed state.
    Gpu,
    /// Being copied to the GPU; not yet readable by kernels.
    InTransfer,
    /// Only on the host.
    Host,
}

/// Why a raising did not start at a boundary (it is retried at the next one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeferReason {
    /// Its planes + LUT would exceed the memory budget.
    Budget(BudgetError),
    /// No free run of the arena is long enough (fragmentation or a full arena).
    Fragmented {
        /// "plane" or "LUT".
        arena: &'static str,
        /// Elements needed in one run.
        needed: usize,
        /// Longest free run.
        largest_free: usize,
    },
    /// Another transfer of this page (a cancelled raising, or a relocation)
    /// is still in flight; the raising starts after it finished.
    InFlight,
}

impl fmt::Display for DeferReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeferReason::Budget(e) => write!(f, "{e}"),
            DeferReason::Fragmented { arena, needed, largest_free } => write!(
                f,
                "no free run of {needed} elements in the {arena} arena (longest free run {largest_free})"
            ),
            DeferReason::InFlight => f.write_str("another transfer of this page is still in flight"),
        }
    }
}

/// A raising that could not start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deferred {
    /// The page.
    pub page: PageId,
    /// Bits it asked for.
    pub target: u8,
    /// Why not now.
    pub reason: DeferReason,
}

/// What one [`PagedWeights::boundary`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitReport {
    /// Pages whose raising was committed.
    pub raised: Vec<PageId>,
    /// Pages lowered (committed at once).
    pub lowered: Vec<PageId>,
    /// Pages whose raising transfer started (committed at a later boundary,
    /// or at this one if it already finished).
    pub started: Vec<PageId>,
    /// Raisings that could not start, with the reason.
    pub deferred: Vec<Deferred>,
    /// Cancelled raisings whose transfer finished and whose memory was freed.
    pub reclaimed: Vec<PageId>,
    /// Pages whose relocation (to merge free runs of a fragmented arena) started.
    pub relocating: Vec<PageId>,
    /// Pages whose relocation was committed.
    pub relocated: Vec<PageId>,
    /// Whether the descriptor table changed (and was published).
    pub published: bool,
    /// Host time of the boundary's parts.
    pub times: BoundaryTimes,
}

/// Host time of a boundary's parts: where a commit spends what the steps wait for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BoundaryTimes {
    /// Polling the transfers in flight and committing those that finished.
    pub finished: Duration,
    /// Lowerings, their ordered LUT writes included.
    pub lower: Duration,
    /// Starting raisings and relocations, the mover's copies included.
    pub start: Duration,
    /// Of `start`, the time inside the mover's `start` (waiting for the kernels, issuing the
    /// copies).
    pub start_mover: Duration,
    /// Rebuilding and publishing the descriptor table (and any copy of it a reader keeps), and
    /// waiting for the boundary's ordered writes.
    pub publish: Duration,
}

impl BoundaryTimes {
    /// Adds `other`'s times to these.
    pub fn add(&mut self, other: &Self) {
        self.finished += other.finished;
        self.lower += other.lower;
        self.start += other.start;
        self.start_mover += other.start_mover;
        self.publish += other.publish;
    }

    /// The times added since `earlier` (a cumulative total's difference).
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            finished: self.finished.saturating_sub(earlier.finished),
            lower: self.lower.saturating_sub(earlier.lower),
            start: self.start.saturating_sub(earlier.start),
            start_mover: self.start_mover.saturating_sub(earlier.start_mover),
            publish: self.publish.saturating_sub(earlier.publish),
        }
    }
}

/// A page's state, for inspection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageInfo {
    /// Which page.
    pub key: PageKey,
    /// Block name in the checkpoint.
    pub name: String,
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
    /// Lowest stored bit-width.
    pub min_bits: u8,
    /// Highest stored bit-width (host parent).
    pub max_bits: u8,
    /// Desired bits d (0 = not asked for yet).
    pub desired: u8,
    /// Committed bits q (0 = not resident).
    pub committed: u8,
    /// Target of the raising in flight, if any (and not cancelled).
    pub raising_to: Option<u8>,
    /// GPU bytes of the committed state (planes + LUT).
    pub gpu_bytes: usize,
}

/// A transfer in flight for a page: a raising (new planes and LUT) or a
/// relocation (planes or LUT copied at the committed bits into a new extent,
/// to merge free runs).
struct Transfer {
    target: u8,
    ticket: Ticket,
    /// New planes: `q..target` right after the committed extent (`true`: in
    /// place) or `0..target` elsewhere.
    planes: Option<(Extent, bool, Lease)>,
    /// The new LUT of width `target`.
    lut: Option<(Extent, Lease)>,
    cancelled: bool,
}

impl Transfer {
    fn raising(&self) -> Option<u8> {
        Some(self.target).filter(|_| !self.cancelled && self.lut.is_some() && self.planes.is_some())
    }
}

/// The two arenas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arena {
    Planes,
    Luts,
}

struct Page {
    key: PageKey,
    name: String,
    parent: ApBlock,
    desired: u8,
    committed: u8,
    /// Planes `0..committed`, contiguous, as the kernel reads them.
    planes: Option<(Extent, Lease)>,
    /// The LUT of width `committed`.
    lut: Option<(Extent, Lease)>,
    raise: Option<Transfer>,
}

impl Page {
    /// Device bytes (planes + LUT) at the committed width (0 when not resident).
    fn gpu_bytes(&self) -> usize {
        if self.committed == 0 {
            return 0;
        }
        let (planes, lut) = self.parent.bytes_at(self.committed);
        planes + lut
    }

    fn plane_words(&self) -> usize {
        self.parent.rows * self.parent.words_per_row()
    }

    fn lut_len(&self, bits: u8) -> usize {
        self.parent.rows << bits
    }

    fn slot(&self) -> PoolSlot {
        let (plane_off, lut_off) = match (&self.planes, &self.lut) {
            (Some((p, _)), Some((l, _))) => (p.off as u32, l.off as u32),
            _ => (0, 0),
        };
        PoolSlot {
            plane_off,
            lut_off,
            rows: self.parent.rows as u32,
            cols: self.parent.cols as u32,
            bits: self.committed as u32,
        }
    }
}

/// One token group of a grouped launch: `tokens` rows of `x` at `x_off`
/// through the page of `expert`, output at `y_off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    /// Expert.
    pub expert: usize,
    /// First element of the group's `x` rows.
    pub x_off: u32,
    /// First element of the group's `y` rows.
    pub y_off: u32,
    /// Tokens (at most [`kernels_cubecl::MAX_TOKENS`]).
    pub tokens: u32,
}

/// The weight page table over a [`Mover`]'s arenas.
///
/// One page per (layer, expert, gate_up|down). The host keeps every page's
/// full max-bit parent; the GPU holds planes `0..q` and the LUT of width `q`
/// of each resident page, in arena extents leased from the [`Accountant`].
/// The descriptor table the kernels read changes only in [`Self::boundary`].
pub struct PagedWeights<M> {
    // Dropped before `pages`: a mover may have pinned the parents' memory.
    mover: M,
    pages: Vec<Page>,
    index: HashMap<PageKey, PageId>,
    plane_arena: ExtentAllocator,
    lut_arena: ExtentAllocator,
    accountant: Accountant,
    table: Vec<PoolSlot>,
    generation: u64,
    /// Time inside the mover's `start` during the current boundary.
    mover_time: Duration,
}

impl<M: Mover> PagedWeights<M> {
    /// A table over `blocks` (name, key, host parent), none resident yet.
    pub fn new(
        blocks: Vec<(String, PageKey, ApBlock)>,
        accountant: Accountant,
        mover: M,
    ) -> Result<Self, PageError> {
        let (plane_cap, lut_cap) = mover.capacity();
        let mut index = HashMap::new();
        let mut pages = Vec::with_capacity(blocks.len());
        for (name, key, parent) in blocks {
            if index.insert(key, PageId(pages.len())).is_some() {
                return Err(PageError::DuplicatePage { key, name });
            }
            if parent.rows == 0 || parent.cols == 0 {
                return Err(PageError::BadBlock { name, reason: "empty block".into() });
            }
            pages.push(Page {
                key,
                name,
                parent,
                desired: 0,
                committed: 0,
                planes: None,
                lut: None,
                raise: None,
            });
        }
        let mut mover = mover;
        for p in &pages {
            mover.pin_host(u32::as_bytes(&p.parent.planes));
            for l in &p.parent.luts {
                mover.pin_host_luts(half::f16::as_bytes(l));
            }
        }
        let table = pages.iter().map(Page::slot).collect();
        Ok(Self {
            pages,
            index,
            plane_arena: ExtentAllocator::new(plane_cap),
            lut_arena: ExtentAllocator::new(lut_cap),
            accountant,
            mover,
            table,
            generation: 0,
            mover_time: Duration::ZERO,
        })
    }

    /// A table over every block of a quantized checkpoint (each block's
    /// max-bit parent is read into host memory).
    pub fn from_checkpoint(ckpt: &Checkpoint, accountant: Accountant, mover: M) -> Result<Self, PageError> {
        let mut blocks = Vec::with_capacity(ckpt.manifest().blocks.len());
        for e in &ckpt.manifest().blocks {
            let block = ckpt.block(&e.name)?;
            blocks.push((e.name.clone(), PageKey { layer: e.layer, expert: e.expert, kind: e.kind }, block));
        }
        Self::new(blocks, accountant, mover)
    }

    /// Arena sizes (plane words, LUT entries) that hold every block of a
    /// checkpoint at `bits` (clamped to each block's range) at once.
    pub fn arena_size_for(ckpt: &Checkpoint, bits: u8) -> (usize, usize) {
        ckpt.manifest().blocks.iter().fold((0, 0), |(p, l), e| {
            let b = bits.clamp(e.min_bits, e.max_bits);
            let (pb, lb) = e.bytes_at(b);
            (p + pb / WORD_BYTES, l + lb / LUT_BYTES)
        })
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether there are no pages.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// The page of `key`.
    pub fn page(&self, key: PageKey) -> Result<PageId, PageError> {
        self.index.get(&key).copied().ok_or(PageError::UnknownPage { key })
    }

    /// Every page id.
    pub fn ids(&self) -> impl Iterator<Item = PageId> + use<M> {
        (0..self.pages.len()).map(PageId)
    }

    fn get(&self, id: PageId) -> Result<&Page, PageError> {
        self.pages.get(id.0).ok_or(PageError::BadPageId { id: id.0, pages: self.pages.len() })
    }

    /// The host parent of a page (all planes and LUTs).
    pub fn parent(&self, id: PageId) -> Result<&ApBlock, PageError> {
        Ok(&self.get(id)?.parent)
    }

    /// Every page's (desired, committed) width in id order, the desired one being the committed
    /// one where none was asked (committed 0: not resident): what a boundary reads of each
    /// page, without [`Self::info`]'s copies.
    pub fn bits(&self) -> impl Iterator<Item = (u8, u8)> + '_ {
        self.pages.iter().map(|p| (if p.desired == 0 { p.committed } else { p.desired }, p.committed))
    }

    /// Whether the next [`Self::boundary`] may copy (a lowering's LUT, a raising to start): the
    /// boundaries that wait for the kernels' queue when the mover
    /// [`waits_for_queue`](Mover::waits_for_queue). False only where no page wants other bits
    /// than it holds or than its transfer in flight brings.
    pub fn copies_pending(&self) -> bool {
        self.pages.iter().any(|p| {
            p.desired != 0
                && p.desired != p.committed
                && p.raise.as_ref().is_none_or(|r| r.target != p.desired)
        })
    }

    /// Committed device bytes (planes + LUT) per bit-width (index = bits, 0..=8).
    pub fn bytes_by_bits(&self) -> [u64; 9] {
        let mut out = [0u64; 9];
        for p in &self.pages {
            out[p.committed.min(8) as usize] += p.gpu_bytes() as u64;
        }
        out
    }

    /// A page's state.
    pub fn info(&self, id: PageId) -> Result<PageInfo, PageError> {
        let p = self.get(id)?;
        Ok(PageInfo {
            key: p.key,
            name: p.name.clone(),
            rows: p.parent.rows,
            cols: p.parent.cols,
            min_bits: p.parent.min_bits,
            max_bits: p.parent.max_bits,
            desired: p.desired,
            committed: p.committed,
            raising_to: p.raise.as_ref().and_then(Transfer::raising).filter(|&t| t > p.committed),
            gpu_bytes: p.gpu_bytes(),
        })
    }

    /// Where plane `plane` (0 = most significant) of a page lives.
    pub fn plane_location(&self, id: PageId, plane: u8) -> Result<Location, PageError> {
        let p = self.get(id)?;
        if plane >= p.parent.max_bits {
            return Err(PageError::BitsOutOfRange {
                name: p.name.clone(),
                bits: plane + 1,
                min: 1,
                max: p.parent.max_bits,
            });
        }
        Ok(if plane < p.committed {
            Location::Gpu
        } else if p.raise.as_ref().and_then(Transfer::raising).is_some_and(|t| plane < t) {
            Location::InTransfer
        } else {
            Location::Host
        })
    }

    /// Where the LUT of width `bits` of a page lives.
    pub fn lut_location(&self, id: PageId, bits: u8) -> Result<Location, PageError> {
        let p = self.get(id)?;
        check_bits(p, bits)?;
        Ok(if bits == p.committed {
            Location::Gpu
        } else if p.raise.as_ref().and_then(Transfer::raising) == Some(bits) {
            Location::InTransfer
        } else {
            Location::Host
        })
    }

    /// Asks for `bits` on a page; takes effect at the next [`Self::boundary`].
    pub fn set_desired(&mut self, id: PageId, bits: u8) -> Result<(), PageError> {
        let n = self.pages.len();
        let p = self.pages.get_mut(id.0).ok_or(PageError::BadPageId { id: id.0, pages: n })?;
        check_bits(p, bits)?;
        p.desired = bits;
        Ok(())
    }

    /// Asks for `bits` on every page (clamped to each page's range).
    pub fn set_desired_all(&mut self, bits: u8) {
        for p in &mut self.pages {
            p.desired = bits.clamp(p.parent.min_bits, p.parent.max_bits);
        }
    }

    /// The committed descriptor table: one slot per page (`bits == 0`: not resident).
    pub fn table(&self) -> &[PoolSlot] {
        &self.table
    }

    /// How many commits changed the table.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The accountant.
    pub fn accountant(&self) -> &Accountant {
        &self.accountant
    }

    /// Memory usage of the shared budget.
    pub fn usage(&self) -> MemoryUsage {
        self.accountant.usage()
    }

    /// Bytes the arenas have allocated (committed and in-flight extents).
    pub fn held_bytes(&self) -> usize {
        self.plane_arena.used() * WORD_BYTES + self.lut_arena.used() * LUT_BYTES
    }

    /// The mover.
    pub fn mover(&self) -> &M {
        &self.mover
    }

    /// The mover, mutably (to poll or complete transfers of a test mover).
    pub fn mover_mut(&mut self) -> &mut M {
        &mut self.mover
    }

    /// Work items of one grouped launch over the committed table.
    pub fn items(&self, layer: usize, kind: BlockKind, groups: &[Group]) -> Result<Vec<WorkItem>, PageError> {
        groups
            .iter()
            .map(|g| {
                let key = PageKey { layer, expert: g.expert, kind };
                let id = self.page(key)?;
                let slot = self.table[id.0];
                if slot.bits == 0 {
                    return Err(PageError::NotResident { key });
                }
                Ok(slot.item(g.x_off, g.y_off, g.tokens))
            })
            .collect()
    }

    /// The safe point between decode steps: commits finished raisings, commits
    /// every lowering at once, starts the raisings that fit (deferring the
    /// others with a reason), commits those already finished, and publishes the
    /// table if it changed. Never waits for a transfer.
    pub fn boundary(&mut self) -> Result<CommitReport, PageError> {
        let mut report = CommitReport::default();
        let mut times = BoundaryTimes::default();
        let mut clock = Instant::now();
        let mut lap = |part: &mut Duration| {
            let now = Instant::now();
            *part += now - clock;
            clock = now;
        };
        let mut changed = self.commit_finished(&mut report)?;
        lap(&mut times.finished);
        for i in 0..self.pages.len() {
            let p = &self.pages[i];
            if p.desired != 0 && p.desired < p.committed {
                self.lower(i)?;
                report.lowered.push(PageId(i));
                changed = true;
            }
        }
        lap(&mut times.lower);
        for i in 0..self.pages.len() {
            let p = &self.pages[i];
            if p.desired <= p.committed {
                continue;
            }
            let target = p.desired;
            match &p.raise {
                Some(r) if r.raising().is_none() => {
                    report.deferred.push(Deferred { page: PageId(i), target, reason: DeferReason::InFlight })
                }
                // Committed when it finishes; a different desire is handled then.
                Some(_) => {}
                None => match self.start_raise(i)? {
                    Ok(()) => report.started.push(PageId(i)),
                    Err(reason) => report.deferred.push(Deferred { page: PageId(i), target, reason }),
                },
            }
        }
        // A raising blocked only by fragmentation: relocate one page per arena
        // so that a longer free run forms (the raising is retried later).
        for arena in [Arena::Planes, Arena::Luts] {
            let name = if arena == Arena::Planes { "plane" } else { "LUT" };
            let blocked = report
                .deferred
                .iter()
                .any(|d| matches!(d.reason, DeferReason::Fragmented { arena: a, .. } if a == name));
            if blocked && let Some(id) = self.start_relocation(arena)? {
                report.relocating.push(id);
            }
        }
        lap(&mut times.start);
        times.start_mover = std::mem::take(&mut self.mover_time);
        changed |= self.commit_finished(&mut report)?;
        lap(&mut times.finished);
        if changed {
            self.table = self.pages.iter().map(Page::slot).collect();
            self.generation += 1;
            self.mover.publish(&self.table)?;
            report.published = true;
        }
        self.mover.end_boundary()?;
        lap(&mut times.publish);
        report.times = times;
        Ok(report)
    }

    /// Commits (or reclaims, if cancelled) every raising whose transfer finished.
    fn commit_finished(&mut self, report: &mut CommitReport) -> Result<bool, PageError> {
        let mut changed = false;
        for i in 0..self.pages.len() {
            let Some(ticket) = self.pages[i].raise.as_ref().map(|r| r.ticket) else { continue };
            if !self.mover.finished(ticket)? {
                continue;
            }
            let page = &mut self.pages[i];
            let r = page.raise.take().expect("checked above");
            if r.cancelled {
                if let Some((e, _, _)) = r.planes {
                    self.plane_arena.free(e);
                }
                if let Some((e, _)) = r.lut {
                    self.lut_arena.free(e);
                }
                report.reclaimed.push(PageId(i));
                continue;
            }
            let relocation = r.target == page.committed;
            match r.planes {
                Some((new, true, lease)) => {
                    let (ext, held) = page.planes.as_mut().expect("in-place raise of a resident page");
                    ext.len += new.len;
                    held.absorb(lease);
                }
                Some((new, false, lease)) => {
                    if let Some((old, _)) = page.planes.replace((new, lease)) {
                        self.plane_arena.free(old);
                    }
                }
                None => {}
            }
            if let Some((new, lease)) = r.lut
                && let Some((old, _)) = page.lut.replace((new, lease))
            {
                self.lut_arena.free(old);
            }
            page.committed = r.target;
            if relocation {
                report.relocated.push(PageId(i));
            } else {
                report.raised.push(PageId(i));
            }
            changed = true;
        }
        Ok(changed)
    }

    /// Lowers page `i` to its desired bits, committed at once: the smaller
    /// LUT goes to a fresh extent at the arena's high end (or, when none is
    /// free, over the head of the current one) with an ordered write, so
    /// kernels launched before still read the old LUT and those after the new;
    /// then the dropped planes and the old LUT (or its tail) are freed. The
    /// fallback needs no extra memory, so a lowering never fails for lack of
    /// budget or space.
    fn lower(&mut self, i: usize) -> Result<(), PageError> {
        let page = &mut self.pages[i];
        let (q, d) = (page.committed, page.desired);
        if let Some(r) = page.raise.as_mut() {
            // Its planes were to follow planes 0..q (or copy q planes); they no longer will.
            r.cancelled = true;
        }
        let pw = page.plane_words();
        let (lut_new, lut_old) = (page.lut_len(d), page.lut_len(q));
        let moved = self
            .accountant
            .lease(Use::Weights, (lut_new * LUT_BYTES) as u64)
            .ok()
            .and_then(|lease| self.lut_arena.alloc_high(lut_new).map(|e| (e, lease)));
        match moved {
            Some((ext, lease)) => {
                self.mover.write_ordered(&[Write::Lut { off: ext.off, data: page.parent.lut(d) }])?;
                let (old, _) = page.lut.replace((ext, lease)).expect("a lowered page is resident");
                self.lut_arena.free(old);
            }
            None => {
                let (lut_ext, lut_lease) = page.lut.as_mut().expect("a lowered page is resident");
                self.mover.write_ordered(&[Write::Lut { off: lut_ext.off, data: page.parent.lut(d) }])?;
                self.lut_arena.free(Extent { off: lut_ext.off + lut_new, len: lut_old - lut_new });
                lut_ext.len = lut_new;
                lut_lease.shrink(((lut_old - lut_new) * LUT_BYTES) as u64);
            }
        }
        let (plane_ext, plane_lease) = page.planes.as_mut().expect("a lowered page is resident");
        let dropped = (q - d) as usize * pw;
        self.plane_arena.free(Extent { off: plane_ext.off + d as usize * pw, len: dropped });
        plane_ext.len -= dropped;
        plane_lease.shrink((dropped * WORD_BYTES) as u64);
        page.committed = d;
        Ok(())
    }

    /// `mover.start(writes)`, its time added to `time` (the boundary's `start_mover`). Takes the
    /// fields apart because the writes borrow the pages.
    fn start_transfer(mover: &mut M, time: &mut Duration, writes: &[Write<'_>]) -> Result<Ticket, MoveError> {
        let started = Instant::now();
        let ticket = mover.start(writes);
        *time += started.elapsed();
        ticket
    }

    /// Starts raising page `i` to its desired bits, or says why not.
    fn start_raise(&mut self, i: usize) -> Result<Result<(), DeferReason>, PageError> {
        let page = &self.pages[i];
        let (q, t) = (page.committed, page.desired);
        let pw = page.plane_words();
        let lut_len = page.lut_len(t);
        // Grow in place when the run after the committed planes is free.
        let grown =
            page.planes.as_ref().and_then(|(e, _)| self.plane_arena.alloc_at(e.end(), (t - q) as usize * pw));
        let (planes, in_place) = match grown {
            Some(e) => (e, true),
            None => match self.plane_arena.alloc(t as usize * pw) {
                Some(e) => (e, false),
                None => {
                    return Ok(Err(DeferReason::Fragmented {
                        arena: "plane",
                        needed: t as usize * pw,
                        largest_free: self.plane_arena.largest_free(),
                    }));
                }
            },
        };
        let lut = if t == page.parent.max_bits {
            self.lut_arena.alloc(lut_len)
        } else {
            self.lut_arena.alloc_high(lut_len)
        };
        let Some(lut) = lut else {
            self.plane_arena.free(planes);
            return Ok(Err(DeferReason::Fragmented {
                arena: "LUT",
                needed: lut_len,
                largest_free: self.lut_arena.largest_free(),
            }));
        };
        let leases = self
            .accountant
            .lease(Use::Weights, (planes.len * WORD_BYTES + lut.len * LUT_BYTES) as u64)
            .map(|mut all| {
                // Split so that the plane part can be merged on an in-place commit.
                let lut_bytes = (lut.len * LUT_BYTES) as u64;
                all.shrink(lut_bytes);
                (all, self.accountant.lease(Use::Weights, lut_bytes).expect("just released"))
            });
        let leases = match leases {
            Ok(l) => l,
            Err(e) => {
                self.plane_arena.free(planes);
                self.lut_arena.free(lut);
                return Ok(Err(DeferReason::Budget(e)));
            }
        };
        let first = if in_place { q as usize } else { 0 };
        let src = &page.parent.planes[first * pw..t as usize * pw];
        let writes = [
            Write::Planes { off: planes.off, data: src },
            Write::Lut { off: lut.off, data: page.parent.lut(t) },
        ];
        let ticket = match Self::start_transfer(&mut self.mover, &mut self.mover_time, &writes) {
            Ok(t) => t,
            Err(e) => {
                self.plane_arena.free(planes);
                self.lut_arena.free(lut);
                return Err(e.into());
            }
        };
        let (plane_lease, lut_lease) = leases;
        self.pages[i].raise = Some(Transfer {
            target: t,
            ticket,
            planes: Some((planes, in_place, plane_lease)),
            lut: Some((lut, lut_lease)),
            cancelled: false,
        });
        Ok(Ok(()))
    }

    /// Compaction step for a fragmented arena: picks the committed extent whose
    /// release would form the longest free run (its free neighbours plus
    /// itself), if that run is longer than any now and the extent fits in
    /// another free run, and starts copying the page's data there from the host
    /// parent. The move commits like a raising (the copy first, then the
    /// descriptor), and its old extent is freed then.
    fn start_relocation(&mut self, arena: Arena) -> Result<Option<PageId>, PageError> {
        let alloc = match arena {
            Arena::Planes => &self.plane_arena,
            Arena::Luts => &self.lut_arena,
        };
        let runs: Vec<Extent> = alloc.free_runs().collect();
        let largest = alloc.largest_free();
        // (merged run, page, its extent, destination)
        let mut best: Option<(usize, usize, Extent, Extent)> = None;
        for (i, p) in self.pages.iter().enumerate() {
            if p.raise.is_some() {
                continue;
            }
            let ext = match (arena, &p.planes, &p.lut) {
                (Arena::Planes, Some((e, _)), _) => *e,
                (Arena::Luts, _, Some((e, _))) => *e,
                _ => continue,
            };
            let left = runs.iter().find(|r| r.end() == ext.off).map_or(0, |r| r.len);
            let right = runs.iter().find(|r| r.off == ext.end()).map_or(0, |r| r.len);
            let merged = left + ext.len + right;
            let dest = runs.iter().find(|r| r.end() != ext.off && r.off != ext.end() && r.len >= ext.len);
            if let Some(dest) = dest
                && merged > largest
                && best.is_none_or(|b| merged > b.0)
            {
                best = Some((merged, i, ext, Extent { off: dest.off, len: ext.len }));
            }
        }
        let Some((_, i, ext, dest)) = best else { return Ok(None) };
        let elem = if arena == Arena::Planes { WORD_BYTES } else { LUT_BYTES };
        let Ok(lease) = self.accountant.lease(Use::Weights, (ext.len * elem) as u64) else { return Ok(None) };
        let page = &self.pages[i];
        let q = page.committed;
        let (write, planes, lut) = match arena {
            Arena::Planes => {
                let e = self.plane_arena.alloc_at(dest.off, dest.len).expect("a free run");
                let data = &page.parent.planes[..q as usize * page.plane_words()];
                (Write::Planes { off: e.off, data }, Some((e, false, lease)), None)
            }
            Arena::Luts => {
                let e = self.lut_arena.alloc_at(dest.off, dest.len).expect("a free run");
                (Write::Lut { off: e.off, data: page.parent.lut(q) }, None, Some((e, lease)))
            }
        };
        let ticket = match Self::start_transfer(&mut self.mover, &mut self.mover_time, &[write]) {
            Ok(t) => t,
            Err(e) => {
                match arena {
                    Arena::Planes => self.plane_arena.free(dest),
                    Arena::Luts => self.lut_arena.free(dest),
                }
                return Err(e.into());
            }
        };
        self.pages[i].raise = Some(Transfer { target: q, ticket, planes, lut, cancelled: false });
        Ok(Some(PageId(i)))
    }

    /// Checks the table's internal consistency: extents of all pages (committed
    /// and in flight) are disjoint and allocated, committed extents match the
    /// committed bits, the published table is the committed state, and the
    /// bytes leased for weights equal the bytes the arenas hold. Returns the
    /// first violation found.
    pub fn audit(&self) -> Result<(), String> {
        let mut plane_exts = Vec::new();
        let mut lut_exts = Vec::new();
        let mut leased = 0u64;
        for (i, p) in self.pages.iter().enumerate() {
            let pw = p.plane_words();
            match (&p.planes, &p.lut) {
                (Some((pe, pl)), Some((le, ll))) => {
                    if pe.len != p.committed as usize * pw || le.len != p.lut_len(p.committed) {
                        return Err(format!("page {i}: extents do not match q = {}", p.committed));
                    }
                    if pl.bytes() != (pe.len * WORD_BYTES) as u64 || ll.bytes() != (le.len * LUT_BYTES) as u64
                    {
                        return Err(format!("page {i}: leases do not match extents"));
                    }
                    leased += pl.bytes() + ll.bytes();
                    plane_exts.push((*pe, i));
                    lut_exts.push((*le, i));
                }
                (None, None) if p.committed == 0 => {}
                _ => return Err(format!("page {i}: half-resident")),
            }
            if let Some(r) = &p.raise {
                if let Some((e, in_place, l)) = &r.planes {
                    leased += l.bytes();
                    if l.bytes() != (e.len * WORD_BYTES) as u64 {
                        return Err(format!("page {i}: transfer plane lease does not match its extent"));
                    }
                    plane_exts.push((*e, i));
                    let end = p.planes.as_ref().map(|(e, _)| e.end());
                    if !r.cancelled && *in_place && end != Some(e.off) {
                        return Err(format!("page {i}: in-place raise not adjacent to its planes"));
                    }
                }
                if let Some((e, l)) = &r.lut {
                    leased += l.bytes();
                    if l.bytes() != (e.len * LUT_BYTES) as u64 {
                        return Err(format!("page {i}: transfer LUT lease does not match its extent"));
                    }
                    lut_exts.push((*e, i));
                }
            }
            if self.table[i] != p.slot() {
                return Err(format!("page {i}: published slot {:?} is not the committed one", self.table[i]));
            }
        }
        for (name, exts, arena) in
            [("plane", &mut plane_exts, &self.plane_arena), ("LUT", &mut lut_exts, &self.lut_arena)]
        {
            exts.sort_by_key(|(e, _)| e.off);
            for w in exts.windows(2) {
                if w[0].0.end() > w[1].0.off {
                    return Err(format!("{name} extents of pages {} and {} overlap", w[0].1, w[1].1));
                }
            }
            let total: usize = exts.iter().map(|(e, _)| e.len).sum();
            if total != arena.used() {
                return Err(format!("{name} arena holds {} elements, pages {total}", arena.used()));
            }
            for (e, i) in exts.iter() {
                if arena.free_runs().any(|f| f.off < e.end() && e.off < f.end()) {
                    return Err(format!("page {i} references a freed {name} range {e:?}"));
                }
            }
        }
        if leased != self.held_bytes() as u64 {
            return Err(format!("pages lease {leased} bytes, arenas hold {}", self.held_bytes()));
        }
        if self.accountant.usage().weights != leased {
            return Err(format!(
                "accountant counts {} weight bytes, pages lease {leased}",
                self.usage().weights
            ));
        }
        Ok(())
    }
}

/// [`PagedWeights::boundary`] of several tables whose kernels share one queue (a model's
/// layers), waiting for that queue at most once: where some table will copy and its mover
/// [`waits_for_queue`](Mover::waits_for_queue), `drain` runs first and every mover is told
/// ([`Mover::queue_drained`]). Returns each table's report and the time `drain` took.
pub fn boundaries<M: Mover>(
    tables: &mut [PagedWeights<M>],
    drain: impl FnOnce() -> Result<(), MoveError>,
) -> Result<(Vec<CommitReport>, Duration), PageError> {
    let mut waited = Duration::ZERO;
    if tables.iter().any(|t| t.mover.waits_for_queue() && t.copies_pending()) {
        let started = Instant::now();
        drain()?;
        for t in tables.iter_mut() {
            t.mover.queue_drained();
        }
        waited = started.elapsed();
    }
    let reports = tables.iter_mut().map(PagedWeights::boundary).collect::<Result<_, _>>()?;
    Ok((reports, waited))
}

fn check_bits(p: &Page, bits: u8) -> Result<(), PageError> {
    if !(p.parent.min_bits..=p.parent.max_bits).contains(&bits) {
        return Err(PageError::BitsOutOfRange {
            name: p.name.clone(),
            bits,
            min: p.parent.min_bits,
            max: p.parent.max_bits,
        });
    }
    Ok(())
}
