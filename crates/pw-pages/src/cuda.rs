//! The asynchronous mover on CUDA: raising transfers are cudarc copies from
//! the host parents (large ranges page-locked in place, small ones copied once
//! into pinned slabs, see [`Mover::pin_host`]; anything else through reused
//! pinned staging buffers) into the raw device pointers of the CubeCL arenas,
//! on a stream of their own, each closed by an event that [`Mover::finished`]
//! polls. Measured on the H200 (`shared/notes/cubecl-0.10-on-h200.md`): 55 GB/s
//! this way against 0.4–0.6 GB/s through CubeCL's `create`, without slowing
//! the kernel stream.
//!
//! Ordering: CubeCL's stream is private, so no event can be recorded on it.
//! A transfer's destinations may have been read by kernels launched before
//! the boundary that freed them, so the first copy of a boundary waits for the
//! CubeCL queue (`client.sync()`), unless the caller already did for several
//! tables at once ([`crate::boundaries`]). At a boundary between decode steps the host
//! has normally just read the step's logits, so the queue is already drained
//! and the wait costs a round trip, not a step. Ordered writes (lowering LUT
//! swaps) are copies on a second stream that [`Mover::end_boundary`] waits for,
//! so the kernels launched after the boundary read them.

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

/// Host ranges shorter than this are copied into pinned slabs rather than page-locked in place
/// (a registration covers whole OS pages, which small allocations share with their neighbours).
const MIRROR_BELOW: usize = 1 << 20;
/// Bytes of one pinned slab holding small host ranges.
const SLAB_BYTES: usize = 64 << 20;

/// A small host range announced by [`Mover::pin_host`] and its copy in a pinned slab.
struct Mirror {
    src: usize,
    len: usize,
    ptr: *const u8,
}

