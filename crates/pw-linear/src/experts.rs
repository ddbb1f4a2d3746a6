//! [`PagedExperts`]: the paged implementation of the models' expert bank
//! ([`pw_nn::ExpertBank`]).
//!
//! One bank per MoE layer, all banks of a model over one [`PageTable`] (one page per
//! (layer, expert, gate_up|down)). A forward groups the routed (token, slot) pairs by expert
//! and runs every expert of the layer in two grouped launches (gate_up, then down with
//! `act(gate) · up` fused into its load), whatever the mix of committed bit-widths; the routing
//! weights and the combine over each token's slots are Burn ops, as in the dense bank.

use std::sync::Arc;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use kernels_cubecl::Activation;
use pw_nn::{Act, ExpertBank, Experts, ExternalExperts, GatedMlpConfig, Routing};
use pw_pages::PageId;

use crate::cube::{self, ExpertGroup, index_tensor};
use crate::{PageTable, PagedLinear, PagedLinearError};

/// One expert's two projections, as views of their pages.
#[derive(Debug, Clone)]
pub struct ExpertLinears<B: Backend> {
    /// `[hidden] → [2 · intermediate]`: gate outputs, then up outputs.
    pub gate_up: PagedLinear<B>,
    /// `[intermediate] → [hidden]`.
    pub down: PagedLinear<B>,
}

/// The expert bank of one MoE layer over a shared [`PageTable`].
#[derive(Debug, Clone)]
pub struct PagedExperts<B: Backend> {
    table: PageTable,
    gate_up: Vec<PageId>,
    down: Vec<PageId>,
    cfg: GatedMlpConfig,
    act: Activation,
    linears: Vec<ExpertLinears<B>>,
}

impl<B: Backend> PagedExperts<B> {
    /// A bank over the pages `gate_up[e]` (`[2I, H]`) and `down[e]` (`[H, I]`) of `table`.
    /// Errors name the page whose shape does not match `cfg`, or an activation the fused kernel
    /// does not have (exact GELU).
    pub fn new(
        table: PageTable,
        gate_up: Vec<PageId>,
        down: Vec<PageId>,
        cfg: GatedMlpConfig,
    ) -> Result<Self, PagedLinearError> {
        let act = match cfg.act {
            Act::Silu => Activation::SiluMul,
            Act::GeluTanh => Activation::GeluTanhMul,
            Act::Gelu => {
                return Err(PagedLinearError::Bank(
                    "exact GELU has no fused kernel (SiLU and tanh-GELU do)".into(),
                ));
            }
        };
        if gate_up.len() != down.len() || gate_up.is_empty() {
            return Err(PagedLinearError::Bank(format!(
                "{} gate_up pages and {} down pages",
                gate_up.len(),
                down.len()
            )));
        }
        let (h, i) = (cfg.hidden, cfg.intermediate);
        let mut linears = Vec::with_capacity(gate_up.len());
        for (&g, &d) in gate_up.iter().zip(&down) {
            for (id, want) in [(g, (2 * i, h)), (d, (h, i))] {
                let info = table.info(id)?;
                if (info.rows, info.cols) != want {
                    return Err(PagedLinearError::Bank(format!(
                        "block {} is [{}, {}], the model expects [{}, {}]",
                        info.name, info.rows, info.cols, want.0, want.1
                    )));
                }
            }
            linears.push(ExpertLinears {
                gate_up: PagedLinear::view(table.clone(), g, None)?,
                down: PagedLinear::view(table.clone(), d, None)?,
            });
        }
        Ok(Self { table, gate_up, down, cfg, act, linears })
    }

    /// Expert `e`'s projections as [`PagedLinear`] views (same pages, no copy).
    pub fn expert(&self, e: usize) -> &ExpertLinears<B> {
        &self.linears[e]
    }

    /// The table the bank's pages live in.
    pub fn table(&self) -> &PageTable {
        &self.table
    }

    /// Expert shape and activation.
    pub fn config(&self) -> GatedMlpConfig {
        self.cfg
    }

    /// The bank as the models' [`Experts`].
    pub fn into_experts(self) -> Experts<B>
    where
        B: 'static,
    {
        Experts::External(ExternalExperts::new(Arc::new(self)))
    }

    /// Sum over each token's chosen experts of `weight · expert(x)`, or an error when a routed
    /// expert's page is not resident.
    ///
    /// # Shapes
    /// - `x`: `[tokens, hidden]`
    /// - output: `[tokens, hidden]`
    pub fn try_forward(
        &self,
        x: Tensor<B, 2>,
        routing: &Routing<B>,
    ) -> Result<Tensor<B, 2>, PagedLinearError> {
        let [t, h] = x.dims();
        let k = routing.k;
        let device = x.device();
        if t == 0 {
            return Ok(x);
        }
        // Group (token, slot) pairs by expert, rows stacked expert by expert.
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.gate_up.len()];
        for (pos, &e) in routing.indices.iter().enumerate() {
            let bank = by_expert.get_mut(e).ok_or_else(|| {
                PagedLinearError::Bank(format!("routed to expert {e}, the bank has {}", self.gate_up.len()))
            })?;
            bank.push((pos / k, pos));
        }
        let (mut tok, mut slot, mut groups) = (Vec::new(), Vec::new(), Vec::new());
        let mut row_of_slot = vec![0i64; t * k];
        for (e, pairs) in by_expert.iter().enumerate() {
            if pairs.is_empty() {
                continue;
            }
            groups.push(ExpertGroup { expert: e, row0: tok.len(), tokens: pairs.len() });
            for &(tk, s) in pairs {
                row_of_slot[s] = tok.len() as i64;
                tok.push(tk as i64);
                slot.push(s as i64);
            }
        }
        let xg = x.select(0, index_tensor::<B>(tok, &device));
        let y = cube::experts(&self.table, (&self.gate_up, &self.down), &groups, xg, self.act)?;
        let w = routing.weights.clone().reshape([t * k, 1]).select(0, index_tensor::<B>(slot, &device));
        Ok((y * w)
            .select(0, index_tensor::<B>(row_of_slot, &device))
            .reshape([t, k, h])
            .sum_dim(1)
            .reshape([t, h]))
    }
}

impl<B: Backend> ExpertBank<B> for PagedExperts<B> {
    fn num_experts(&self) -> usize {
        self.gate_up.len()
    }

    fn forward(&self, x: Tensor<B, 2>, routing: &Routing<B>) -> Tensor<B, 2> {
        // Not resident or mis-routed: a model built over a settled table never gets here.
        self.try_forward(x, routing).unwrap_or_else(|e| panic!("paged experts: {e}"))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
