//! Expert pages across the GPUs of one host: which GPU holds each expert, one plan per GPU,
//! and moving an expert to another GPU when one is short of memory and another is not.
//!
//! An expert's two pages (gate_up and down) live on the same GPU, so a routed token visits one
//! GPU per chosen expert. Each GPU has its own budget for pages and KV cache: the planner's
//! target and greedy choice run per GPU over the pages it holds, with the same damage model
//! (sensitivities, routing multipliers, residual factors) as on one GPU.

use crate::{MemoryTarget, Plan, PlanError, PlannerConfig, ResidualFactors, RoutingStats, Snapshot, plan};

/// The GPU holding each expert of each layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    gpus: usize,
    /// `[layer][expert]` → GPU.
    owner: Vec<Vec<usize>>,
}

/// An expert moved between GPUs by [`Placement::relieve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertMove {
    /// Decoder layer.
    pub layer: usize,
    /// Expert within the layer.
    pub expert: usize,
    /// GPU it leaves.
    pub from: usize,
    /// GPU it goes to.
    pub to: usize,
    /// Bytes of its pages at their committed bit-widths (what the copy moves).
    pub bytes: u64,
}

impl Placement {
    /// Every expert of the snapshot's layers on GPU 0 (one GPU: nothing changes).
    pub fn single(snapshot: &Snapshot) -> Self {
        let (layers, experts) = snapshot.extent();
        Self { gpus: 1, owner: vec![vec![0; experts]; layers] }
    }