/// Pinned host memory that small ranges are copied into.
struct Slab {
    ptr: *mut u8,
    cap: usize,
    used: usize,
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
    /// Small announced ranges and their pinned copies, by source address.
    mirrors: Vec<Mirror>,
    slabs: Vec<Slab>,
    in_flight: BTreeMap<Ticket, (sys::CUevent, Vec<usize>)>,
    next: u64,
    /// The stream of ordered writes, waited for at the end of each boundary.
    ordered: sys::CUstream,
    /// Whether ordered writes were issued since the stream was last waited for, and their
    /// staging buffers.
    ordered_pending: bool,
    ordered_used: Vec<usize>,
    /// Whether CubeCL's queue was drained in the current boundary.
    drained: bool,
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
        let ordered =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| err("stream", e))?;
        Ok(Self {
            pool,
            ctx,
            stream,
            ptrs: (ptrs[0], ptrs[1]),
            _resources: resources,
            pinned: Vec::new(),
            registered: Vec::new(),
            mirrors: Vec::new(),
            slabs: Vec::new(),
            in_flight: BTreeMap::new(),
            next: 0,
            ordered,
            ordered_pending: false,
            ordered_used: Vec::new(),
            drained: false,
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

    /// Where `src` can be copied from without staging: itself when page-locked, else its
    /// pinned copy.
    fn pinned_source<'a>(&self, src: &'a [u8]) -> Option<&'a [u8]> {
        let (a, b) = (src.as_ptr() as usize, src.as_ptr() as usize + src.len());
        if self.registered.iter().any(|&(s, l)| s <= a && b <= s + l) {
            return Some(src);
        }
        let i = self.mirrors.partition_point(|m| m.src <= a);
        let m = self.mirrors.get(i.checked_sub(1)?)?;
        (b <= m.src + m.len).then(|| {
            // SAFETY: `[a, b)` lies within the mirrored range, whose pinned copy lives (and,
            // like its source per `pin_host`'s contract, stays unchanged) as long as the mover.
            unsafe { std::slice::from_raw_parts(m.ptr.add(a - m.src), src.len()) }
        })
    }

    /// Issues the copy of `src` to device address `dst` on `stream`, staging it through a
    /// pinned buffer (its index pushed to `used`) when it has no pinned source.
    fn copy(
        &mut self,
        dst: u64,
        src: &[u8],
        stream: sys::CUstream,
        used: &mut Vec<usize>,
    ) -> Result<(), MoveError> {
        if let Some(pinned) = self.pinned_source(src) {
            // SAFETY: `pinned` is page-locked and stays alive and unchanged while the mover
            // lives; `dst` lies in an arena (checked by the caller).
            return unsafe { cu::memcpy_htod_async(dst, pinned, stream) }.map_err(|e| err("copy", e));
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
        // pinned source stays alive and untouched until the stream passes the copy.
        unsafe { cu::memcpy_htod_async(dst, staged, stream) }.map_err(|e| err("copy", e))
    }

    /// Checks that `writes` fit the arenas.
    fn check(&self, writes: &[Write<'_>]) -> Result<(), MoveError> {
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
        Ok(())
    }

    /// Waits for the CubeCL queue once per boundary (kernels launched before may still read
    /// the destinations' old contents) and makes the mover's context current.
    fn begin_copies(&mut self) -> Result<(), MoveError> {
        if !self.drained {
            cubecl::future::block_on(self.pool.client().sync()).map_err(|e| MoveError(format!("{e:?}")))?;
            self.drained = true;
        }
        // SAFETY: `ctx` is retained for the mover's life.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| err("set context", e))
    }

    /// Issues `writes` on `stream`; on failure waits for the partial copies and frees their
    /// staging buffers.
    fn copy_all(&mut self, writes: &[Write<'_>], stream: sys::CUstream) -> Result<Vec<usize>, MoveError> {
        let mut used = Vec::new();
        for w in writes {
            let r = match *w {
                Write::Planes { off, data } => {
                    self.copy(self.ptrs.0 + 4 * off as u64, bytemuck_u32(data), stream, &mut used)
                }
                Write::Lut { off, data } => {
                    self.copy(self.ptrs.1 + 2 * off as u64, bytemuck_f16(data), stream, &mut used)
                }
            };
            if let Err(e) = r {
                // SAFETY: the stream is ours; wait for the partial copies before reuse.
                let _ = unsafe { cu::stream::synchronize(stream) };
                for &i in &used {
                    self.pinned[i].busy = false;
                }
                return Err(e);
            }
        }
        Ok(used)
    }

    /// Copies a small host range into a pinned slab once, for direct copies later.
    fn mirror(&mut self, data: &[u8]) -> Result<(), MoveError> {
        const ALIGN: usize = 256;
        let len = data.len();
        let slab = match self.slabs.iter().position(|s| s.used.next_multiple_of(ALIGN) + len <= s.cap) {
            Some(i) => i,
            None => {
                let cap = SLAB_BYTES.max(len);
                // SAFETY: `ctx` is retained; plain allocation, freed in Drop.
                let ptr = unsafe { cu::ctx::set_current(self.ctx).and_then(|()| cu::malloc_host(cap, 0)) }
                    .map_err(|e| err("pinned alloc", e))? as *mut u8;
                self.slabs.push(Slab { ptr, cap, used: 0 });
                self.slabs.len() - 1
            }
        };
        let s = &mut self.slabs[slab];
        let at = s.used.next_multiple_of(ALIGN);
        // SAFETY: `[at, at + len)` lies within the slab (checked above) and is used by nothing else.
        let ptr = unsafe {
            let ptr = s.ptr.add(at);
            std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, len);
            ptr
        };
        s.used = at + len;
        let src = data.as_ptr() as usize;
        let i = self.mirrors.partition_point(|m| m.src <= src);
        self.mirrors.insert(i, Mirror { src, len, ptr });
        Ok(())
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
        self.check(writes)?;
        self.begin_copies()?;
        self.ordered_pending = true;
        let used = self.copy_all(writes, self.ordered)?;
        self.ordered_used.extend(used);
        Ok(())
    }

    fn start(&mut self, writes: &[Write<'_>]) -> Result<Ticket, MoveError> {
        self.check(writes)?;
        self.begin_copies()?;
        let used = self.copy_all(writes, self.stream)?;
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

    fn waits_for_queue(&self) -> bool {
        true
    }

    fn queue_drained(&mut self) {
        self.drained = true;
    }

    fn end_boundary(&mut self) -> Result<(), MoveError> {
        self.drained = false;
        if !std::mem::take(&mut self.ordered_pending) {
            return Ok(());
        }
        // SAFETY: `ctx` is retained for the mover's life; the stream is ours.
        unsafe { cu::ctx::set_current(self.ctx).and_then(|()| cu::stream::synchronize(self.ordered)) }
            .map_err(|e| err("ordered writes", e))?;
        for i in std::mem::take(&mut self.ordered_used) {
            self.pinned[i].busy = false;
        }
        Ok(())
    }

    fn pin_host(&mut self, data: &[u8]) {
        // Small ranges share OS pages with other allocations, which a registration would
        // cover: they get a pinned copy instead. A failed registration (e.g. of a page
        // already registered by a neighbour) or copy leaves the range to the staging path.
        if data.len() < MIRROR_BELOW {
            if !data.is_empty() && self.pinned_source(data).is_none() {
                let _ = self.mirror(data);
            }
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
            let _ = cu::stream::synchronize(self.ordered);
            for p in &self.pinned {
                let _ = cu::free_host(p.ptr as *mut std::ffi::c_void);
            }
            for s in &self.slabs {
                let _ = cu::free_host(s.ptr as *mut std::ffi::c_void);
            }
            let _ = cu::stream::destroy(self.stream);
            let _ = cu::stream::destroy(self.ordered);
        }
    }
}

fn bytemuck_u32(d: &[u32]) -> &[u8] {
    u32::as_bytes(d)
}

fn bytemuck_f16(d: &[half::f16]) -> &[u8] {
    half::f16::as_bytes(d)
}
