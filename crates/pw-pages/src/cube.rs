//! The device pool on a CubeCL runtime: the plane and LUT arenas are two
//! CubeCL buffers; writes are a staging upload plus a copy kernel into the
//! arena, both on the client's queue, so they are ordered with the grouped
//! kernel's launches and finish (from the kernels' view) at once.
//!
//! CubeCL 0.10 has no public write into part of an existing buffer, hence the
//! copy kernel. On CUDA the staging upload runs at pageable speed (0.4–0.6
//! GB/s, see `shared/notes/cubecl-0.10-on-h200.md`) and stalls the kernels'
//! queue meanwhile, so [`device_mover`] picks the asynchronous `CudaMover`
//! there (feature `cuda`).

use crate::mover::{MoveError, Mover, Ticket, Write};
use cubecl::prelude::*;
use half::f16;
use kernels_cubecl::{DeviceArray, PoolSlot};
use std::sync::OnceLock;

/// Units per cube of the copy kernel.
const COPY_UNITS: u32 = 256;
/// Most cubes of one copy launch (the kernel strides over the rest).
const COPY_CUBES: usize = 1024;

/// `dst[dst_off + i] = src[i]` for `i < len`, grid-strided.
#[cube(launch_unchecked)]
fn copy_into<E: CubePrimitive>(src: &Array<E>, dst: &mut Array<E>, dst_off: u32, len: u32) {
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    for i in range_stepped(ABSOLUTE_POS, len as usize, stride) {
        dst[dst_off as usize + i] = src[i];
    }
}

/// A [`Mover`] whose arenas are CubeCL buffers the kernels read: what a page table over a
/// device needs, whichever way its copies travel.
pub trait DeviceMover<R: Runtime>: Mover + Send {
    /// The arenas and the committed descriptor table.
    fn pool(&self) -> &CubePool<R>;
}

impl<R: Runtime> DeviceMover<R> for CubePool<R> {
    fn pool(&self) -> &CubePool<R> {
        self
    }
}

/// The fastest mover for `client`'s runtime, with arenas of `plane_words` u32 words and
/// `lut_entries` f16 entries: on CUDA (feature `cuda`) the `CudaMover` (asynchronous pinned
/// copies on a stream of their own, ~55 GB/s on the H200, the kernels never wait for them),
/// elsewhere a [`CubePool`] (copies ordered on the client's queue).
pub fn device_mover<R: Runtime>(
    client: &ComputeClient<R>,
    plane_words: usize,
    lut_entries: usize,
) -> Result<Box<dyn DeviceMover<R>>, MoveError> {
    #[cfg(feature = "cuda")]
    if let Some(m) = crate::cuda::on_cuda(client, plane_words, lut_entries)? {
        return Ok(m);
    }
    Ok(Box::new(CubePool::new(client.clone(), plane_words, lut_entries)))
}

/// Plane + LUT arenas on a CubeCL device, and the committed descriptor table.
pub struct CubePool<R: Runtime> {
    client: ComputeClient<R>,
    planes: DeviceArray,
    luts: DeviceArray,
    /// The committed descriptor words (5 per page).
    table: Vec<u32>,
    /// Their device copy, uploaded when first asked for after a commit: the fast decode path
    /// reads its own slot tables, so a commit need not pay an upload nobody reads.
    desc: OnceLock<DeviceArray>,
    next: u64,
}

impl<R: Runtime> CubePool<R> {
    /// Allocates arenas of `plane_words` u32 words and `lut_entries` f16 entries.
    pub fn new(client: ComputeClient<R>, plane_words: usize, lut_entries: usize) -> Self {
        let planes = DeviceArray::empty::<R, u32>(&client, plane_words);
        let luts = DeviceArray::empty::<R, f16>(&client, lut_entries);
        Self { client, planes, luts, table: Vec::new(), desc: OnceLock::new(), next: 0 }
    }

    /// The client.
    pub fn client(&self) -> &ComputeClient<R> {
        &self.client
    }

    /// The plane arena (u32 words), for [`kernels_cubecl::ap_gemm`].
    pub fn planes(&self) -> &DeviceArray {
        &self.planes
    }

    /// The LUT arena (f16 entries), for [`kernels_cubecl::ap_gemm`].
    pub fn luts(&self) -> &DeviceArray {
        &self.luts
    }

    /// The committed descriptor table on the device: 5 words per page
    /// (plane_off, lut_off, rows, cols, bits), uploaded into a fresh buffer at the first call
    /// after each commit (kernels queued before keep reading the old one).
    pub fn descriptors(&self) -> &DeviceArray {
        self.desc.get_or_init(|| match self.table.is_empty() {
            true => DeviceArray { len: 0, ..DeviceArray::from_slice(&self.client, &[0u32]) },
            false => DeviceArray::from_slice(&self.client, &self.table),
        })
    }

    fn copy<E: CubePrimitive + CubeElement>(
        &self,
        dst: &DeviceArray,
        off: usize,
        data: &[E],
        what: &str,
    ) -> Result<(), MoveError> {
        if data.is_empty() {
            return Ok(());
        }
        if off + data.len() > dst.len {
            return Err(MoveError(format!(
                "{what} write [{off}, {}) past the arena of {}",
                off + data.len(),
                dst.len
            )));
        }
        let len = u32::try_from(data.len())
            .map_err(|_| MoveError(format!("{what} write of {} elements", data.len())))?;
        let staging = self.client.create_from_slice(E::as_bytes(data));
        let cubes = data.len().div_ceil(COPY_UNITS as usize).min(COPY_CUBES) as u32;
        // SAFETY: the kernel reads `len` elements of `staging` (exactly its size)
        // and writes `dst[off..off + len]`, checked against `dst.len` above.
        unsafe {
            copy_into::launch_unchecked::<E, R>(
                &self.client,
                CubeCount::Static(cubes, 1, 1),
                CubeDim::new_1d(COPY_UNITS),
                ArrayArg::from_raw_parts(staging, data.len()),
                ArrayArg::from_raw_parts(dst.handle.clone(), dst.len.max(1)),
                off as u32,
                len,
            )
        };
        Ok(())
    }
}

impl<R: Runtime> Mover for CubePool<R> {
    fn capacity(&self) -> (usize, usize) {
        (self.planes.len, self.luts.len)
    }

    fn write_ordered(&mut self, writes: &[Write<'_>]) -> Result<(), MoveError> {
        for w in writes {
            match *w {
                Write::Planes { off, data } => self.copy(&self.planes, off, data, "plane")?,
                Write::Lut { off, data } => self.copy(&self.luts, off, data, "LUT")?,
            }
        }
        Ok(())
    }

    fn start(&mut self, writes: &[Write<'_>]) -> Result<Ticket, MoveError> {
        self.write_ordered(writes)?;
        self.next += 1;
        Ok(Ticket(self.next))
    }

    fn finished(&mut self, _ticket: Ticket) -> Result<bool, MoveError> {
        // Copies are queued ahead of any later launch on the same client.
        Ok(true)
    }

    fn publish(&mut self, table: &[PoolSlot]) -> Result<(), MoveError> {
        self.table = table.iter().flat_map(|s| [s.plane_off, s.lut_off, s.rows, s.cols, s.bits]).collect();
        self.desc = OnceLock::new();
        Ok(())
    }
}
