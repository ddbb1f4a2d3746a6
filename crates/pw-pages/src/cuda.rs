//! The asynchronous mover on CUDA: raising transfers are cudarc copies from
//! the host parents (page-locked in place when large, see [`Mover::pin_host`])
//! or else from reused pinned staging buffers, into the raw device pointers of
//! the CubeCL arenas, on a stream of their own, each closed by an event that
//! [`Mover::finished`] polls. Measured on the H200 (`shared/notes/
//! cubecl-0.10-on-h200.md`): 55 GB/s this way against 0.4–0.6 GB/s through
//! CubeCL's `create`, without slowing the kernel stream.
//!
//! Ordering: CubeCL's stream is private, so no event can be recorded on it.
//! A transfer's destinations may have been read by kernels launched before
//! the boundary that freed them, so [`CudaMover::start`] first waits for the
//! CubeCL queue (`client.sync()`). At a boundary between decode steps the
//! host has normally just read the step's logits, so the queue is already
//! drained and the wait costs a round trip, not a step. Ordered writes
//! (lowering LUT swaps, descriptor tables) go through CubeCL as in
//! [`CubePool`].

use crate::cube::{CubePool, DeviceMover};
use crate::mover::{MoveError, Mover, Ticket, Write};
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cudarc::driver::result as cu;
use cudarc::driver::sys;
use kernels_cubecl::PoolSlot;
use std::any::Any;
use std::collections::BTreeMap;

/// Free and total bytes of CUDA device `device` (`cuMemGetInfo` in its primary context, the one
/// CubeCL uses): what a server sizes its default memory budget from.
pub fn device_memory(device: usize) -> Result<(u64, u64), MoveError> {
    cu::init().map_err(|e| err("init", e))?;
    let ordinal =
        i32::try_from(device).map_err(|_| MoveError(format!("CUDA device {device}: no such ordinal")))?;
    let dev = cu::device::get(ordinal).map_err(|e| err("device", e))?;
    // SAFETY: `dev` is a valid device; the retain is released below.
    let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| err("primary context", e))?;
    // SAFETY: `ctx` was just retained.
    let info = unsafe { cu::ctx::set_current(ctx) }
        .and_then(|()| cu::mem_get_info())
        .map_err(|e| err("memory info", e));
    // SAFETY: releases the retain above; CubeCL holds its own.
    unsafe { cu::primary_ctx::release(dev) }.map_err(|e| err("release context", e))?;
    let (free, total) = info?;
    Ok((free as u64, total as u64))
}

fn err(what: &str, e: cu::DriverError) -> MoveError {
    MoveError(format!("CUDA {what}: {e:?}"))
}

/// A pinned host buffer, reused across transfers.
struct Pinned {
    ptr: *mut u8,
    cap: usize,
    busy: bool,
}

/// [`Mover`] over CubeCL arenas on CUDA with asynchronous pinned copies.
pub struct CudaMover {
    pool: CubePool<CudaRuntime>,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    /// Raw pointers of the plane and LUT arenas.
    ptrs: (u64, u64),
    /// The arenas' managed resources, kept alive with their handles so that
    /// CubeCL never reuses the memory behind the raw pointers.
    _resources: Vec<Box<dyn Any>>,
    pinned: Vec<Pinned>,
    /// Host ranges page-locked in place by [`Mover::pin_host`]: (start, len).
    registered: Vec<(usize, usize)>,
    in_flight: BTreeMap<Ticket, (sys::CUevent, Vec<usize>)>,
    next: u64,
}

// SAFETY: the raw handles (context, stream, events) are CUDA driver objects that any host
// thread may use once the mover's context is current there, which every method that calls the
// driver makes it first; the pinned buffers are host memory owned by the mover alone; the
// CubeCL resources are only held to keep the arenas alive. The mover is used by one thread at
// a time (`&mut self`, or behind the caller's lock), so `Send` is all it needs.
unsafe impl Send for CudaMover {}

impl CudaMover {
    /// Arenas of `plane_words` words and `lut_entries` entries on `client`'s
    /// device (ordinal `device`), and a copy stream in CubeCL's (primary) context.
    pub fn new(
        client: ComputeClient<CudaRuntime>,
        device: usize,
        plane_words: usize,
        lut_entries: usize,
    ) -> Result<Self, MoveError> {
        Self::with_pool(CubePool::new(client, plane_words, lut_entries), Some(device))
    }

    /// [`Self::new`] on whichever device `client` drives (read from the arena's pointer).
    pub fn for_client(
        client: ComputeClient<CudaRuntime>,
        plane_words: usize,
        lut_entries: usize,
    ) -> Result<Self, MoveError> {
        Self::with_pool(CubePool::new(client, plane_words, lut_entries), None)
    }

