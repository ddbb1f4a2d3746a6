//! Running the grouped bit-plane + LUT kernel on Burn tensors.
//!
//! Burn's CubeCL backends (`CubeBackend<R, ..>`: wgpu, CUDA) keep a float tensor as a
//! [`CubeTensor<R>`]: a CubeCL buffer on the same compute client the page table's arenas live
//! on. When the backend's float primitive is that type and the tensor is on the table's device,
//! the raw handle goes straight to [`kernels_cubecl::ap_gemm`] (Burn's custom-kernel pattern,
//! `into_primitive` / `from_primitive`); the type check is a `TypeId` comparison, so layers stay
//! generic over any `Backend`. Every other case (ndarray, autodiff, fusion, another device) runs
//! the CPU reference of the format crate on the page's host parent at its committed bits.

use std::any::{Any, TypeId};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Int, Shape, Tensor, TensorData, TensorPrimitive};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::wgpu::WgpuRuntime;
use kernels_cubecl::{
    Activation, DeviceArray, GemmConfig, MAX_TOKENS, PoolSlot, WorkItem, ap_gemm, upload_items,
};
use pw_pages::{Mover, PageError, PageId, PagedWeights};

use crate::PagedLinearError;
use crate::table::{PageTable, Pages, with_pages};

/// The device arenas of a page table on runtime `R`.
struct Arenas<'a, R: Runtime> {
    client: &'a ComputeClient<R>,
    planes: &'a DeviceArray,
    luts: &'a DeviceArray,
}

/// Whether `B`'s float tensors are CubeCL tensors of runtime `R` and `device` is `dev`.
fn runs_on<B: Backend, R: CubeRuntime>(device: &B::Device, dev: &R::Device) -> bool
where
    R::Device: PartialEq,
{
    TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<CubeTensor<R>>()
        && (device as &dyn Any).downcast_ref::<R::Device>() == Some(dev)
}

/// `x` as a contiguous f32 CubeCL tensor. The caller checked [`runs_on`].
fn to_cube<B: Backend, R: CubeRuntime>(x: Tensor<B, 2>) -> CubeTensor<R> {
    let x = if x.dtype() == DType::F32 { x } else { x.cast(FloatDType::F32) };
    let prim: Box<dyn Any> = Box::new(x.into_primitive().tensor());
    into_contiguous(*prim.downcast::<CubeTensor<R>>().expect("the float primitive is a CubeTensor<R>"))
}

/// An f32 `[rows, cols]` result buffer as a Burn tensor of dtype `dtype`.
fn from_cube<B: Backend, R: CubeRuntime>(
    like: &CubeTensor<R>,
    y: DeviceArray,
    rows: usize,
    cols: usize,
    dtype: DType,
) -> Tensor<B, 2> {
    let t = CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::new([rows, cols]),
        y.handle,
        DType::F32,
    );
    let prim: Box<dyn Any> = Box::new(t);
    let prim = *prim.downcast::<B::FloatTensorPrimitive>().expect("the float primitive is a CubeTensor<R>");
    let out = Tensor::from_primitive(TensorPrimitive::Float(prim));
    if dtype == DType::F32 { out } else { out.cast(dtype) }
}

fn as_array<R: CubeRuntime>(t: &CubeTensor<R>) -> DeviceArray {
    DeviceArray { handle: t.handle.clone(), len: t.meta.shape().num_elements() }
}

fn kernel_err(e: kernels_cubecl::KernelError) -> PagedLinearError {
    PagedLinearError::Kernel(e.to_string())
}

/// The committed slot of `page`, or an error when it is not resident.
fn slot<M: Mover>(t: &PagedWeights<M>, page: PageId) -> Result<PoolSlot, PageError> {
    let s = t.table().get(page.0).copied().ok_or(PageError::BadPageId { id: page.0, pages: t.len() })?;
    if s.bits == 0 {
        return Err(PageError::NotResident { key: t.info(page)?.key });
    }
    Ok(s)
}

/// Work items over `slot` for `tokens` rows starting at row `row0` of `x` / `y`, at most
/// [`MAX_TOKENS`] per item.
fn items_for(slot: PoolSlot, row0: usize, tokens: usize, x_cols: usize, y_cols: usize) -> Vec<WorkItem> {
    (0..tokens)
        .step_by(MAX_TOKENS)
        .map(|s| {
            let (r, m) = (row0 + s, (tokens - s).min(MAX_TOKENS));
            slot.item((r * x_cols) as u32, (r * y_cols) as u32, m as u32)
        })
        .collect()
}

