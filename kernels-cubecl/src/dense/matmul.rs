//! The dense GEMM of a step of many tokens (prompt chunks, large decode batches) as a real
//! matrix-matrix product: `x` rounded to f16 (through its RMSNorm, when one is folded in) by a
//! launch of its own, CubeK's matmul of `x16 · Wᵀ` (f16 inputs, f32 accumulation and output),
//! then the bias and residual add.
//!
//! Why: [`super::mma::dense_mma_kernel`] is built for a few tokens: TF32 tiles of 16 tokens that
//! re-read the weights per token tile and leave `x` unshared between warps. With hundreds of
//! tokens per step the weights are read once per step either way, and what counts is the
//! matrix rate, which a tiled, double-buffered f16 GEMM reaches and a skinny kernel does not.
//!
//! f16 rather than TF32: the norm is applied before rounding (the skinny kernel applies it
//! after the reduction, so it must keep the raw residual's range), and the inputs that go
//! without a norm (the attention output, `act(gate) · up`) stay far inside f16's range.

use cubecl::prelude::*;
use cubecl::zspace::{Shape, Strides};
use cubek::matmul::components::tile::TileMatmulKind;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::{Strategy, launch_ref};
use cubek::matmul::routines::BlueprintStrategy;
use cubek::matmul::routines::TileSizeSelection;
use cubek::matmul::routines::double_buffering::DoubleBufferingArgs;
use cubek::matmul::routines::ordered_double_buffering::OrderedSelectionArgs;
use cubek::matmul::routines::simple::SimpleArgs;
use cubek::matmul::routines::simple_unit::SimpleUnitSelectionArgs;
use cubek::std::InputBinding;
use half::f16;
use std::marker::PhantomData;

use super::DenseGemm;
use crate::device::{column_grid, row_units};
use crate::norms::{RowNorm, norm_args};
use crate::plane::cube_sum;
use crate::{DeviceArray, KernelError};

/// Fewest tokens of a step for which [`super::mma::MmaMode::Auto`] takes the matmul (with
/// [`super::mma::MmaTuning::matmul`] set and f16 matrix units on the device): at 2048 tokens it
/// takes half the skinny kernel's time, at 64 to 256 it is as slow or slower
/// (`benches/results/h200-dense-matmul.md`).
pub const MATMUL_MIN_TOKENS: usize = 512;

/// Fewest output rows for which the matmul runs: narrower GEMMs (routers, gates) are a
/// fraction of a step and stay on the skinny kernels.
pub const MATMUL_MIN_ROWS: usize = 256;

/// Which of CubeK's matmul routines runs a large dense GEMM (the matrix-unit routines use
/// `mma.sync` fragments; [`Self::Unit`] runs anywhere, on the ALUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatmulKernel {
    /// One stage per step, cyclic loads, several rows per plane.
    Simple,
    /// Two stages (the next tile's loads overlap this tile's MMAs), cyclic loads.
    Double,
    /// [`Self::Double`] with producer and consumer planes.
    DoubleSpecialized,
    /// Double buffering with an ordered stage and a split reduction.
    Ordered,
    /// Warp-specialised stages.
    Specialized,
    /// Per-unit register tiles, no matrix units (any device).
    Unit,
}

impl MatmulKernel {
    /// The default: [`Self::Double`].
    pub const DEFAULT: MatmulKernel = MatmulKernel::Double;

    /// Every kernel, for benchmarks.
    pub const ALL: [MatmulKernel; 6] =
        [Self::Simple, Self::Double, Self::DoubleSpecialized, Self::Ordered, Self::Specialized, Self::Unit];

    /// A short name (benchmark records and options).
    pub fn name(self) -> &'static str {
        match self {
            Self::Simple => "simple",
            Self::Double => "double",
            Self::DoubleSpecialized => "double-spec",
            Self::Ordered => "ordered",
            Self::Specialized => "specialized",
            Self::Unit => "unit",
        }
    }

    /// The kernel called `name` ([`Self::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    fn strategy(self) -> Strategy {
        let mma = TileMatmulKind::Mma;
        match self {
            Self::Simple => Strategy::SimpleCyclicMma(BlueprintStrategy::Inferred(SimpleArgs {
                multi_rows: true,
                tile_matmul: mma,
            })),
            Self::Double | Self::DoubleSpecialized => {
                Strategy::DoubleCyclicMma(BlueprintStrategy::Inferred(DoubleBufferingArgs {
                    specialized: self == Self::DoubleSpecialized,
                    tile_matmul: mma,
                }))
            }
            Self::Ordered => Strategy::OrderedDoubleMma(BlueprintStrategy::Inferred(OrderedSelectionArgs {
                partition_k: Some(2),
                row_count: Some(8),
                rows_per_plane: Some(2),
                tile_matmul: mma,
            })),
            Self::Specialized => Strategy::SpecializedCyclicMma(BlueprintStrategy::Inferred(().into())),
            Self::Unit => Strategy::SimpleUnit(BlueprintStrategy::Inferred(SimpleUnitSelectionArgs {
                tile_size: TileSizeSelection::MaxTileSize,
            })),
        }
    }
}

