//! The planner's view of the page table: one [`PageState`] per (layer, expert, block).

use pw_format::{BlockEntry, BlockKind, Manifest};

use crate::PlanError;

/// Identity of a page: one expert block of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageId {
    /// Decoder layer.
    pub layer: usize,
    /// Expert within the layer.
    pub expert: usize,
    /// Which projection (gate and up share a page).
    pub kind: BlockKind,
}

impl PageId {
    /// Column of `kind` in per-(layer, kind) tables: gate_up 0, down 1.
    pub fn kind_index(kind: BlockKind) -> usize {
        match kind {
            BlockKind::GateUp => 0,
            BlockKind::Down => 1,
        }
    }
}

impl std::fmt::Display for PageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "layer {} expert {} {}", self.layer, self.expert, self.kind.name())
    }
}

/// What the planner needs to know about one page.
#[derive(Debug, Clone, PartialEq)]
pub struct PageState {
    /// The page.
    pub id: PageId,
    /// Desired bit-width `d` (what the page table is moving towards).
    pub desired: u8,
    /// Committed bit-width `q` (what the kernels read now).
    pub committed: u8,
    /// Lowest stored bit-width.
    pub min_bits: u8,
    /// Highest stored bit-width.
    pub max_bits: u8,
    /// Device bytes (planes + LUT) at each bit-width `min_bits..=max_bits`, index `b - min_bits`.
    pub bytes: Vec<u64>,
    /// Importance-weighted squared error at each bit-width `min_bits..=max_bits` (the
    /// quantizer's offline global sensitivity), index `b - min_bits`.
    pub sensitivity: Vec<f64>,
}

impl PageState {
    /// The page of a manifest entry at the given desired and committed bit-widths.
    pub fn from_entry(entry: &BlockEntry, desired: u8, committed: u8) -> Self {
        let bytes = (entry.min_bits..=entry.max_bits)
            .map(|b| {
                let (planes, lut) = entry.bytes_at(b);
                (planes + lut) as u64
            })
            .collect();
        Self {
            id: PageId { layer: entry.layer, expert: entry.expert, kind: entry.kind },
            desired,
            committed,
            min_bits: entry.min_bits,
            max_bits: entry.max_bits,
            bytes,
            sensitivity: entry.sensitivity.clone(),
        }
    }

    /// Bytes at `bits` (must be within `min_bits..=max_bits`).
    pub fn bytes_at(&self, bits: u8) -> u64 {
        self.bytes[(bits - self.min_bits) as usize]
    }

    /// Sensitivity at `bits` (must be within `min_bits..=max_bits`).
    pub fn sensitivity_at(&self, bits: u8) -> f64 {
        self.sensitivity[(bits - self.min_bits) as usize]
    }

    /// Whether [`Self::validate`] passes, without building an error: branch-free scans, cheap
    /// enough for the planner to check every page on every call.
    #[inline]
    pub fn is_valid(&self) -> bool {
        let n = self.bytes.len();
        let range = self.min_bits..=self.max_bits;
        self.min_bits != 0
            && self.min_bits <= self.max_bits
            && (self.max_bits - self.min_bits) as usize + 1 == n
            && self.sensitivity.len() == n
            && range.contains(&self.desired)
            && range.contains(&self.committed)
            && self.bytes.windows(2).fold(true, |ok, w| ok & (w[1] > w[0]))
            && self.sensitivity.iter().fold(true, |ok, s| ok & s.is_finite() & (*s >= 0.0))
    }

    /// Checks the page's invariants; the error names the page and the field.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.is_valid() {
            return Ok(());
        }
        let err = |reason: String| PlanError::Page { page: self.id.to_string(), reason };
        if self.min_bits == 0 || self.min_bits > self.max_bits {
            return Err(err(format!(
                "bit range {}..={} is empty or starts at 0",
                self.min_bits, self.max_bits
            )));
        }
        let n = (self.max_bits - self.min_bits + 1) as usize;
        for (field, v) in [("desired", self.desired), ("committed", self.committed)] {
            if !(self.min_bits..=self.max_bits).contains(&v) {
                return Err(err(format!(
                    "field `{field}` is {v}, outside the stored range {}..={}",
                    self.min_bits, self.max_bits
                )));
            }
        }
        if self.bytes.len() != n {
            return Err(err(format!("field `bytes` has {} entries, expected {n}", self.bytes.len())));
        }
        if self.sensitivity.len() != n {
            return Err(err(format!(
                "field `sensitivity` has {} entries, expected {n}",
                self.sensitivity.len()
            )));
        }
        // A move that frees nothing has no damage per byte; bytes must grow with bits.
        if self.bytes.windows(2).any(|w| w[1] <= w[0]) {
            return Err(err(format!("field `bytes` is not strictly increasing in bits: {:?}", self.bytes)));
        }
        if let Some(s) = self.sensitivity.iter().find(|s| !s.is_finite() || **s < 0.0) {
            return Err(err(format!("field `sensitivity` holds {s}, expected finite and >= 0")));
        }
        Ok(())
    }
}

/// A copy of the page table's state, taken at a safe boundary. The page table can keep one
/// alive and update `desired`/`committed` in place between calls, so taking it costs nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Pages in a fixed order; [`crate::Plan::desired`] follows the same order.
    pub pages: Vec<PageState>,
}

impl Snapshot {
    /// Every block of a quantized checkpoint's manifest, all desired and committed at `bits`
    /// (clamped into each block's stored range).
    pub fn from_manifest(manifest: &Manifest, bits: u8) -> Result<Self, PlanError> {
        let pages: Vec<PageState> = manifest
            .blocks
            .iter()
            .map(|e| {
                let b = bits.clamp(e.min_bits, e.max_bits);
                PageState::from_entry(e, b, b)
            })
            .collect();
        let s = Self { pages };
        s.validate()?;
        Ok(s)
    }

    /// Checks every page.
    pub fn validate(&self) -> Result<(), PlanError> {
        self.pages.iter().try_for_each(PageState::validate)
    }

    /// Device bytes of the desired state.
    pub fn desired_bytes(&self) -> u64 {
        self.pages.iter().map(|p| p.bytes_at(p.desired)).sum()
    }

    /// Device bytes of the committed state.
    pub fn committed_bytes(&self) -> u64 {
        self.pages.iter().map(|p| p.bytes_at(p.committed)).sum()
    }

    /// Bytes in flight: `(to_free, to_allocate)`. `to_free` will return to the pool when
    /// pending lowerings (desired < committed) commit; `to_allocate` is still to be taken by
    /// pending raisings (desired > committed). A page table that allocates at the start of a
    /// transfer should pass its own figure for the second instead.
    pub fn pending_bytes(&self) -> (u64, u64) {
        let mut free = 0;
        let mut alloc = 0;
        for p in &self.pages {
            let (d, q) = (p.bytes_at(p.desired), p.bytes_at(p.committed));
            if d < q {
                free += q - d;
            } else {
                alloc += d - q;
            }
        }
        (free, alloc)
    }

    /// Number of layers and experts the page ids span: `(max layer + 1, max expert + 1)`.
    pub fn extent(&self) -> (usize, usize) {
        self.pages.iter().fold((0, 0), |(l, e), p| (l.max(p.id.layer + 1), e.max(p.id.expert + 1)))
    }
}
