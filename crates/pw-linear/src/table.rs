//! [`PageTable`]: a shared handle on a `pw-pages` page table, on the device a Burn backend
//! runs on.
//!
//! The page table is generic over its [`Mover`]; Burn layers are generic over the backend.
//! This handle picks the mover from the Burn device once, at construction: a wgpu device
//! gets CubeCL arenas on the same compute client Burn uses (copies ordered on its queue), a
//! CUDA device (feature `cuda`) the asynchronous pinned-copy mover, anything else host
//! arenas. Every [`PagedLinear`](crate::PagedLinear) view and [`PagedExperts`](crate::PagedExperts)
//! bank over the same table shares it: one copy of each page's planes, one commit protocol.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cubecl::Runtime;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use pw_format::{ApBlock, Checkpoint};
use pw_pages::{
    Accountant, CommitReport, CubePool, DeferReason, HostPool, MemoryUsage, PageError, PageId, PageInfo,
    PageKey, PagedWeights,
};

/// Bytes of one plane word and one LUT entry.
const WORD_BYTES: usize = 4;
const LUT_BYTES: usize = 2;

/// The page table on one kind of device (one per table, behind an `Arc`: the size difference
/// between variants costs nothing).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Pages {
    /// Host arenas (ndarray and any backend without CubeCL tensors).
    Host(PagedWeights<HostPool>),
    /// CubeCL arenas on a wgpu device.
    Wgpu(PagedWeights<CubePool<WgpuRuntime>>, WgpuDevice),
    /// CubeCL arenas on a CUDA device, filled by asynchronous pinned copies.
    #[cfg(feature = "cuda")]
    Cuda(PagedWeights<pw_pages::CudaMover>, cubecl::cuda::CudaDevice),
}

/// Runs `$e` with `$t` bound to the page table of any variant.
macro_rules! with_pages {
    ($p:expr, $t:ident => $e:expr) => {
        match $p {
            Pages::Host($t) => $e,
            Pages::Wgpu($t, _) => $e,
            #[cfg(feature = "cuda")]
            Pages::Cuda($t, _) => $e,
        }
    };
}
pub(crate) use with_pages;

/// Arena sizes `(plane words, LUT entries)` that hold `blocks` at `bits` each (clamped to each
/// block's range), as the kernels read them.
pub fn arena_size_at<'a>(blocks: impl IntoIterator<Item = &'a ApBlock>, bits: u8) -> (usize, usize) {
    blocks.into_iter().fold((0, 0), |(p, l), b| {
        let (pb, lb) = b.bytes_at(bits.clamp(b.min_bits, b.max_bits));
        (p + pb / WORD_BYTES, l + lb / LUT_BYTES)
    })
}

/// A shared handle on a weight page table (clones share it).
#[derive(Clone)]
pub struct PageTable {
    inner: Arc<Mutex<Pages>>,
    names: Arc<HashMap<String, PageId>>,
}

impl std::fmt::Debug for PageTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageTable {{ pages: {}, device: {} }}", self.names.len(), self.device_kind())
    }
}

impl PageTable {
    /// A table over `blocks` (name, key, host parent) on `device` (a Burn device: `WgpuDevice`,
    /// `CudaDevice` with feature `cuda`, anything else means host arenas), with device arenas of
    /// `arena` = (plane words, LUT entries) and every device byte leased from `accountant`.
    /// No page is resident yet: call [`Self::set_desired_all`] and [`Self::settle`].
    pub fn new<D: Any>(
        blocks: Vec<(String, PageKey, ApBlock)>,
        accountant: Accountant,
        arena: (usize, usize),
        device: &D,
    ) -> Result<Self, PageError> {
        let names: HashMap<String, PageId> =
            blocks.iter().enumerate().map(|(i, (n, _, _))| (n.clone(), PageId(i))).collect();
        let dev: &dyn Any = device;
        let pages = if let Some(d) = dev.downcast_ref::<WgpuDevice>() {
            let pool = CubePool::new(WgpuRuntime::client(d), arena.0, arena.1);
            Pages::Wgpu(PagedWeights::new(blocks, accountant, pool)?, d.clone())
        } else {
            Self::other(blocks, accountant, arena, dev)?
        };
        Ok(Self { inner: Arc::new(Mutex::new(pages)), names: Arc::new(names) })
    }

    #[cfg(feature = "cuda")]
    fn other(
        blocks: Vec<(String, PageKey, ApBlock)>,
        accountant: Accountant,
        arena: (usize, usize),
        dev: &dyn Any,
    ) -> Result<Pages, PageError> {
        use cubecl::cuda::{CudaDevice, CudaRuntime};
        if let Some(d) = dev.downcast_ref::<CudaDevice>() {
            let mover = pw_pages::CudaMover::new(CudaRuntime::client(d), d.index, arena.0, arena.1)?;
            return Ok(Pages::Cuda(PagedWeights::new(blocks, accountant, mover)?, d.clone()));
        }
        Ok(Pages::Host(PagedWeights::new(blocks, accountant, HostPool::new(arena.0, arena.1))?))
    }

    #[cfg(not(feature = "cuda"))]
    fn other(
        blocks: Vec<(String, PageKey, ApBlock)>,
        accountant: Accountant,
        arena: (usize, usize),
        _dev: &dyn Any,
    ) -> Result<Pages, PageError> {
        Ok(Pages::Host(PagedWeights::new(blocks, accountant, HostPool::new(arena.0, arena.1))?))
    }

