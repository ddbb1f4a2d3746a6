//! The expert GEMMs over the descriptor tables the routing writes on the device (see
//! [`crate::routing`]): live items first, their count in a header slot.

use cubecl::prelude::*;

use super::{GemmConfig, LUT_SLOTS, gemv, tiled};
use crate::device::bad;
use crate::pool::DESC_WORDS;
use crate::pool::token_bucket;
use crate::routing::check_route_chunk;
use crate::{Activation, DeviceArray, KernelError};

/// Work items of a routed launch over `experts`: the descriptor table's items (without its
/// header slot; `experts · chunks`, see [`crate::routing::RouteBuffers::chunks`]),
/// with the launch configuration, the chunk and the table's shape checked.
fn routed_items(
    cfg: GemmConfig,
    desc: &DeviceArray,
    chunk: usize,
    experts: usize,
) -> Result<usize, KernelError> {
    check_route_chunk(chunk)?;
    cfg.check()?;
    let items = (desc.len / DESC_WORDS).saturating_sub(1);
    if experts == 0 || items < experts || !items.is_multiple_of(experts) {
        return Err(bad(format!(
            "routed gemm descriptors: {} words for {experts} experts in items of {chunk} tokens",
            desc.len
        )));
    }
    Ok(items)
}

/// The grouped expert GEMM over a descriptor table built on the device by [`crate::routing::route::moe_route`]
/// into buffers of route chunk `chunk` ([`crate::routing::RouteBuffers::chunk`]; `experts ·
/// capacity / chunk` items, each at most `min(tokens, chunk)` tokens and `max_rows` rows of
/// `cols` columns).
#[allow(clippy::too_many_arguments)]
pub fn ap_gemm_routed<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: GemmConfig,
    planes: &DeviceArray,
    luts: &DeviceArray,
    desc: &DeviceArray,
    chunk: usize,
    experts: usize,
    max_rows: usize,
    cols: usize,
    tokens: usize,
    x: &DeviceArray,
    y: &DeviceArray,
    act: Activation,
) -> Result<(), KernelError> {
    let items = routed_items(cfg, desc, chunk, experts)?;
    if tokens == 0 {
        return Ok(());
    }
    // Bit-widths live in device descriptors: room for the widest LUT.
    let bufs = [planes, luts, desc, x, y];
    let item_tokens = tokens.min(chunk);
    if gemv::launch_gemv(client, cfg, bufs, items, true, cols, item_tokens, act, LUT_SLOTS, None) {
        return Ok(());
    }
    // SAFETY: descriptors are written by `moe_route` from slot words validated by
    // `expert_slot_words` against the layer's shapes; `x`/`y` hold `tokens · k` rows.
    unsafe {
        tiled::launch(client, cfg, bufs, items, max_rows, token_bucket(item_tokens), act, LUT_SLOTS, true)
    };
    Ok(())
}

/// Most tokens per routed item for which [`ap_gemm_routed_gated`] runs: at two tokens the
/// gated GEMV needs more registers per thread than the plain one, so fewer cubes fit per SM
/// and the step got slower; at one it saves the activation's launch.
pub const GATED_MAX_TOKENS: usize = 1;

/// The routed experts' gate_up GEMV with their activation in its epilogue: each warp unit holds
/// gate rows and the matching up rows, and stores `act(gate) · up` into the gate half of the
/// item's gate|up-shaped output rows (row stride `max_rows` = 2·inter, what
/// [`Activation::Applied`] reads), so no launch of its own applies it. `act` is
/// [`Activation::SiluMul`] or [`Activation::GeluTanhMul`]. Returns false, having
/// launched nothing, where the launch shape has no gated GEMV (more than [`GATED_MAX_TOKENS`]
/// tokens per item, shared memory, an odd `GemmConfig::gemv_rows`): then run
/// [`ap_gemm_routed`] and [`crate::activation::gated_act`].
///
/// # Shapes
/// - as [`ap_gemm_routed`]; the up half of `y`'s rows is left unwritten.
#[allow(clippy::too_many_arguments)]
pub fn ap_gemm_routed_gated<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: GemmConfig,
    planes: &DeviceArray,
    luts: &DeviceArray,
    desc: &DeviceArray,
    chunk: usize,
    experts: usize,
    max_rows: usize,
    cols: usize,
    tokens: usize,
    x: &DeviceArray,
    y: &DeviceArray,
    act: Activation,
) -> Result<bool, KernelError> {
    let items = routed_items(cfg, desc, chunk, experts)?;
    if !matches!(act, Activation::SiluMul | Activation::GeluTanhMul) {
        return Err(bad(format!("ap_gemm_routed_gated: {act:?} is not a gated activation")));
    }
    if !max_rows.is_multiple_of(2) {
        return Err(bad(format!("ap_gemm_routed_gated: {max_rows} gate|up rows")));
    }
    if tokens == 0 {
        return Ok(true);
    }
    let item_tokens = tokens.min(chunk);
    if item_tokens > GATED_MAX_TOKENS {
        return Ok(false);
    }
    let bufs = [planes, luts, desc, x, y];
    let none = Activation::None;
    Ok(gemv::launch_gemv(client, cfg, bufs, items, true, cols, item_tokens, none, LUT_SLOTS, Some(act)))
}