/// `y (+)= [norm](x) · Wᵀ (+ bias)` through [`dense_x_f16_kernel`], CubeK's matmul of `kernel`
/// and [`dense_epilogue_kernel`] (arguments checked by the caller).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    g: DenseGemm,
    kernel: MatmulKernel,
    tokens: usize,
    meta: &DeviceArray,
    x: &DeviceArray,
    norm: Option<RowNorm<'_>>,
    w: &DeviceArray,
    bias: &DeviceArray,
    y: &DeviceArray,
) -> Result<(), KernelError> {
    let (n, k) = (g.n, g.k);
    let x16 = DeviceArray::empty::<R, f16>(client, tokens * k);
    let (units, plane) = row_units(client, k, 8);
    let (nw, np) = norm_args(norm, x, meta);
    // SAFETY: the caller checked `x` ≥ tokens · k and the norm buffers; `x16` holds tokens · k.
    unsafe {
        dense_x_f16_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, 1, 1),
            CubeDim::new_1d(units as u32),
            x.arg(),
            nw.arg(),
            np.arg(),
            x16.arg(),
            k,
            units,
            plane,
            norm.is_some(),
        )
    };
    // Without bias or residual add the matmul writes `y` itself.
    let direct = !g.bias && !g.accumulate;
    let acc = if direct { y.clone() } else { DeviceArray::empty::<R, f32>(client, tokens * n) };
    let binding = |a: &DeviceArray, shape: [usize; 2], strides: [usize; 2]| TensorBinding::<R> {
        handle: a.handle.clone().binding(),
        strides: Strides::new(&strides),
        shape: Shape::new(shape),
        runtime: PhantomData,
    };
    let half = f16::as_type_native_unchecked().storage_type();
    let lhs = InputBinding::new(binding(&x16, [tokens, k], [k, 1]), half);
    // `W` is `[n, k]` row-major: `Wᵀ` is the `[k, n]` matrix of strides `[1, k]`.
    let rhs = InputBinding::new(binding(w, [k, n], [1, k]), half);
    let out = binding(&acc, [tokens, n], [n, 1]);
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: half,
        rhs: half,
        out: f32::as_type_native_unchecked().storage_type(),
    });
    launch_ref(&kernel.strategy(), client, lhs, rhs, out, &mut dtypes).map_err(|e| {
        KernelError::Runtime(format!("dense matmul {n}x{k}, {tokens} tokens, {}: {e:?}", kernel.name()))
    })?;
    if direct {
        return Ok(());
    }
    let (count, dim) = column_grid(tokens, n);
    // SAFETY: `acc` and `y` hold tokens · n, `bias` n where read (checked by the caller).
    unsafe {
        dense_epilogue_kernel::launch_unchecked::<R>(
            client,
            count,
            dim,
            acc.arg(),
            bias.arg(),
            y.arg(),
            n,
            g.bias,
            g.accumulate,
        )
    };
    Ok(())
}

/// `x16[t] = f16(x[t] / rms(x[t]) · (norm_w + norm_p[1]))` with `norm`, else `f16(x[t])`; one
/// cube per token `t` of `k` columns, the units striding over them (`rms` with `norm_p[0]` as
/// eps, as [`crate::rms_norm_reference`]).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn dense_x_f16_kernel(
    x: &Array<f32>,
    norm_w: &Array<f32>,
    norm_p: &Array<f32>,
    x16: &mut Array<f16>,
    #[comptime] k: usize,
    #[comptime] units: usize,
    #[comptime] plane_size: usize,
    #[comptime] norm: bool,
) {
    let base = CUBE_POS_X as usize * k;
    let u = UNIT_POS as usize;
    let mut scale = 1.0f32;
    let mut off = 0.0f32;
    if comptime![norm] {
        let mut ss = 0.0f32;
        for c in range_stepped(u, k, units) {
            let v = x[base + c];
            ss += v * v;
        }
        let ms = cube_sum(ss, units, plane_size) / f32::cast_from(k);
        scale = 1.0f32 / (ms + norm_p[0]).sqrt();
        off = norm_p[1];
    }
    for c in range_stepped(u, k, units) {
        let mut v = x[base + c] * scale;
        if comptime![norm] {
            v *= norm_w[c] + off;
        }
        x16[base + c] = f16::cast_from(v);
    }
}

/// `y[t, c] = acc[t, c] (+ bias[c]) (+ y[t, c])`: grid `(tokens, ⌈n / units⌉)`, a unit per
/// column ([`column_grid`]).
#[cube(launch_unchecked)]
pub fn dense_epilogue_kernel(
    acc: &Array<f32>,
    bias: &Array<f32>,
    y: &mut Array<f32>,
    #[comptime] n: usize,
    #[comptime] has_bias: bool,
    #[comptime] accumulate: bool,
) {
    let c = CUBE_POS_Y as usize * CUBE_DIM as usize + UNIT_POS as usize;
    if c >= n {
        terminate!();
    }
    let i = CUBE_POS_X as usize * n + c;
    let mut v = acc[i];
    if comptime![has_bias] {
        v += bias[c];
    }
    if comptime![accumulate] {
        v += y[i];
    }
    y[i] = v;
}
