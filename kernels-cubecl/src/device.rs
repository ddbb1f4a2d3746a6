//! Device buffers, the crate's error type, and the argument checks and launch shapes every
//! host launcher shares.

use cubecl::prelude::*;
use cubecl::server::Handle;

/// Kernel launch or argument errors.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A work item or buffer is inconsistent.
    #[error("work item {item}: {reason}")]
    BadItem {
        /// Index of the work item.
        item: usize,
        /// What is wrong.
        reason: String,
    },
    /// The runtime reported an error (deferred launch errors surface at sync).
    #[error("runtime error: {0}")]
    Runtime(String),
    /// A [`GemmConfig`] the kernels cannot run.
    #[error("GEMM configuration: {0}")]
    Config(String),
}

/// A device buffer and its length in elements.
#[derive(Debug, Clone)]
pub struct DeviceArray {
    /// The CubeCL handle.
    pub handle: Handle,
    /// Length in elements of the kernel-side type.
    pub len: usize,
}

impl DeviceArray {
    /// Uploads a slice.
    pub fn from_slice<R: Runtime, T: CubeElement>(client: &ComputeClient<R>, data: &[T]) -> Self {
        Self { handle: client.create_from_slice(T::as_bytes(data)), len: data.len() }
    }

    /// An uninitialised buffer of `len` elements of `T`.
    pub fn empty<R: Runtime, T: CubeElement>(client: &ComputeClient<R>, len: usize) -> Self {
        Self { handle: client.empty(len.max(1) * size_of::<T>()), len }
    }

    /// Uploads `parts` as one buffer (one upload instead of one per part) and returns a view
    /// of each. Every view starts and ends at a multiple of [`VIEW_ALIGN`] bytes (or of the
    /// device's memory alignment if larger), as storage bindings with an offset may require.
    pub fn from_slices<R: Runtime, T: CubeElement>(client: &ComputeClient<R>, parts: &[&[T]]) -> Vec<Self> {
        let align = VIEW_ALIGN.max(client.properties().memory.alignment as usize);
        // (byte offset, padded bytes) of each part; an empty part still spans one alignment.
        let mut spans = Vec::with_capacity(parts.len());
        let mut total = 0usize;
        for part in parts {
            let padded = size_of_val(*part).max(1).next_multiple_of(align);
            spans.push((total, padded));
            total += padded;
        }
        let mut data = vec![0u8; total.max(align)];
        for (part, &(off, _)) in parts.iter().zip(&spans) {
            let bytes = T::as_bytes(part);
            data[off..off + bytes.len()].copy_from_slice(bytes);
        }
        let handle = client.create_from_slice(&data);
        parts
            .iter()
            .zip(spans)
            .map(|(part, (off, padded))| Self {
                handle: handle
                    .clone()
                    .offset_start(off as u64)
                    .offset_end((data.len() - off - padded) as u64),
                len: part.len(),
            })
            .collect()
    }

    pub(crate) fn arg<R: Runtime>(&self) -> ArrayArg<R> {
        // SAFETY: `len` is the element count the buffer was created with.
        unsafe { ArrayArg::from_raw_parts(self.handle.clone(), self.len.max(1)) }
    }
}

/// Least byte alignment of the views [`DeviceArray::from_slices`] returns (WebGPU's largest
/// allowed `min_storage_buffer_offset_alignment`).
pub const VIEW_ALIGN: usize = 256;

/// Waits for the queue and turns deferred launch errors into an error.
pub fn sync<R: Runtime>(client: &ComputeClient<R>) -> Result<(), KernelError> {
    cubecl::future::block_on(client.sync()).map_err(|e| KernelError::Runtime(format!("{e:?}")))
}

/// Reads back an f32 buffer (synchronising first, so launch errors surface).
pub fn read_f32<R: Runtime>(client: &ComputeClient<R>, a: &DeviceArray) -> Result<Vec<f32>, KernelError> {
    sync(client)?;
    let bytes = client.read_one(a.handle.clone()).map_err(|e| KernelError::Runtime(format!("{e:?}")))?;
    Ok(f32::from_bytes(&bytes)[..a.len].to_vec())
}

/// Reads back the first `n` elements of an f32 buffer (synchronising first): a step's logits
/// rows without the rest of a buffer sized for the largest step.
pub fn read_f32_prefix<R: Runtime>(
    client: &ComputeClient<R>,
    a: &DeviceArray,
    n: usize,
) -> Result<Vec<f32>, KernelError> {
    need("read_f32_prefix", a, n)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    sync(client)?;
    let used = a.handle.size_in_used();
    let handle = a.handle.clone().offset_end(used - (n * size_of::<f32>()) as u64);
    let bytes = client.read_one(handle).map_err(|e| KernelError::Runtime(format!("{e:?}")))?;
    Ok(f32::from_bytes(&bytes)[..n].to_vec())
}