    fn with_pool(pool: CubePool<CudaRuntime>, device: Option<usize>) -> Result<Self, MoveError> {
        cu::init().map_err(|e| err("init", e))?;
        let client = pool.client();
        // The arenas must exist on the device before their pointers are used.
        cubecl::future::block_on(client.sync()).map_err(|e| MoveError(format!("{e:?}")))?;
        let mut resources: Vec<Box<dyn Any>> = Vec::new();
        let mut ptrs = [0u64; 2];
        for (i, arr) in [pool.planes(), pool.luts()].into_iter().enumerate() {
            let res = client.get_resource(arr.handle.clone()).map_err(|e| MoveError(format!("{e:?}")))?;
            ptrs[i] = res.resource().ptr;
            resources.push(Box::new(res));
        }
        let device = match device {
            Some(d) => d as i32,
            None => {
                let mut ordinal = 0i32;
                // SAFETY: `ptrs[0]` is a live device allocation of CubeCL's context (unified
                // addressing); the attribute is an i32.
                unsafe {
                    sys::cuPointerGetAttribute(
                        (&mut ordinal as *mut i32).cast(),
                        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                        ptrs[0],
                    )
                }
                .result()
                .map_err(|e| err("arena device", e))?;
                ordinal
            }
        };
        let dev = cu::device::get(device).map_err(|e| err("device", e))?;
        // SAFETY: `dev` is a valid device; CubeCL uses its primary context too.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| err("primary context", e))?;
        // SAFETY: `ctx` was just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| err("set context", e))?;
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| err("stream", e))?;
        Ok(Self {
            pool,
            ctx,
            stream,
            ptrs: (ptrs[0], ptrs[1]),
            _resources: resources,
            pinned: Vec::new(),
            registered: Vec::new(),
            in_flight: BTreeMap::new(),
            next: 0,
        })
    }

    /// The CubeCL arenas (for the grouped kernel).
    pub fn pool(&self) -> &CubePool<CudaRuntime> {
        &self.pool
    }

    /// A free pinned buffer of at least `bytes`, allocated once and reused.
    fn pinned(&mut self, bytes: usize) -> Result<usize, MoveError> {
        if let Some(i) = self.pinned.iter().position(|p| !p.busy && p.cap >= bytes) {
            self.pinned[i].busy = true;
            return Ok(i);
        }
        // Round up so later, slightly larger pages reuse it.
        let cap = bytes.next_power_of_two().max(1 << 20);
        // SAFETY: plain allocation; freed in Drop.
        let ptr = unsafe { cu::malloc_host(cap, 0) }.map_err(|e| err("pinned alloc", e))? as *mut u8;
        self.pinned.push(Pinned { ptr, cap, busy: true });
        Ok(self.pinned.len() - 1)
    }

    fn copy(&mut self, dst: u64, src: &[u8], used: &mut Vec<usize>) -> Result<(), MoveError> {
        let (a, b) = (src.as_ptr() as usize, src.as_ptr() as usize + src.len());
        if self.registered.iter().any(|&(s, l)| s <= a && b <= s + l) {
            // SAFETY: `src` is page-locked and, per `pin_host`'s contract, stays
            // alive and unchanged while the mover lives; `dst` lies in an arena.
            return unsafe { cu::memcpy_htod_async(dst, src, self.stream) }.map_err(|e| err("copy", e));
        }
        let i = self.pinned(src.len())?;
        used.push(i);
        let p = &self.pinned[i];
        // SAFETY: `p` has `cap >= src.len()` bytes and is not used by any copy in flight (`busy`).
        let staged = unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), p.ptr, src.len());
            std::slice::from_raw_parts(p.ptr, src.len())
        };
        // SAFETY: `dst` lies inside an arena (checked by the caller), the
        // pinned source stays alive and untouched until the event completes.
        unsafe { cu::memcpy_htod_async(dst, staged, self.stream) }.map_err(|e| err("copy", e))
    }
}

impl DeviceMover<CudaRuntime> for CudaMover {
    fn pool(&self) -> &CubePool<CudaRuntime> {
        &self.pool
    }
}

/// A [`CudaMover`] as the caller's `DeviceMover<R>` when `R` is the CUDA runtime, `None` for
/// any other runtime (see [`crate::device_mover`]).
pub(crate) fn on_cuda<R: Runtime>(
    client: &ComputeClient<R>,
    plane_words: usize,
    lut_entries: usize,
) -> Result<Option<Box<dyn DeviceMover<R>>>, MoveError> {
    let Some(cuda) = (client as &dyn Any).downcast_ref::<ComputeClient<CudaRuntime>>() else {
        return Ok(None);
    };
    let mover: Box<dyn DeviceMover<CudaRuntime>> =
        Box::new(CudaMover::for_client(cuda.clone(), plane_words, lut_entries)?);
    // `R` is `CudaRuntime` here (the downcast above), so this is the identity.
    let any: Box<dyn Any> = Box::new(mover);
    any.downcast::<Box<dyn DeviceMover<R>>>()
        .map(|m| Some(*m))
        .map_err(|_| MoveError("the CUDA mover does not match the client's runtime".into()))
}