fn launch<R: Runtime>(
    a: &Arenas<'_, R>,
    items: &[WorkItem],
    x: &DeviceArray,
    y: &DeviceArray,
    act: Activation,
) -> Result<(), PagedLinearError> {
    let desc = upload_items(a.client, items);
    ap_gemm(a.client, GemmConfig::for_client(a.client), a.planes, a.luts, items, &desc, x, y, act)
        .map_err(kernel_err)
}

/// Whether layers over `table` run the CubeCL kernels for tensors of `B` on `device`.
pub(crate) fn runs_kernels<B: Backend>(table: &PageTable, device: &B::Device) -> bool {
    match &*table.lock() {
        Pages::Wgpu(_, dev) => runs_on::<B, WgpuRuntime>(device, dev),
        #[cfg(feature = "cuda")]
        Pages::Cuda(_, dev) => runs_on::<B, cubecl::cuda::CudaRuntime>(device, dev),
        Pages::Host(_) => false,
    }
}

/// `x · Wᵀ` for the weight of `page` at its committed bits.
///
/// # Shapes
/// - `x`: `[tokens, cols]`; returns `[tokens, rows]`
pub(crate) fn linear<B: Backend>(
    table: &PageTable,
    page: PageId,
    x: Tensor<B, 2>,
) -> Result<Tensor<B, 2>, PagedLinearError> {
    let guard = table.lock();
    let device = x.device();
    match &*guard {
        Pages::Wgpu(t, dev) if runs_on::<B, WgpuRuntime>(&device, dev) => {
            let p = t.mover();
            let a = Arenas { client: p.client(), planes: p.planes(), luts: p.luts() };
            return linear_cube::<B, WgpuRuntime>(&a, slot(t, page)?, x);
        }
        #[cfg(feature = "cuda")]
        Pages::Cuda(t, dev) if runs_on::<B, cubecl::cuda::CudaRuntime>(&device, dev) => {
            let p = t.mover().pool();
            let a = Arenas { client: p.client(), planes: p.planes(), luts: p.luts() };
            return linear_cube::<B, cubecl::cuda::CudaRuntime>(&a, slot(t, page)?, x);
        }
        _ => {}
    }
    with_pages!(&*guard, t => linear_reference(t, page, x))
}

fn linear_cube<B: Backend, R: CubeRuntime>(
    a: &Arenas<'_, R>,
    slot: PoolSlot,
    x: Tensor<B, 2>,
) -> Result<Tensor<B, 2>, PagedLinearError> {
    let [t, k] = x.dims();
    let (n, dtype) = (slot.rows as usize, x.dtype());
    let xc = to_cube::<B, R>(x);
    let y = DeviceArray::empty::<R, f32>(a.client, t * n);
    launch(a, &items_for(slot, 0, t, k, n), &as_array(&xc), &y, Activation::None)?;
    Ok(from_cube::<B, R>(&xc, y, t, n, dtype))
}

/// CPU reference of [`linear`]: the host parent dequantized at the committed bits.
fn linear_reference<B: Backend, M: Mover>(
    t: &PagedWeights<M>,
    page: PageId,
    x: Tensor<B, 2>,
) -> Result<Tensor<B, 2>, PagedLinearError> {
    let s = slot(t, page)?;
    let w = t.parent(page)?.dequantize_reference(s.bits as u8);
    Ok(x.clone().matmul(crate::dequantized::<B>(w, s.rows as usize, s.cols as usize, &x.device())))
}

/// One expert's share of a grouped launch: `tokens` consecutive rows from `row0`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ExpertGroup {
    pub expert: usize,
    pub row0: usize,
    pub tokens: usize,
}

