//! The planner's tests: its core against exhaustive search, the routing statistics and the
//! memory target, the residual head, and the golden plans.
//!
//! One test binary for the crate: each binary links Burn anew.

mod golden;
mod head;
mod placement;
mod plan;
mod routing_memory;