impl Mover for CudaMover {
    fn capacity(&self) -> (usize, usize) {
        self.pool.capacity()
    }

    fn write_ordered(&mut self, writes: &[Write<'_>]) -> Result<(), MoveError> {
        self.pool.write_ordered(writes)
    }

    fn start(&mut self, writes: &[Write<'_>]) -> Result<Ticket, MoveError> {
        let (plane_cap, lut_cap) = self.pool.capacity();
        for w in writes {
            let (off, len, cap) = match *w {
                Write::Planes { off, data } => (off, data.len(), plane_cap),
                Write::Lut { off, data } => (off, data.len(), lut_cap),
            };
            if off + len > cap {
                return Err(MoveError(format!("write [{off}, {}) past the arena of {cap}", off + len)));
            }
        }
        // Kernels launched before may still read the destinations' old contents.
        cubecl::future::block_on(self.pool.client().sync()).map_err(|e| MoveError(format!("{e:?}")))?;
        // SAFETY: `ctx` is retained for the mover's life.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| err("set context", e))?;
        let mut used = Vec::new();
        for w in writes {
            let r = match *w {
                Write::Planes { off, data } => {
                    self.copy(self.ptrs.0 + 4 * off as u64, bytemuck_u32(data), &mut used)
                }
                Write::Lut { off, data } => {
                    self.copy(self.ptrs.1 + 2 * off as u64, bytemuck_f16(data), &mut used)
                }
            };
            if let Err(e) = r {
                for &i in &used {
                    self.pinned[i].busy = false;
                }
                // SAFETY: the stream is ours; wait for the partial copies before reuse.
                let _ = unsafe { cu::stream::synchronize(self.stream) };
                return Err(e);
            }
        }
        let event =
            cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| err("event", e))?;
        // SAFETY: both are live objects of the current context.
        unsafe { cu::event::record(event, self.stream) }.map_err(|e| err("event record", e))?;
        self.next += 1;
        let t = Ticket(self.next);
        self.in_flight.insert(t, (event, used));
        Ok(t)
    }

    fn finished(&mut self, ticket: Ticket) -> Result<bool, MoveError> {
        let Some(&(event, _)) = self.in_flight.get(&ticket) else { return Ok(true) };
        // SAFETY: `ctx` is retained for the mover's life (this thread may not have it current).
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| err("set context", e))?;
        // SAFETY: `event` is live until removed below.
        match unsafe { cu::event::query(event) } {
            Ok(()) => {
                let (event, used) = self.in_flight.remove(&ticket).expect("present");
                for i in used {
                    self.pinned[i].busy = false;
                }
                // SAFETY: completed and no longer referenced.
                unsafe { cu::event::destroy(event) }.map_err(|e| err("event destroy", e))?;
                Ok(true)
            }
            Err(cu::DriverError(sys::cudaError_enum::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(err("event query", e)),
        }
    }

    fn publish(&mut self, table: &[PoolSlot]) -> Result<(), MoveError> {
        self.pool.publish(table)
    }

    fn pin_host(&mut self, data: &[u8]) {
        // Small ranges are not worth a registration (and share OS pages with
        // other allocations); a failed one (e.g. a page already registered by
        // a neighbour) leaves the range to the staging path.
        if data.len() < 1 << 20 {
            return;
        }
        // SAFETY: `ctx` is retained; the range is live host memory that outlives
        // the registration (unregistered in Drop, before the parents are freed).
        let ok = unsafe {
            cu::ctx::set_current(self.ctx).is_ok()
                && sys::cuMemHostRegister_v2(data.as_ptr() as *mut _, data.len(), 0).result().is_ok()
        };
        if ok {
            self.registered.push((data.as_ptr() as usize, data.len()));
        }
    }
}

impl Drop for CudaMover {
    fn drop(&mut self) {
        // SAFETY: the stream and the pinned buffers are ours; wait before freeing.
        unsafe {
            let _ = cu::ctx::set_current(self.ctx);
            let _ = cu::stream::synchronize(self.stream);
            for (_, (event, _)) in std::mem::take(&mut self.in_flight) {
                let _ = cu::event::destroy(event);
            }
            for &(start, _) in &self.registered {
                let _ = sys::cuMemHostUnregister(start as *mut std::ffi::c_void);
            }
            for p in &self.pinned {
                let _ = cu::free_host(p.ptr as *mut std::ffi::c_void);
            }
            let _ = cu::stream::destroy(self.stream);
        }
    }
}

fn bytemuck_u32(d: &[u32]) -> &[u8] {
    u32::as_bytes(d)
}

fn bytemuck_f16(d: &[half::f16]) -> &[u8] {
    half::f16::as_bytes(d)
}
