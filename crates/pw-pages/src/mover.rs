//! Moving plane and LUT data into the device arenas.
//!
//! A [`Mover`] owns the two device arenas (plane words and LUT entries) that
//! the grouped kernel reads, and the committed descriptor table. The page
//! table decides *where* data goes; the mover only copies. Two kinds of write:
//! - [`Mover::write_ordered`]: ordered with the kernels (every kernel launched
//!   before it sees the old contents, every one launched after sees the new).
//!   Used for the small LUT swap of a lowering, so lowerings commit at once.
//! - [`Mover::start`]: a transfer that may run concurrently with kernels
//!   (host→GPU reloads of a raising); [`Mover::finished`] polls it without
//!   waiting. The page table commits a raising only after its transfer finished.
//!
//! Implementations: [`HostPool`] (host memory; the CPU reference runs on it),
//! [`ManualMover`] (wraps another mover and finishes transfers only when told,
//! to test the protocol), and `CubePool` (a CubeCL device, copies ordered on
//! the client's queue, so they finish at once).

use half::f16;
use kernels_cubecl::{PoolImage, PoolSlot};
use std::collections::BTreeMap;

/// One copy into an arena.
#[derive(Debug, Clone, Copy)]
pub enum Write<'a> {
    /// Plane words at word offset `off` of the plane arena.
    Planes {
        /// Destination offset (u32 words).
        off: usize,
        /// Source words.
        data: &'a [u32],
    },
    /// LUT entries at offset `off` of the LUT arena.
    Lut {
        /// Destination offset (f16 elements).
        off: usize,
        /// Source entries.
        data: &'a [f16],
    },
}

impl Write<'_> {
    fn owned(self) -> OwnedWrite {
        match self {
            Write::Planes { off, data } => OwnedWrite::Planes(off, data.to_vec()),
            Write::Lut { off, data } => OwnedWrite::Lut(off, data.to_vec()),
        }
    }
}

#[derive(Debug, Clone)]
enum OwnedWrite {
    Planes(usize, Vec<u32>),
    Lut(usize, Vec<f16>),
}

impl OwnedWrite {
    fn borrow(&self) -> Write<'_> {
        match self {
            OwnedWrite::Planes(off, d) => Write::Planes { off: *off, data: d },
            OwnedWrite::Lut(off, d) => Write::Lut { off: *off, data: d },
        }
    }
}

/// A transfer started by [`Mover::start`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(pub u64);

/// A copy or upload failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("page transfer failed: {0}")]
pub struct MoveError(pub String);

/// Copies page data into the device arenas and publishes the descriptor table.
pub trait Mover {
    /// Arena sizes: (plane words, LUT entries).
    fn capacity(&self) -> (usize, usize);