/// Reads back a u32 buffer (synchronising first).
pub fn read_u32<R: Runtime>(client: &ComputeClient<R>, a: &DeviceArray) -> Result<Vec<u32>, KernelError> {
    sync(client)?;
    let bytes = client.read_one(a.handle.clone()).map_err(|e| KernelError::Runtime(format!("{e:?}")))?;
    Ok(u32::from_bytes(&bytes)[..a.len].to_vec())
}

/// Reads back a u32 and an f32 buffer in one round trip (synchronising first).
pub fn read_u32_f32<R: Runtime>(
    client: &ComputeClient<R>,
    a: &DeviceArray,
    b: &DeviceArray,
) -> Result<(Vec<u32>, Vec<f32>), KernelError> {
    sync(client)?;
    let read = client.read_async(vec![a.handle.clone(), b.handle.clone()]);
    let bytes = cubecl::future::block_on(read).map_err(|e| KernelError::Runtime(format!("{e:?}")))?;
    let [x, y] = bytes.as_slice() else {
        return Err(KernelError::Runtime(format!("read of two buffers returned {}", bytes.len())));
    };
    Ok((u32::from_bytes(x)[..a.len].to_vec(), f32::from_bytes(y)[..b.len].to_vec()))
}

pub(crate) fn bad(reason: String) -> KernelError {
    KernelError::BadItem { item: 0, reason }
}

pub(crate) fn need(what: &str, a: &DeviceArray, n: usize) -> Result<(), KernelError> {
    if a.len < n { Err(bad(format!("{what}: {} elements, needs {n}", a.len))) } else { Ok(()) }
}

pub(crate) fn cube_1d(width: usize) -> CubeDim {
    CubeDim::new_1d(width.clamp(1, 256) as u32)
}

/// Units of a cube that reduces rows of `width` with up to `per_unit` values per unit: a
/// multiple of the plane size, at least one plane, at most the device's cube size and 1024.
pub(crate) fn row_units<R: Runtime>(
    client: &ComputeClient<R>,
    width: usize,
    per_unit: usize,
) -> (usize, usize) {
    let hw = &client.properties().hardware;
    let plane = hw.plane_size_max as usize;
    let cap = (hw.max_units_per_cube as usize).clamp(plane, 1024) / plane * plane;
    (width.div_ceil(per_unit).next_multiple_of(plane).clamp(plane, cap), plane)
}

/// Grid and cube of the per-row column kernels (a unit per column of `width`, a row of cubes
/// per token): [`crate::routing::combine::moe_combine`], [`crate::activation::gated_act`].
pub(crate) fn column_grid(tokens: usize, width: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(tokens as u32, width.div_ceil(COLUMN_UNITS) as u32, 1),
        CubeDim::new_1d(COLUMN_UNITS as u32),
    )
}

/// Units per cube of [`column_grid`].
const COLUMN_UNITS: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_read_is_the_head_of_the_whole_read() {
        let client = crate::testing::client();
        let x: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let a = DeviceArray::from_slice(&client, &x);
        assert_eq!(read_f32(&client, &a).unwrap(), x);
        for n in [1, 37, 999, 1000] {
            assert_eq!(read_f32_prefix(&client, &a, n).unwrap(), x[..n], "{n}");
        }
        assert!(read_f32_prefix(&client, &a, 0).unwrap().is_empty());
        assert!(read_f32_prefix(&client, &a, 1001).is_err());
    }

    /// Views of one upload read back as their parts, and a kernel writing one view leaves its
    /// neighbours alone (the binding offsets are honoured).
    #[test]
    fn views_of_one_upload_are_their_parts() {
        let client = crate::testing::client();
        let parts: Vec<Vec<u32>> = [5usize, 300, 0, 64, 17]
            .iter()
            .enumerate()
            .map(|(p, &n)| (0..n as u32).map(|i| i * 7 + p as u32).collect())
            .collect();
        let slices: Vec<&[u32]> = parts.iter().map(Vec::as_slice).collect();
        let views = DeviceArray::from_slices(&client, &slices);
        assert_eq!(views.len(), parts.len());
        for (v, p) in views.iter().zip(&parts) {
            assert_eq!(v.len, p.len());
            assert_eq!(read_u32(&client, v).unwrap(), *p);
        }
        crate::fill_hash(&client, &views[1], 9);
        assert_eq!(read_u32(&client, &views[1]).unwrap(), crate::fill_hash_reference(300, 9));
        for i in [0, 3, 4] {
            assert_eq!(read_u32(&client, &views[i]).unwrap(), parts[i], "view {i} changed");
        }
        let f = DeviceArray::from_slice(&client, &[1.5f32, -2.0, 0.25]);
        let (u, x) = read_u32_f32(&client, &views[4], &f).unwrap();
        assert_eq!((u, x), (parts[4].clone(), vec![1.5, -2.0, 0.25]));
    }
}
