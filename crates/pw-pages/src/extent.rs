//! A first-fit extent allocator over one arena (offsets and lengths in
//! elements of the arena's type), with coalescing of neighbouring free ranges.
//!
//! Fragmentation: the grouped kernel reads a page's planes `0..q` as one
//! contiguous run (`plane_off + p·rows·words`), so a page's planes form one
//! extent. Lowering frees the extent's tail in place; raising first tries to
//! grow the extent in place ([`ExtentAllocator::alloc_at`] on the range right
//! after it) and otherwise relocates the page into a fresh extent. A model has
//! only two page shapes (gate_up, down), so holes left by one page are exactly
//! the sizes other pages of that shape need, and first fit reuses them. When no
//! run is long enough the raising is deferred with that reason (it is retried
//! at the next boundary), never forced.
//!
//! LUTs vary in size 32× between 3 and 8 bits, so the page table takes the
//! LUT of a page's top width from the low end (first fit) and every smaller
//! one from the high end ([`ExtentAllocator::alloc_high`]); a lowering moves
//! its small LUT there and frees the whole large one, so the hole it leaves
//! is exactly what raising it back needs.

use std::collections::BTreeMap;

/// A range `[off, off + len)` of an arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// First element.
    pub off: usize,
    /// Elements.
    pub len: usize,
}

impl Extent {
    /// One past the last element.
    pub fn end(&self) -> usize {
        self.off + self.len
    }
}

/// First-fit allocator of extents in `0..capacity`.
#[derive(Debug, Clone)]
pub struct ExtentAllocator {
    capacity: usize,
    /// Free runs: offset → length, never adjacent (coalesced).
    free: BTreeMap<usize, usize>,
    used: usize,
}

impl ExtentAllocator {
    /// An empty arena of `capacity` elements.
    pub fn new(capacity: usize) -> Self {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Self { capacity, free, used: 0 }
    }

    /// Arena size in elements.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Elements allocated.
    pub fn used(&self) -> usize {
        self.used
    }

    /// The longest free run.
    pub fn largest_free(&self) -> usize {
        self.free.values().copied().max().unwrap_or(0)
    }

    /// The free runs, in address order.
    pub fn free_runs(&self) -> impl Iterator<Item = Extent> + '_ {
        self.free.iter().map(|(&off, &len)| Extent { off, len })
    }

    /// Allocates `len > 0` elements at the lowest offset that fits.
    pub fn alloc(&mut self, len: usize) -> Option<Extent> {
        assert!(len > 0, "zero-length extent");
        let (&off, &run) = self.free.iter().find(|&(_, &run)| run >= len)?;
        self.take(off, run, off, len);
        Some(Extent { off, len })
    }

    /// Allocates `len > 0` elements at the top of the highest run that fits
    /// (last fit). Short-lived or small extents taken from the top keep the
    /// low end's runs long for the large ones.
    pub fn alloc_high(&mut self, len: usize) -> Option<Extent> {
        assert!(len > 0, "zero-length extent");
        let (&start, &run) = self.free.iter().rev().find(|&(_, &run)| run >= len)?;
        let off = start + run - len;
        self.take(start, run, off, len);
        Some(Extent { off, len })
    }

    /// Allocates exactly `[off, off + len)` if all of it is free.
    pub fn alloc_at(&mut self, off: usize, len: usize) -> Option<Extent> {
        assert!(len > 0, "zero-length extent");
        let (&start, &run) = self.free.range(..=off).next_back()?;
        if start + run < off + len {
            return None;
        }
        self.take(start, run, off, len);
        Some(Extent { off, len })
    }

    fn take(&mut self, start: usize, run: usize, off: usize, len: usize) {
        self.free.remove(&start);
        if off > start {
            self.free.insert(start, off - start);
        }
        if off + len < start + run {
            self.free.insert(off + len, start + run - off - len);
        }
        self.used += len;
    }

    /// Frees `e`, which must be allocated.
    ///
    /// # Panics
    /// If `e` overlaps a free run or the end of the arena: a double free is a
    /// bookkeeping bug that would let two pages share memory.
    pub fn free(&mut self, e: Extent) {
        if e.len == 0 {
            return;
        }
        assert!(e.end() <= self.capacity, "freeing {e:?} past the arena ({})", self.capacity);
        let mut off = e.off;
        let mut len = e.len;
        if let Some((&p, &pl)) = self.free.range(..=e.off).next_back() {
            assert!(p + pl <= e.off, "double free of {e:?}");
            if p + pl == e.off {
                self.free.remove(&p);
                off = p;
                len += pl;
            }
        }
        if let Some((&n, &nl)) = self.free.range(e.off..).next() {
            assert!(n >= e.end(), "double free of {e:?}");
            if n == e.end() {
                self.free.remove(&n);
                len += nl;
            }
        }
        self.free.insert(off, len);
        self.used -= e.len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_coalesces_and_grows_in_place() {
        let mut a = ExtentAllocator::new(100);
        let x = a.alloc(30).unwrap();
        let y = a.alloc(30).unwrap();
        let z = a.alloc(30).unwrap();
        assert_eq!((x.off, y.off, z.off), (0, 30, 60));
        assert!(a.alloc(11).is_none());
        assert_eq!(a.alloc_high(10), Some(Extent { off: 90, len: 10 }));
        a.free(Extent { off: 90, len: 10 });
        a.free(y);
        assert_eq!(a.largest_free(), 30);
        // Growing x into y's old place.
        assert_eq!(a.alloc_at(30, 20), Some(Extent { off: 30, len: 20 }));
        assert!(a.alloc_at(49, 2).is_none());
        a.free(Extent { off: 30, len: 20 });
        a.free(x);
        assert_eq!(
            a.free_runs().collect::<Vec<_>>(),
            vec![Extent { off: 0, len: 60 }, Extent { off: 90, len: 10 }]
        );
        a.free(z);
        assert_eq!(a.free_runs().collect::<Vec<_>>(), vec![Extent { off: 0, len: 100 }]);
        assert_eq!(a.used(), 0);
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_is_caught() {
        let mut a = ExtentAllocator::new(10);
        let x = a.alloc(4).unwrap();
        a.free(x);
        a.free(x);
    }
}