    /// A table over every expert block of a quantized checkpoint (see [`Self::new`]).
    pub fn from_checkpoint<D: Any>(
        ckpt: &Checkpoint,
        accountant: Accountant,
        arena: (usize, usize),
        device: &D,
    ) -> Result<Self, PageError> {
        let mut blocks = Vec::with_capacity(ckpt.manifest().blocks.len());
        for e in &ckpt.manifest().blocks {
            let block = ckpt.block(&e.name)?;
            blocks.push((e.name.clone(), PageKey { layer: e.layer, expert: e.expert, kind: e.kind }, block));
        }
        Self::new(blocks, accountant, arena, device)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Pages> {
        // Every table operation either completes or returns an error before it changes the
        // published state, so a poisoned lock still guards a consistent table.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where the arenas live: "host", "wgpu" or "cuda".
    pub fn device_kind(&self) -> &'static str {
        match &*self.lock() {
            Pages::Host(_) => "host",
            Pages::Wgpu(..) => "wgpu",
            #[cfg(feature = "cuda")]
            Pages::Cuda(..) => "cuda",
        }
    }

    /// Whether layers over this table run the CubeCL kernels for tensors of backend `B` on
    /// `device` (else the CPU reference path).
    pub fn runs_kernels<B: burn::tensor::backend::Backend>(&self, device: &B::Device) -> bool {
        crate::cube::runs_kernels::<B>(self, device)
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether the table has no pages.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The page of `key`.
    pub fn page(&self, key: PageKey) -> Result<PageId, PageError> {
        with_pages!(&*self.lock(), t => t.page(key))
    }

    /// The page of the block called `name` in the checkpoint.
    pub fn page_named(&self, name: &str) -> Option<PageId> {
        self.names.get(name).copied()
    }

    /// A page's state.
    pub fn info(&self, id: PageId) -> Result<PageInfo, PageError> {
        with_pages!(&*self.lock(), t => t.info(id))
    }

    /// Every page's (desired, committed) bits in id order (see [`PagedWeights::bits`]).
    pub fn bits(&self) -> Vec<(u8, u8)> {
        with_pages!(&*self.lock(), t => t.bits().collect())
    }

    /// Committed device bytes per bit-width (see [`PagedWeights::bytes_by_bits`]).
    pub fn bytes_by_bits(&self) -> [u64; 9] {
        with_pages!(&*self.lock(), t => t.bytes_by_bits())
    }

    /// A copy of a page's host parent (all bit-widths).
    pub fn parent(&self, id: PageId) -> Result<ApBlock, PageError> {
        with_pages!(&*self.lock(), t => t.parent(id).cloned())
    }

    /// Asks for `bits` on one page; takes effect at the next [`Self::boundary`].
    pub fn set_desired(&self, id: PageId, bits: u8) -> Result<(), PageError> {
        with_pages!(&mut *self.lock(), t => t.set_desired(id, bits))
    }

    /// Asks for `bits` on every page (clamped to each page's range).
    pub fn set_desired_all(&self, bits: u8) {
        with_pages!(&mut *self.lock(), t => t.set_desired_all(bits))
    }

    /// The safe point between decode steps: commits every lowering and every raising whose
    /// transfer finished, starts the raisings that fit, never waits (see
    /// [`PagedWeights::boundary`]). Kernels launched after it read the new committed state;
    /// those launched before it keep reading what they were launched with.
    pub fn boundary(&self) -> Result<CommitReport, PageError> {
        with_pages!(&mut *self.lock(), t => t.boundary())
    }

    /// Runs boundaries until every page is at its desired bits (startup, tests, `set_bits` of a
    /// standalone layer). A raising deferred for budget or space is retried while others make
    /// progress (their commits free the LUTs they replace); when a boundary makes none and
    /// nothing is in flight, the error names the page and the numbers.
    pub fn settle(&self) -> Result<CommitReport, PageError> {
        let mut all = CommitReport::default();
        loop {
            let r = self.boundary()?;
            let progress = !(r.started.is_empty()
                && r.raised.is_empty()
                && r.lowered.is_empty()
                && r.relocating.is_empty()
                && r.relocated.is_empty()
                && r.reclaimed.is_empty());
            let stuck = r.deferred.iter().find(|d| !matches!(d.reason, DeferReason::InFlight));
            all.raised.extend(r.raised);
            all.lowered.extend(r.lowered);
            all.started.extend(r.started);
            all.deferred = r.deferred.clone();
            all.published |= r.published;
            let (done, in_flight) = self.progress()?;
            if done {
                all.deferred.clear();
                return Ok(all);
            }
            if let (false, false, Some(d)) = (progress, in_flight, stuck) {
                let info = self.info(d.page)?;
                return Err(PageError::BadBlock {
                    name: info.name,
                    reason: format!("cannot raise to {} bits: {}", d.target, d.reason),
                });
            }
            if !progress {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// (every page at its desired bits, some transfer in flight).
    fn progress(&self) -> Result<(bool, bool), PageError> {
        with_pages!(&*self.lock(), t => {
            let (mut done, mut in_flight) = (true, false);
            for id in t.ids() {
                let i = t.info(id)?;
                done &= i.desired == 0 || i.committed == i.desired;
                in_flight |= i.raising_to.is_some();
            }
            Ok((done, in_flight))
        })
    }

    /// The committed bits of every page, in page order.
    pub fn committed_bits(&self) -> Vec<u8> {
        with_pages!(&*self.lock(), t => t.table().iter().map(|s| s.bits as u8).collect())
    }

    /// The shared memory accountant (weights + KV).
    pub fn accountant(&self) -> Accountant {
        with_pages!(&*self.lock(), t => t.accountant().clone())
    }

    /// Memory usage of the shared budget.
    pub fn usage(&self) -> MemoryUsage {
        with_pages!(&*self.lock(), t => t.usage())
    }

    /// Checks the table's internal consistency (see [`PagedWeights::audit`]).
    pub fn audit(&self) -> Result<(), String> {
        with_pages!(&*self.lock(), t => t.audit())
    }
}
