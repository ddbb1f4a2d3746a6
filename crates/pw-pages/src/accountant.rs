//! The memory accountant: one byte budget shared by the weight pages and the
//! KV cache. Every byte either holds is a [`Lease`] taken from it; a lease
//! that would exceed the budget is refused, so over-budget is impossible by
//! construction rather than detected afterwards.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

/// What a lease's bytes are used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Use {
    /// Expert weight planes and LUTs.
    Weights,
    /// KV-cache blocks.
    Kv,
}

impl fmt::Display for Use {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Use::Weights => "weights",
            Use::Kv => "KV cache",
        })
    }
}

/// A lease was refused: it would have exceeded the budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{requested} bytes for {what} exceed the budget: {free} of {budget} bytes free")]
pub struct BudgetError {
    /// What the bytes were for.
    pub what: Use,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes free when asked.
    pub free: u64,
    /// The total budget.
    pub budget: u64,
}

/// A snapshot of the accountant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Total budget in bytes.
    pub budget: u64,
    /// Bytes leased for weights.
    pub weights: u64,
    /// Bytes leased for the KV cache.
    pub kv: u64,
    /// `budget − weights − kv`.
    pub free: u64,
}

#[derive(Debug)]
struct Inner {
    budget: u64,
    weights: u64,
    kv: u64,
}

impl Inner {
    fn used(&self) -> u64 {
        self.weights + self.kv
    }

    fn slot(&mut self, what: Use) -> &mut u64 {
        match what {
            Use::Weights => &mut self.weights,
            Use::Kv => &mut self.kv,
        }
    }
}

/// The shared byte budget. Cloning gives another handle on the same budget.
#[derive(Debug, Clone)]
pub struct Accountant {
    inner: Arc<Mutex<Inner>>,
}

impl Accountant {
    /// An accountant with `budget` bytes, all free.
    pub fn new(budget: u64) -> Self {
        Self { inner: Arc::new(Mutex::new(Inner { budget, weights: 0, kv: 0 })) }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the counters half-updated
        // (every update is one statement), so a poisoned lock is still valid.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Current usage.
    pub fn usage(&self) -> MemoryUsage {
        let g = self.lock();
        MemoryUsage { budget: g.budget, weights: g.weights, kv: g.kv, free: g.budget - g.used() }
    }

    /// Bytes free now.
    pub fn free(&self) -> u64 {
        self.usage().free
    }

    /// Leases `bytes` for `what`, or refuses when they do not fit.
    pub fn lease(&self, what: Use, bytes: u64) -> Result<Lease, BudgetError> {
        let mut g = self.lock();
        let free = g.budget - g.used();
        if bytes > free {
            return Err(BudgetError { what, requested: bytes, free, budget: g.budget });
        }
        *g.slot(what) += bytes;
        Ok(Lease { owner: self.clone(), what, bytes })
    }

    /// Leases `blocks` KV-cache blocks of `block_bytes` each, all or nothing.
    pub fn lease_kv_blocks(&self, blocks: u64, block_bytes: u64) -> Result<Lease, BudgetError> {
        let bytes = blocks.saturating_mul(block_bytes);
        self.lease(Use::Kv, bytes)
    }

    /// How many KV blocks of `block_bytes` would fit in the free bytes now.
    pub fn free_kv_blocks(&self, block_bytes: u64) -> u64 {
        self.free().checked_div(block_bytes).unwrap_or(0)
    }

    /// Lowers or raises the budget. Lowering below the bytes in use is refused
    /// (free memory first): the budget can never be exceeded. The error's
    /// `requested` is the bytes in use, `budget` the budget asked for.
    pub fn set_budget(&self, budget: u64) -> Result<(), BudgetError> {
        let mut g = self.lock();
        if budget < g.used() {
            return Err(BudgetError { what: Use::Weights, requested: g.used(), free: budget, budget });
        }
        g.budget = budget;
        Ok(())
    }

    fn release(&self, what: Use, bytes: u64) {
        let mut g = self.lock();
        *g.slot(what) -= bytes;
    }
}

/// Bytes held from an [`Accountant`]; dropping the lease gives them back.
#[derive(Debug)]
pub struct Lease {
    owner: Accountant,
    what: Use,
    bytes: u64,
}

impl Lease {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// What the bytes are for.
    pub fn what(&self) -> Use {
        self.what
    }

    /// Gives back `bytes` of the lease and keeps the rest.
    ///
    /// # Panics
    /// If `bytes` exceeds the lease: that would be a bookkeeping bug.
    pub fn shrink(&mut self, bytes: u64) {
        assert!(bytes <= self.bytes, "shrinking a lease of {} bytes by {bytes}", self.bytes);
        self.owner.release(self.what, bytes);
        self.bytes -= bytes;
    }

    /// Merges `other` (same accountant and use) into this lease.
    ///
    /// # Panics
    /// If the uses differ: that would be a bookkeeping bug.
    pub fn absorb(&mut self, mut other: Lease) {
        assert!(
            other.what == self.what && Arc::ptr_eq(&other.owner.inner, &self.owner.inner),
            "merging leases of different accountants or uses"
        );
        self.bytes += other.bytes;
        other.bytes = 0;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.owner.release(self.what, self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_refused_past_the_budget_and_returned_on_drop() {
        let a = Accountant::new(1000);
        let w = a.lease(Use::Weights, 600).unwrap();
        let kv = a.lease_kv_blocks(3, 100).unwrap();
        assert_eq!(a.usage(), MemoryUsage { budget: 1000, weights: 600, kv: 300, free: 100 });
        let e = a.lease(Use::Weights, 101).unwrap_err();
        assert_eq!((e.requested, e.free, e.budget), (101, 100, 1000));
        assert!(e.to_string().contains("101 bytes for weights exceed the budget"), "{e}");
        assert_eq!(a.free_kv_blocks(30), 3);
        drop(kv);
        assert_eq!(a.usage().kv, 0);
        let mut w2 = a.lease(Use::Weights, 400).unwrap();
        w2.shrink(150);
        assert_eq!(a.usage().weights, 850);
        let mut w = w;
        w.absorb(w2);
        assert_eq!(w.bytes(), 850);
        assert_eq!(a.usage().weights, 850);
        drop(w);
        assert_eq!(a.usage(), MemoryUsage { budget: 1000, weights: 0, kv: 0, free: 1000 });
    }

    #[test]
    fn the_budget_cannot_drop_below_what_is_in_use() {
        let a = Accountant::new(1000);
        let _w = a.lease(Use::Weights, 700).unwrap();
        assert!(a.set_budget(600).is_err());
        a.set_budget(700).unwrap();
        assert_eq!(a.free(), 0);
        assert!(a.lease_kv_blocks(1, 1).is_err());
    }
}