    /// Writes ordered with the kernels: launched-before kernels see the old
    /// contents, those launched after the next [`Self::end_boundary`] the new.
    fn write_ordered(&mut self, writes: &[Write<'_>]) -> Result<(), MoveError>;

    /// Starts a transfer that may overlap with kernels. The destinations are
    /// referenced by no committed descriptor; they may have been referenced by
    /// the table published before the current boundary, so a mover whose copies
    /// do not run on the kernels' queue must order them after the kernels
    /// already launched (on CUDA: an event recorded after them).
    fn start(&mut self, writes: &[Write<'_>]) -> Result<Ticket, MoveError>;

    /// Whether `ticket` has finished and its data is visible to kernels
    /// launched from now on. Never waits.
    fn finished(&mut self, ticket: Ticket) -> Result<bool, MoveError>;

    /// Publishes the committed descriptor table (one slot per page; `bits == 0`
    /// for a page not resident). Called only at a commit.
    fn publish(&mut self, table: &[PoolSlot]) -> Result<(), MoveError>;

    /// Closes a boundary: ordered writes issued since the last call are visible to kernels
    /// launched from now on. [`PagedWeights::boundary`](crate::PagedWeights::boundary) calls it
    /// last, so a mover may issue ordered writes asynchronously and wait for them once here.
    fn end_boundary(&mut self) -> Result<(), MoveError> {
        Ok(())
    }

    /// Whether the first copy of a boundary waits for the kernels' queue (copies that do not
    /// run on that queue), so that a caller running several tables' boundaries together can
    /// wait once for all of them ([`Self::queue_drained`]).
    fn waits_for_queue(&self) -> bool {
        false
    }

    /// The caller has just drained the kernels' queue and launches no kernel before
    /// [`Self::end_boundary`]: this boundary's copies need not wait for it again.
    fn queue_drained(&mut self) {}

    /// Announces host memory that later transfers copy from (a page's parent
    /// planes). It stays at this address, unchanged, for the mover's life, so
    /// a mover may page-lock it in place for direct asynchronous copies. Best
    /// effort: the default does nothing.
    fn pin_host(&mut self, _data: &[u8]) {}

    /// [`Self::pin_host`] for a page's host LUTs (a mover that skips plane copies may still
    /// copy LUTs). The default treats them like planes.
    fn pin_host_luts(&mut self, data: &[u8]) {
        self.pin_host(data)
    }
}

/// A mover over host memory: the arenas are a [`PoolImage`] of fixed size, so
/// [`kernels_cubecl::ap_gemm_reference`] runs on it directly. Transfers finish
/// at once.
#[derive(Debug, Clone)]
pub struct HostPool {
    /// The arenas.
    pub image: PoolImage,
    /// The last published descriptor table.
    pub table: Vec<PoolSlot>,
    /// How many times a table was published.
    pub publishes: u64,
    next: u64,
}

impl HostPool {
    /// Arenas of `plane_words` words and `lut_entries` entries, zeroed.
    pub fn new(plane_words: usize, lut_entries: usize) -> Self {
        Self {
            image: PoolImage { planes: vec![0; plane_words], luts: vec![f16::ZERO; lut_entries] },
            table: Vec::new(),
            publishes: 0,
            next: 0,
        }
    }
}

fn check_range(what: &str, off: usize, len: usize, cap: usize) -> Result<(), MoveError> {
    if off + len > cap {
        return Err(MoveError(format!("{what} write [{off}, {}) past the arena of {cap}", off + len)));
    }
    Ok(())
}

impl Mover for HostPool {
    fn capacity(&self) -> (usize, usize) {
        (self.image.planes.len(), self.image.luts.len())
    }

    fn write_ordered(&mut self, writes: &[Write<'_>]) -> Result<(), MoveError> {
        for w in writes {
            match *w {
                Write::Planes { off, data } => {
                    check_range("plane", off, data.len(), self.image.planes.len())?;
                    self.image.planes[off..off + data.len()].copy_from_slice(data);
                }
                Write::Lut { off, data } => {
                    check_range("LUT", off, data.len(), self.image.luts.len())?;
                    self.image.luts[off..off + data.len()].copy_from_slice(data);
                }
            }
        }
        Ok(())
    }

    fn start(&mut self, writes: &[Write<'_>]) -> Result<Ticket, MoveError> {
        self.write_ordered(writes)?;
        self.next += 1;
        Ok(Ticket(self.next))
    }

    fn finished(&mut self, _ticket: Ticket) -> Result<bool, MoveError> {
        Ok(true)
    }

    fn publish(&mut self, table: &[PoolSlot]) -> Result<(), MoveError> {
        self.table = table.to_vec();
        self.publishes += 1;
        Ok(())
    }
}

/// Plane word written over a transfer's destination while it is in flight.
pub const POISON_WORD: u32 = 0xA5A5_A5A5;

/// Wraps a mover and finishes transfers only when told ([`ManualMover::complete`]).
/// While a transfer is in flight its destinations hold poison (plane words
/// [`POISON_WORD`], LUT entries NaN), so a premature commit shows in any
/// kernel output that reads them.
#[derive(Debug)]
pub struct ManualMover<M> {
    /// The wrapped mover.
    pub inner: M,
    pending: BTreeMap<Ticket, Vec<OwnedWrite>>,
    next: u64,
}

impl<M: Mover> ManualMover<M> {
    /// Wraps `inner`.
    pub fn new(inner: M) -> Self {
        Self { inner, pending: BTreeMap::new(), next: 0 }
    }

    /// Transfers in flight, oldest first.
    pub fn in_flight(&self) -> Vec<Ticket> {
        self.pending.keys().copied().collect()
    }

    /// Finishes `ticket` (copies its data); false if it was not in flight.
    pub fn complete(&mut self, ticket: Ticket) -> Result<bool, MoveError> {
        let Some(writes) = self.pending.remove(&ticket) else { return Ok(false) };
        let borrowed: Vec<Write<'_>> = writes.iter().map(OwnedWrite::borrow).collect();
        self.inner.write_ordered(&borrowed)?;
        Ok(true)
    }

    /// Finishes every transfer in flight.
    pub fn complete_all(&mut self) -> Result<(), MoveError> {
        for t in self.in_flight() {
            self.complete(t)?;
        }
        Ok(())
    }
}

impl<M: Mover> Mover for ManualMover<M> {
    fn capacity(&self) -> (usize, usize) {
        self.inner.capacity()
    }

    fn write_ordered(&mut self, writes: &[Write<'_>]) -> Result<(), MoveError> {
        self.inner.write_ordered(writes)
    }

    fn start(&mut self, writes: &[Write<'_>]) -> Result<Ticket, MoveError> {
        let poison: Vec<OwnedWrite> = writes
            .iter()
            .map(|w| match *w {
                Write::Planes { off, data } => OwnedWrite::Planes(off, vec![POISON_WORD; data.len()]),
                Write::Lut { off, data } => OwnedWrite::Lut(off, vec![f16::NAN; data.len()]),
            })
            .collect();
        let borrowed: Vec<Write<'_>> = poison.iter().map(OwnedWrite::borrow).collect();
        self.inner.write_ordered(&borrowed)?;
        self.next += 1;
        let t = Ticket(self.next);
        self.pending.insert(t, writes.iter().map(|w| w.owned()).collect());
        Ok(t)
    }

    fn finished(&mut self, ticket: Ticket) -> Result<bool, MoveError> {
        Ok(!self.pending.contains_key(&ticket))
    }

    fn publish(&mut self, table: &[PoolSlot]) -> Result<(), MoveError> {
        self.inner.publish(table)
    }

    fn end_boundary(&mut self) -> Result<(), MoveError> {
        self.inner.end_boundary()
    }

    fn waits_for_queue(&self) -> bool {
        self.inner.waits_for_queue()
    }

    fn queue_drained(&mut self) {
        self.inner.queue_drained()
    }

    fn pin_host(&mut self, data: &[u8]) {
        self.inner.pin_host(data)
    }

    fn pin_host_luts(&mut self, data: &[u8]) {
        self.inner.pin_host_luts(data)
    }
}