    /// Partitions every layer's experts over `gpus` GPUs, balancing two loads: each layer's
    /// routing share per GPU (the tokens each GPU's experts compute in that layer) and the
    /// committed bytes per GPU over all layers (its memory). Experts are placed heaviest first
    /// (by share, then bytes) on the GPU where the sum of the two normalised loads is lowest,
    /// at most `⌈experts / gpus⌉` per GPU and layer. `routing` gives the shares (all 1 without
    /// it).
    pub fn balanced(
        snapshot: &Snapshot,
        routing: Option<&RoutingStats>,
        gpus: usize,
    ) -> Result<Self, PlanError> {
        if gpus == 0 {
            return Err(PlanError::Shape { what: "placement".into(), reason: "zero GPUs".into() });
        }
        let (layers, experts) = snapshot.extent();
        let mut bytes = vec![vec![0u64; experts]; layers];
        for p in &snapshot.pages {
            bytes[p.id.layer][p.id.expert] += p.bytes_at(p.committed);
        }
        let total_bytes = bytes.iter().flatten().sum::<u64>().max(1) as f64;
        let share = |l: usize, e: usize| routing.map_or(1.0, |r| r.share(l, e));
        let cap = experts.div_ceil(gpus);
        let mut owner = vec![vec![0usize; experts]; layers];
        let mut gpu_bytes = vec![0u64; gpus];
        for l in 0..layers {
            let layer_share: f64 = (0..experts).map(|e| share(l, e)).sum::<f64>().max(f64::MIN_POSITIVE);
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| share(l, b).total_cmp(&share(l, a)).then(bytes[l][b].cmp(&bytes[l][a])));
            let (mut load, mut count) = (vec![0.0f64; gpus], vec![0usize; gpus]);
            for e in order {
                let cost = |g: usize| load[g] / layer_share + gpu_bytes[g] as f64 / total_bytes;
                let g = (0..gpus)
                    .filter(|&g| count[g] < cap)
                    .min_by(|&a, &b| cost(a).total_cmp(&cost(b)).then(a.cmp(&b)))
                    .expect("gpus · cap >= experts");
                owner[l][e] = g;
                load[g] += share(l, e);
                count[g] += 1;
                gpu_bytes[g] += bytes[l][e];
            }
        }
        Ok(Self { gpus, owner })
    }

    /// GPUs.
    pub fn gpus(&self) -> usize {
        self.gpus
    }

    /// The GPU holding expert `expert` of `layer`.
    pub fn gpu_of(&self, layer: usize, expert: usize) -> usize {
        self.owner[layer][expert]
    }

    /// Per GPU, the indices into `snapshot.pages` of the pages it holds.
    pub fn pages_by_gpu(&self, snapshot: &Snapshot) -> Vec<Vec<usize>> {
        let mut out = vec![Vec::new(); self.gpus];
        for (i, p) in snapshot.pages.iter().enumerate() {
            out[self.gpu_of(p.id.layer, p.id.expert)].push(i);
        }
        out
    }

    /// Per GPU, the committed bytes of the pages it holds.
    pub fn committed_bytes(&self, snapshot: &Snapshot) -> Vec<u64> {
        let mut out = vec![0; self.gpus];
        for p in &snapshot.pages {
            out[self.gpu_of(p.id.layer, p.id.expert)] += p.bytes_at(p.committed);
        }
        out
    }

    /// Moves one expert off GPU `short`, which needs `needed` more bytes than it has, to the GPU
    /// with the most spare bytes (`spare[g]`, what each GPU's budget leaves after its pages and
    /// KV cache) that can take it whole: the smallest expert on `short` that covers `needed`,
    /// else the largest that fits. `None` when no other GPU can take any of its experts.
    pub fn relieve(
        &mut self,
        snapshot: &Snapshot,
        short: usize,
        needed: u64,
        spare: &[u64],
    ) -> Option<ExpertMove> {
        let to = (0..self.gpus).filter(|&g| g != short).max_by_key(|&g| (spare[g], std::cmp::Reverse(g)))?;
        let mut sizes = std::collections::BTreeMap::<(usize, usize), u64>::new();
        for p in &snapshot.pages {
            if self.gpu_of(p.id.layer, p.id.expert) == short {
                *sizes.entry((p.id.layer, p.id.expert)).or_default() += p.bytes_at(p.committed);
            }
        }
        let fits = sizes.iter().filter(|(_, b)| **b <= spare[to]);
        let pick = fits
            .clone()
            .filter(|(_, b)| **b >= needed)
            .min_by_key(|(k, b)| (**b, **k))
            .or_else(|| fits.max_by_key(|(k, b)| (**b, std::cmp::Reverse(**k))))?;
        let (&(layer, expert), &bytes) = pick;
        self.owner[layer][expert] = to;
        Some(ExpertMove { layer, expert, from: short, to, bytes })
    }
}

/// One [`plan`] per GPU over the pages it holds, each toward its own target, merged into one
/// desired bit-width per page of `snapshot` (snapshot order). Returns the merged desired widths
/// and the per-GPU plans (each plan's `desired` in the order of
/// [`Placement::pages_by_gpu`]).
pub fn plan_per_gpu(
    snapshot: &Snapshot,
    placement: &Placement,
    routing: Option<&RoutingStats>,
    residual: Option<&ResidualFactors>,
    targets: &[MemoryTarget],
    config: &PlannerConfig,
) -> Result<(Vec<u8>, Vec<Plan>), PlanError> {
    if targets.len() != placement.gpus() {
        return Err(PlanError::Shape {
            what: "per-GPU targets".into(),
            reason: format!("{} targets for {} GPUs", targets.len(), placement.gpus()),
        });
    }
    let mut desired: Vec<u8> = snapshot.pages.iter().map(|p| p.desired).collect();
    let mut plans = Vec::with_capacity(placement.gpus());
    for (pages, &target) in placement.pages_by_gpu(snapshot).iter().zip(targets) {
        let sub = Snapshot { pages: pages.iter().map(|&i| snapshot.pages[i].clone()).collect() };
        let p = plan(&sub, routing, residual, target, config)?;
        for (&i, &d) in pages.iter().zip(&p.desired) {
            desired[i] = d;
        }
        plans.push(p);
    }
    Ok((desired, plans))
}
