//! Calibration of MoE models on text, and the whole-model quantizer built on it.
//!
//! - [`fisher`]: the diagonal Fisher estimate of every expert weight — for each calibration
//!   window (one example), the gradient of its mean next-token loss with Burn's autodiff,
//!   squared and summed over windows.
//! - [`streamed`]: the importance a pass holding one decoder layer at a time can gather — each
//!   expert's input second moments — for models whose Fisher pass does not fit.
//! - [`quantize`]: a Hugging Face checkpoint → a PagedWeight checkpoint directory: every
//!   expert's gate+up and down projections become any-precision blocks quantized with either
//!   importance (their sensitivity tables come out of the same quantizer), every other tensor
//!   is copied unchanged.
//!
//! The loss convention (windows, positions) is [`pw_models::eval`]'s, shared with perplexity.

mod error;
pub mod fisher;
pub mod quantize;
pub mod streamed;

pub use error::CalibError;
pub use fisher::{BankImportance, ExpertGrad, FisherPass, expert_gradients};
pub use quantize::{
    ImportanceMethod, MemoryNeeds, Progress, QuantizeConfig, QuantizeReport, Stage, memory_needs,
    quantize_model,
};
pub use streamed::{StreamedBank, streamed_importance, streamed_importance_each};
