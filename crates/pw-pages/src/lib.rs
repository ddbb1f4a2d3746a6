//! The weight page table of PagedWeight.
//!
//! - [`Accountant`]: one byte budget shared by weight pages and the KV cache;
//!   every byte is a [`Lease`], and a lease past the budget is refused.
//! - [`PagedWeights`]: one page per (layer, expert, gate_up|down) with desired
//!   bits d and committed bits q; the host keeps each page's max-bit parent,
//!   the GPU the planes `0..q` and the LUT of width q in arena extents.
//! - The commit protocol ([`PagedWeights::boundary`]): lowerings commit at
//!   once (lower q, then free the dropped planes and the LUT's tail), raisings
//!   copy planes + LUT in first and commit at the first boundary after their
//!   transfer finished; the kernels' descriptor table changes only there.
//! - [`Mover`]: copies into the device arenas. [`CubePool`] on any CubeCL
//!   runtime (copies ordered on the client's queue), `CudaMover` (feature
//!   `cuda`: asynchronous pinned copies on a stream of their own, polled by
//!   event; [`device_mover`] picks it on CUDA), [`HostPool`] on the CPU, [`ManualMover`] finishing transfers only
//!   when told (tests).

//!
//! # Memory model
//! The arenas are two device buffers sized when the mover is built (see
//! [`PagedWeights::arena_size_for`]); CubeCL 0.10 has no virtual memory
//! mapping, so they are physically allocated at that size. The budget that
//! matters is the accountant's: every extent a page holds (committed or in
//! flight) is leased from it, and the KV cache leases from the same budget, so
//! weights + KV never exceed it. Give the arenas some slack above the weight
//! share of the budget: a raising holds its new LUT (and, when it cannot grow
//! in place, its new planes) beside the committed ones until it commits.
//!
//! # Fragmentation
//! A page's planes `0..q` are one extent (the kernel reads them contiguously).
//! Lowering frees the extent's tail; raising grows it in place when the run
//! after it is free, else copies the page into a new extent. LUTs of a page's
//! top width come from the arena's low end, smaller ones from its high end. A
//! raising that finds no long enough run is deferred with
//! [`DeferReason::Fragmented`], and the boundary starts one relocation per
//! arena (a page copied from its host parent into another free run, committed
//! like a raising) that lengthens the longest free run.

mod accountant;
mod cube;
#[cfg(feature = "cuda")]
mod cuda;
mod extent;
mod mover;
mod table;

pub use accountant::{Accountant, BudgetError, Lease, MemoryUsage, Use};
pub use cube::{CubePool, DeviceMover, device_mover};
#[cfg(feature = "cuda")]
pub use cuda::{CudaMover, device_memory};
pub use extent::{Extent, ExtentAllocator};
pub use mover::{HostPool, ManualMover, MoveError, Mover, POISON_WORD, Ticket, Write};
pub use table::{
    BoundaryTimes, CommitReport, DeferReason, Deferred, Group, Location, PageId, PageInfo, PageKey,
    PagedWeights, boundaries,
};

/// Errors of the page table.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    /// Two blocks claim the same page.
    #[error("block {name}: {key} appears twice")]
    DuplicatePage {
        /// The page.
        key: PageKey,
        /// The second block's name.
        name: String,
    },
    /// A block cannot be paged.
    #[error("block {name}: {reason}")]
    BadBlock {
        /// Block name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// No such page.
    #[error("no page for {key}")]
    UnknownPage {
        /// The key asked for.
        key: PageKey,
    },
    /// A page id out of range.
    #[error("page id {id} out of range ({pages} pages)")]
    BadPageId {
        /// The id.
        id: usize,
        /// Pages in the table.
        pages: usize,
    },
    /// A bit-width the block does not store.
    #[error("block {name}: {bits} bits outside its range {min}..={max}")]
    BitsOutOfRange {
        /// Block name.
        name: String,
        /// Bits asked for.
        bits: u8,
        /// Lowest stored.
        min: u8,
        /// Highest stored.
        max: u8,
    },
    /// A launch needs a page that has no committed state on the GPU.
    #[error("{key} is not resident on the GPU")]
    NotResident {
        /// The page.
        key: PageKey,
    },
    /// Reading the checkpoint failed.
    #[error(transparent)]
    Format(#[from] pw_format::FormatError),
    /// A transfer failed.
    #[error(transparent)]
    Move(#[from] MoveError),
}