/// The expert MLPs of one layer over rows grouped by expert: `down(act(gate) · up)` of each
/// group's rows through its expert's pages, two grouped launches on a CubeCL backend.
///
/// # Shapes
/// - `x`: `[rows, hidden]`; returns `[rows, hidden]`
pub(crate) fn experts<B: Backend>(
    table: &PageTable,
    pages: (&[PageId], &[PageId]),
    groups: &[ExpertGroup],
    x: Tensor<B, 2>,
    act: Activation,
) -> Result<Tensor<B, 2>, PagedLinearError> {
    let guard = table.lock();
    let device = x.device();
    match &*guard {
        Pages::Wgpu(t, dev) if runs_on::<B, WgpuRuntime>(&device, dev) => {
            let p = t.mover();
            let a = Arenas { client: p.client(), planes: p.planes(), luts: p.luts() };
            return experts_cube::<B, WgpuRuntime, _>(&a, t, pages, groups, x, act);
        }
        #[cfg(feature = "cuda")]
        Pages::Cuda(t, dev) if runs_on::<B, cubecl::cuda::CudaRuntime>(&device, dev) => {
            let p = t.mover().pool();
            let a = Arenas { client: p.client(), planes: p.planes(), luts: p.luts() };
            return experts_cube::<B, cubecl::cuda::CudaRuntime, _>(&a, t, pages, groups, x, act);
        }
        _ => {}
    }
    with_pages!(&*guard, t => experts_reference(t, pages, groups, x, act))
}

/// Gate_up and down slots of every group's expert.
fn group_slots<M: Mover>(
    t: &PagedWeights<M>,
    (gate_up, down): (&[PageId], &[PageId]),
    g: &ExpertGroup,
) -> Result<(PoolSlot, PoolSlot), PageError> {
    let id =
        |v: &[PageId]| v.get(g.expert).copied().ok_or(PageError::BadPageId { id: g.expert, pages: v.len() });
    Ok((slot(t, id(gate_up)?)?, slot(t, id(down)?)?))
}

fn experts_cube<B: Backend, R: CubeRuntime, M: Mover>(
    a: &Arenas<'_, R>,
    t: &PagedWeights<M>,
    pages: (&[PageId], &[PageId]),
    groups: &[ExpertGroup],
    x: Tensor<B, 2>,
    act: Activation,
) -> Result<Tensor<B, 2>, PagedLinearError> {
    let [rows, h] = x.dims();
    let dtype = x.dtype();
    let (mut gu, mut dn) = (Vec::new(), Vec::new());
    let mut inter2 = 0;
    for g in groups {
        let (sg, sd) = group_slots(t, pages, g)?;
        let i2 = sg.rows as usize;
        inter2 = i2;
        gu.extend(items_for(sg, g.row0, g.tokens, h, i2));
        dn.extend(items_for(sd, g.row0, g.tokens, i2, h));
    }
    let xc = to_cube::<B, R>(x);
    let hid = DeviceArray::empty::<R, f32>(a.client, rows * inter2);
    let y = DeviceArray::empty::<R, f32>(a.client, rows * h);
    launch(a, &gu, &as_array(&xc), &hid, Activation::None)?;
    launch(a, &dn, &hid, &y, act)?;
    Ok(from_cube::<B, R>(&xc, y, rows, h, dtype))
}

/// CPU reference of [`experts`] from the host parents at the committed bits.
fn experts_reference<B: Backend, M: Mover>(
    t: &PagedWeights<M>,
    pages: (&[PageId], &[PageId]),
    groups: &[ExpertGroup],
    x: Tensor<B, 2>,
    act: Activation,
) -> Result<Tensor<B, 2>, PagedLinearError> {
    let [rows, h] = x.dims();
    let device = x.device();
    let xv = x
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| PagedLinearError::Data(format!("{e:?}")))?;
    let mut y = vec![0f32; rows * h];
    for g in groups {
        let (sg, sd) = group_slots(t, pages, g)?;
        let (gp, dp) = (t.parent(pages.0[g.expert])?, t.parent(pages.1[g.expert])?);
        let xs = &xv[g.row0 * h..(g.row0 + g.tokens) * h];
        let hid = gp.matmul_reference(sg.bits as u8, xs, g.tokens);
        let i = sg.rows as usize / 2;
        let a: Vec<f32> = hid
            .chunks(2 * i)
            .flat_map(|r| {
                (0..i).map(move |c| {
                    let f = match act {
                        Activation::GeluTanhMul => kernels_cubecl::gelu_tanh(r[c]),
                        _ => kernels_cubecl::silu(r[c]),
                    };
                    f * r[i + c]
                })
            })
            .collect();
        let out = dp.matmul_reference(sd.bits as u8, &a, g.tokens);
        y[g.row0 * h..(g.row0 + g.tokens) * h].copy_from_slice(&out);
    }
    Ok(Tensor::from_data(TensorData::new(y, [rows, h]), &device))
}

/// Row indices as an Int tensor.
pub(crate) fn index_tensor<B: Backend>(idx: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
    let n = idx.len();
    Tensor::from_data(TensorData::new(idx, [n]), device)
}
