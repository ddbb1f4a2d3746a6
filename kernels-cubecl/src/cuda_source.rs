//! The CUDA C++ that CubeCL's CUDA compiler writes for the persistent expert GEMV, produced
//! from the kernel's IR on any runtime's client: the GEMV's registers, spills and instruction
//! mix on `sm_90a` can then be read off `nvcc -cubin -Xptxas -v` and `cuobjdump -sass` on a
//! machine without a GPU (`scripts/sass_gemv.sh`).
//!
//! The IR does not depend on the client's device here: the kernel reads no device property at
//! expansion, every launch-shape choice is a comptime argument ([`crate::gemv_plan`] for the
//! target's hardware), and CUDA's compiler options are the ones `cubecl-cuda` sets on sm_90
//! (fast math, grid constants, 32-lane warps).

use cubecl::ir::{ElemType, HardwareProperties, StorageType, UIntKind};
use cubecl::prelude::*;
use cubecl::{Compiler, ExecutionMode};

use crate::expert_gemm::{gemv, grouped};
use crate::{Activation, GemmConfig, GemvPlan, KernelError};

/// The H200's hardware properties as `cubecl-cuda` reads them (132 SMs, 232448 bytes of
/// opt-in shared memory per cube, 1024 units per cube, 32-lane warps), for [`crate::gemv_plan`]
/// without the device.
pub fn h200_hardware() -> HardwareProperties {
    HardwareProperties {
        load_width: 128,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: u32::MAX,
        max_shared_memory_size: 232_448,
        max_cube_count: (i32::MAX as u32, 65_535, 65_535),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(132),
        num_cpu_cores: None,
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: Some(8),
        max_vector_size: 16,
    }
}

/// The GEMM configuration the CUDA runtime picks on the H200 (what
/// [`GemmConfig::for_client`] returns there).
pub fn h200_gemm_config() -> GemmConfig {
    GemmConfig::for_hardware(&h200_hardware(), true)
}

/// CUDA C++ source of [`gemv::ap_gemv_kernel`] for `plan` (from [`crate::gemv_plan`] with
/// `cfg`), as the CUDA runtime would compile it; `client` only hosts the IR expansion.
#[allow(clippy::too_many_arguments)]
pub fn gemv_cuda_source<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: GemmConfig,
    plan: &GemvPlan,
    n_items: usize,
    counted: bool,
    act: Activation,
    lut_slots: usize,
) -> Result<String, KernelError> {
    let settings = KernelSettings::default()
        .cube_dim(CubeDim::new_1d((plan.warps * cfg.plane_size) as u32))
        .address_type(AddressType::U32);
    let arr = || ArrayCompilationArg { inplace: None };
    macro_rules! define {
        ($xf:ty) => {
            gemv::gemv_comptime_call!(
                gemv::ap_gemv_kernel::ApGemvKernel::<$xf, R>::new,
                (settings, client.clone(), arr(), arr(), arr(), arr(), arr(), ()),
                (cfg, plan, n_items, act, lut_slots, counted)
            )
            .define()
        };
    }
    let definition = if cfg.gemv_x_half { define!(half::f16) } else { define!(f32) };
    cuda_compile(definition, "the GEMV")
}

/// The CUDA C++ of `definition` with `cubecl-cuda`'s options on sm_90.
fn cuda_compile(definition: cubecl::prelude::KernelDefinition, what: &str) -> Result<String, KernelError> {
    let mut options = <cubecl::cuda::CudaCompiler as Compiler>::CompilationOptions::default();
    options.supports_features.fast_math = true;
    options.supports_features.grid_constants = true;
    let kernel = cubecl::cuda::CudaCompiler::default()
        .compile(
            definition,
            &options,
            ExecutionMode::Unchecked,
            StorageType::Scalar(ElemType::UInt(UIntKind::U32)),
        )
        .map_err(|e| KernelError::Config(format!("CUDA compilation of {what}: {e}")))?;
    Ok(kernel.to_string())
}

/// CUDA C++ source of the grouped GEMM's matrix-unit kernel `kernel` ([`crate::GroupedKernel::Mma`]:
/// [`grouped::grouped_mma_kernel`] with `groups` groups of 8 tokens per pass;
/// [`crate::GroupedKernel::Staged`]: [`grouped::grouped_staged_kernel`] with `groups` per warp)
/// for launch `g`, as the CUDA runtime would compile it.
pub fn grouped_cuda_source<R: Runtime>(
    client: &ComputeClient<R>,
    g: crate::GroupedGemm,
    kernel: crate::GroupedKernel,
    groups: usize,
) -> Result<String, KernelError> {
    let staged = match kernel {
        crate::GroupedKernel::Mma => false,
        crate::GroupedKernel::Staged => true,
        crate::GroupedKernel::Plain => {
            return Err(crate::device::bad("grouped CUDA source: the plain kernel has no MMA".into()));
        }
    };
    let warps = if staged { grouped::STAGED_WARPS } else { grouped::MMA_WARPS };
    let settings = KernelSettings::default()
        .cube_dim(CubeDim::new_1d((warps * 32) as u32))
        .address_type(AddressType::U32);
    let arr = || ArrayCompilationArg { inplace: None };
    let slot = if g.block == crate::ExpertBlock::GateUp { 0 } else { 3 };
    let (n, k, ys, gate) = (g.rows, g.cols, g.y_stride, g.epilogue.code());
    let definition = if staged {
        grouped::grouped_staged_kernel::GroupedStagedKernel::<R>::new(
            settings,
            client.clone(),
            arr(),
            arr(),
            arr(),
            arr(),
            arr(),
            arr(),
            n,
            k,
            ys,
            slot,
            gate,
            groups,
        )
        .define()
    } else {
        grouped::grouped_mma_kernel::GroupedMmaKernel::<R>::new(
            settings,
            client.clone(),
            arr(),
            arr(),
            arr(),
            arr(),
            arr(),
            arr(),
            n,
            k,
            ys,
            slot,
            gate,
            groups,
        )
        .define()
    };
    cuda_compile(definition, "the grouped GEMM")
}

/// CUDA C++ source of [`crate::attention::prefill_mma::paged_prefill_mma_kernel`] for `shape`
/// (one that [`crate::prefill_mma_run_tokens`] serves) with query rows of `q_stride` elements,
/// as the CUDA runtime would compile it.
pub fn prefill_mma_cuda_source<R: Runtime>(
    client: &ComputeClient<R>,
    shape: crate::PagedAttnShape,
    q_stride: usize,
) -> Result<String, KernelError> {
    use crate::attention::prefill_mma::{head_plan, paged_prefill_mma_kernel};
    let plan = head_plan(shape.head_dim)
        .filter(|_| crate::prefill_mma_run_tokens(&shape, true).is_some())
        .ok_or_else(|| {
            crate::device::bad(format!("the matrix-unit prefill attention does not serve {shape:?}"))
        })?;
    let settings = KernelSettings::default().cube_dim(plan.cube_dim()).address_type(AddressType::U32);
    let arr = || ArrayCompilationArg { inplace: None };
    let definition = paged_prefill_mma_kernel::PagedPrefillMmaKernel::<R>::new(
        settings,
        client.clone(),
        arr(),
        arr(),
        arr(),
        arr(),
        arr(),
        arr(),
        arr(),
        arr(),
        shape.head_dim,
        shape.n_heads,
        shape.n_kv_heads,
        shape.block_size,
        shape.max_blocks,
        shape.window,
        q_stride,
        plan.split,
        plan.keys,
        plan.split_scores,
    )
    .define();
    cuda_compile(definition, "the matrix-unit prefill attention")
}
