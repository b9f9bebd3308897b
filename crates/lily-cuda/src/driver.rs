//! The few CUDA driver calls lily needs, over cudarc's raw bindings (loaded at run time, so a machine without a
//! driver never touches them): one context and one stream, device buffers, copies, kernel launches, graphs and
//! events. Every call's status is checked and returned as an error.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::kernels::TensorMap;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver library (libcuda) found")]
    NoDriver,
    #[error("no CUDA device found")]
    NoDevice,
    #[error("CUDA {call}: {name} ({code})")]
    Driver {
        call: &'static str,
        name: String,
        code: i32,
    },
    #[error("NVRTC: {0}")]
    Nvrtc(String),
    #[error("{0}")]
    Other(String),
}

pub type Result<T> = std::result::Result<T, GpuError>;

/// Attaches the call's name to a driver status.
pub(crate) fn check(call: &'static str, status: sys::CUresult) -> Result<()> {
    if status == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let name = result::DriverError(status)
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{status:?}"));
    Err(GpuError::Driver {
        call,
        name,
        code: status as i32,
    })
}

fn driver_err(call: &'static str) -> impl Fn(result::DriverError) -> GpuError {
    move |e| {
        let name = e
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        GpuError::Driver {
            call,
            name,
            code: e.0 as i32,
        }
    }
}

/// A typed device address: where a kernel argument of type `T*` points. Copying one does not copy the memory.
pub struct DevPtr<T> {
    addr: sys::CUdeviceptr,
    _elem: PhantomData<*const T>,
}

impl<T> Clone for DevPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DevPtr<T> {}

impl<T> std::fmt::Debug for DevPtr<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevPtr({:#x})", self.addr)
    }
}

impl<T> DevPtr<T> {
    /// The null pointer (kernels take it for "no such output").
    pub const NULL: DevPtr<T> = DevPtr::from_raw(0);

    pub const fn from_raw(addr: sys::CUdeviceptr) -> DevPtr<T> {
        DevPtr {
            addr,
            _elem: PhantomData,
        }
    }

    /// The untyped address.
    pub fn raw(self) -> sys::CUdeviceptr {
        self.addr
    }

    /// The address `count` elements further on.
    pub fn offset(self, count: usize) -> DevPtr<T> {
        DevPtr::from_raw(self.addr + (count * std::mem::size_of::<T>()) as u64)
    }

    /// The same address seen as another element type (a buffer that holds two kinds of data, or a kernel that
    /// reads raw bits).
    pub fn cast<U>(self) -> DevPtr<U> {
        DevPtr::from_raw(self.addr)
    }
}

/// A device allocation of `len` values of `T`, freed on drop.
pub struct DevBuf<T> {
    addr: sys::CUdeviceptr,
    len: usize,
    _elem: PhantomData<T>,
}

// The memory belongs to the one context, used by one thread at a time; `T` is only a label.
unsafe impl<T> Send for DevBuf<T> {}
unsafe impl<T> Sync for DevBuf<T> {}
unsafe impl<T> Send for DevPtr<T> {}
unsafe impl<T> Sync for DevPtr<T> {}

impl<T> DevBuf<T> {
    /// The address of the first value.
    pub fn ptr(&self) -> DevPtr<T> {
        DevPtr::from_raw(self.addr)
    }

    /// The address of value `index` (`index == len` gives the end).
    pub fn at(&self, index: usize) -> DevPtr<T> {
        debug_assert!(index <= self.len);
        self.ptr().offset(index)
    }

    /// Values the buffer holds.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the buffer holds.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        if self.addr != 0 {
            // Errors while freeing at drop have nowhere to go; the context is torn down soon after anyway.
            let _ = unsafe { result::free_sync(self.addr) };
        }
    }
}

/// One i32 in pinned host memory that kernels write through its device address: the host reads it after a
/// synchronisation without a copy on the stream (the chosen token of each step).
pub struct HostCell {
    host: *mut i32,
    /// The address kernels write to.
    pub ptr: DevPtr<i32>,
}

// Written by the GPU and read by the one thread that uses the backend, after a synchronisation.
unsafe impl Send for HostCell {}

impl HostCell {
    /// The value (call after the work that writes it has been waited for).
    pub fn read(&self) -> i32 {
        unsafe { std::ptr::read_volatile(self.host) }
    }
}

impl Drop for HostCell {
    fn drop(&mut self) {
        let _ = unsafe { sys::cuMemFreeHost(self.host as *mut c_void) };
    }
}

/// `len` i32 values in pinned host memory that kernels write through their device address: the host reads them
/// after a synchronisation without a copy on the stream (the tokens a batched sampler chose).
pub struct HostBuf {
    host: *mut i32,
    len: usize,
    /// The address kernels write to.
    pub ptr: DevPtr<i32>,
}

// Written by the GPU and read by the one thread that uses the backend, after a synchronisation.
unsafe impl Send for HostBuf {}

impl HostBuf {
    /// Values the buffer holds.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Value `index` (call after the work that writes it has been waited for).
    pub fn read(&self, index: usize) -> i32 {
        assert!(index < self.len, "index {index} of a pinned buffer of {}", self.len);
        unsafe { std::ptr::read_volatile(self.host.add(index)) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let _ = unsafe { sys::cuMemFreeHost(self.host as *mut c_void) };
    }
}

/// One GPU, its primary context and the stream all of lily's work goes to.
pub struct Gpu {
    _ctx: Arc<CudaContext>,
    pub stream: sys::CUstream,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: usize,
    /// The most shared memory a block may use (with the kernel's opt-in).
    pub max_shared_per_block: usize,
    pub driver_version: i32,
    pub total_memory: usize,
}

// The stream and context handles are used from one thread at a time (the backend is moved, not shared).
unsafe impl Send for Gpu {}

impl Gpu {
    /// Opens device 0, or says why not (no driver library, no device).
    pub fn open() -> Result<Gpu> {
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        check("cuInit", unsafe { sys::cuInit(0) })?;
        let count = result::device::get_count().map_err(driver_err("cuDeviceGetCount"))?;
        if count < 1 {
            return Err(GpuError::NoDevice);
        }
        let ctx = CudaContext::new(0).map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let stream =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(driver_err("cuStreamCreate"))?;
        let mut driver_version = 0;
        check("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut driver_version)
        })?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_err("cuDeviceGetAttribute"))? as usize;
        let max_shared_per_block = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(driver_err("cuDeviceGetAttribute"))? as usize;
        Ok(Gpu {
            max_shared_per_block,
            name: ctx.name().map_err(driver_err("cuDeviceGetName"))?,
            compute_capability: ctx.compute_capability().map_err(driver_err("cuDeviceGetAttribute"))?,
            total_memory: ctx.total_mem().map_err(driver_err("cuDeviceTotalMem"))?,
            sm_count,
            driver_version,
            stream,
            _ctx: ctx,
        })
    }

    /// Bytes of device memory free now (the context must be current on this thread).
    pub fn free_memory(&self) -> Result<usize> {
        let (mut free, mut total) = (0usize, 0usize);
        check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok(free)
    }

    /// Makes this GPU's context current on the calling thread (needed once per thread).
    pub fn bind(&self) -> Result<()> {
        self._ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))
    }

    /// Room for `len` values of `T`, uninitialised.
    pub fn alloc<T>(&self, len: usize) -> Result<DevBuf<T>> {
        let bytes = len * std::mem::size_of::<T>();
        let addr = match bytes {
            0 => 0,
            _ => unsafe { result::malloc_sync(bytes) }.map_err(|e| match driver_err("cuMemAlloc")(e) {
                GpuError::Driver { name, .. } => GpuError::Other(format!("cuMemAlloc of {bytes} bytes: {name}")),
                other => other,
            })?,
        };
        Ok(DevBuf {
            addr,
            len,
            _elem: PhantomData,
        })
    }

    /// Room for `len` values of `T`, filled with zero bytes.
    pub fn alloc_zeroed<T>(&self, len: usize) -> Result<DevBuf<T>> {
        let buf = self.alloc(len)?;
        self.memset_u8(buf.ptr(), 0, buf.bytes())?;
        Ok(buf)
    }

    /// A new buffer holding a copy of `data` (waits for the copy).
    pub fn upload_new<T: bytemuck::Pod>(&self, data: &[T]) -> Result<DevBuf<T>> {
        let buf = self.alloc(data.len())?;
        self.upload(buf.ptr(), data)?;
        Ok(buf)
    }

    /// A zeroed [`HostCell`].
    pub fn host_cell(&self) -> Result<HostCell> {
        let mut host: *mut c_void = std::ptr::null_mut();
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP)
        })?;
        let mut addr: sys::CUdeviceptr = 0;
        // The cell owns the allocation from here on (its drop frees it), so it is completed in place rather than
        // copied into a second cell, which would free the memory the first time either is dropped.
        let mut cell = HostCell {
            host: host as *mut i32,
            ptr: DevPtr::NULL,
        };
        unsafe { std::ptr::write_volatile(cell.host, 0) };
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut addr, host, 0)
        })?;
        cell.ptr = DevPtr::from_raw(addr);
        Ok(cell)
    }

    /// A [`HostBuf`] of `len` (at least one) values, zeroed.
    pub fn host_buf(&self, len: usize) -> Result<HostBuf> {
        let len = len.max(1);
        let mut host: *mut c_void = std::ptr::null_mut();
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut host, len * 4, sys::CU_MEMHOSTALLOC_DEVICEMAP)
        })?;
        // As in `host_cell`: the buffer owns the allocation from here on and is completed in place.
        let mut buf = HostBuf {
            host: host as *mut i32,
            len,
            ptr: DevPtr::NULL,
        };
        for i in 0..len {
            unsafe { std::ptr::write_volatile(buf.host.add(i), 0) };
        }
        let mut addr: sys::CUdeviceptr = 0;
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut addr, host, 0)
        })?;
        buf.ptr = DevPtr::from_raw(addr);
        Ok(buf)
    }

    /// Queues a write of one 32-bit value to device memory, done by the stream itself (no copy, no host buffer).
    pub fn write_u32(&self, ptr: DevPtr<u32>, value: u32) -> Result<()> {
        check("cuStreamWriteValue32", unsafe {
            sys::cuStreamWriteValue32_v2(self.stream, ptr.raw(), value, 0)
        })
    }

    /// Queues a fill of `bytes` bytes from `ptr` with `value`.
    pub fn memset_u8<T>(&self, ptr: DevPtr<T>, value: u8, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(ptr.raw(), value, bytes, self.stream)
        })
    }

    /// Queues a fill of `count` 32-bit words from `ptr` with `value`.
    pub fn memset_u32<T>(&self, ptr: DevPtr<T>, value: u32, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        check("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(ptr.raw(), value, count, self.stream)
        })
    }

    /// Copies host data to `ptr` and waits for it.
    pub fn upload<T: bytemuck::Pod>(&self, ptr: DevPtr<T>, data: &[T]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let bytes: &[u8] = bytemuck::cast_slice(data);
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(ptr.raw(), bytes.as_ptr() as *const c_void, bytes.len(), self.stream)
        })?;
        self.sync()
    }

    /// Queues a copy of host data to `ptr`; `data` is pageable memory, which the driver stages before returning.
    pub fn upload_async<T: bytemuck::Pod>(&self, ptr: DevPtr<T>, data: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(ptr.raw(), bytes.as_ptr() as *const c_void, bytes.len(), self.stream)
        })
    }

    /// Copies device data at `ptr` into `out`, waiting for all queued work first.
    pub fn download<T: bytemuck::Pod>(&self, ptr: DevPtr<T>, out: &mut [T]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(bytes.as_mut_ptr() as *mut c_void, ptr.raw(), bytes.len(), self.stream)
        })?;
        self.sync()
    }

    /// Queues a device-to-device copy of `count` values.
    pub fn copy<T>(&self, dst: DevPtr<T>, src: DevPtr<T>, count: usize) -> Result<()> {
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.raw(), src.raw(), count * std::mem::size_of::<T>(), self.stream)
        })
    }

    pub fn sync(&self) -> Result<()> {
        check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.stream) })
    }

    /// A launch with `shared` bytes of dynamic shared memory (up to the device's opt-in limit; see `Kernels`). From
    /// Hopper on it is a programmatic dependent launch: the kernel may start before the previous kernel on the
    /// stream ends. Every kernel waits for its predecessor (`wait_previous` in common.cuh) before it reads that
    /// kernel's results or writes anything, which a CPU test checks in each kernel's compiled PTX.
    pub(crate) fn launch(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &mut Args,
    ) -> Result<()> {
        let mut params = args.pointers();
        if self.compute_capability.0 < 9 {
            return check("cuLaunchKernel", unsafe {
                sys::cuLaunchKernel(
                    kernel.0,
                    grid.0,
                    grid.1,
                    grid.2,
                    block,
                    1,
                    1,
                    shared,
                    self.stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            });
        }
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        check("cuLaunchKernelEx", unsafe {
            sys::cuLaunchKernelEx(&config, kernel.0, params.as_mut_ptr(), std::ptr::null_mut())
        })
    }

    /// A tensor map of the row-major matrix at `base`: `rows` rows of `cols` elements of `element` type (`row_bytes`
    /// bytes apart), read in boxes of `box_cols` x `box_rows`, written to shared memory with `swizzle`. Elements past
    /// the matrix's edges arrive as zeros. The driver checks the alignments: `base` and `row_bytes` multiples of 16,
    /// a box row a multiple of 16 bytes (at most 128 with the 128-byte swizzle), box sides at most 256.
    #[allow(clippy::too_many_arguments)]
    pub fn tensor_map_2d<T>(
        &self,
        base: DevPtr<T>,
        element: sys::CUtensorMapDataType,
        cols: usize,
        rows: usize,
        row_bytes: usize,
        box_cols: u32,
        box_rows: u32,
        swizzle: sys::CUtensorMapSwizzle,
    ) -> Result<TensorMap> {
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        let dims = [cols as u64, rows as u64];
        let strides = [row_bytes as u64];
        let boxes = [box_cols, box_rows];
        let element_strides = [1u32, 1];
        check("cuTensorMapEncodeTiled", unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                element,
                2,
                base.raw() as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        })?;
        Ok(TensorMap { words: map.opaque })
    }

    /// Records what `enqueue` queues on the stream as a graph, ready to replay.
    pub fn capture(&self, enqueue: impl FnOnce() -> Result<()>) -> Result<Graph> {
        check("cuStreamBeginCapture", unsafe {
            sys::cuStreamBeginCapture_v2(
                self.stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })?;
        let queued = enqueue();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        let ended = check("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(self.stream, &mut graph)
        });
        queued?;
        ended?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        let instantiated = check("cuGraphInstantiate", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
        });
        check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) })?;
        instantiated?;
        Ok(Graph { exec })
    }

    pub fn replay(&self, graph: &Graph) -> Result<()> {
        check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(graph.exec, self.stream) })
    }

    pub fn event(&self) -> Result<Event> {
        let mut event: sys::CUevent = std::ptr::null_mut();
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut event, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
        })?;
        Ok(Event { event })
    }

    pub fn record(&self, event: &Event) -> Result<()> {
        check("cuEventRecord", unsafe { sys::cuEventRecord(event.event, self.stream) })
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = unsafe { sys::cuStreamDestroy_v2(self.stream) };
    }
}

pub struct Graph {
    exec: sys::CUgraphExec,
}

// Graphs and events belong to the backend, which one thread uses at a time.
unsafe impl Send for Graph {}
unsafe impl Send for Event {}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = unsafe { sys::cuGraphExecDestroy(self.exec) };
    }
}

pub struct Event {
    event: sys::CUevent,
}

impl Event {
    /// Milliseconds from `self` to `end` (both recorded and completed).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(end.event) })?;
        let mut ms = 0.0f32;
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, self.event, end.event)
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}

/// A kernel function of a loaded module (only [`crate::kernels::Kernels`] makes them).
#[derive(Clone, Copy)]
pub struct Kernel(pub(crate) sys::CUfunction);

/// A kernel's arguments, each kept in its own 16-byte slot (a tensor map in a 128-byte one) so the driver can read
/// it through a pointer. Only the typed launchers of [`crate::kernels`] build them.
pub struct Args {
    slots: [[u64; 2]; MAX_ARGS],
    /// For each argument, the tensor map slot that holds it (`NOT_MAP`: its 16-byte slot does).
    map_of: [usize; MAX_ARGS],
    maps: [TensorMap; MAX_MAPS],
    len: usize,
    map_len: usize,
}

pub(crate) const MAX_ARGS: usize = 20;
const MAX_MAPS: usize = 4;
const NOT_MAP: usize = usize::MAX;

impl Default for Args {
    fn default() -> Args {
        Args::new()
    }
}

impl Args {
    pub(crate) fn new() -> Args {
        Args {
            slots: [[0; 2]; MAX_ARGS],
            map_of: [NOT_MAP; MAX_ARGS],
            maps: [TensorMap { words: [0; 16] }; MAX_MAPS],
            len: 0,
            map_len: 0,
        }
    }
    /// Appends one argument (see [`crate::kernels::KernelArg`]).
    pub fn arg<A: crate::kernels::KernelArg>(mut self, a: A) -> Args {
        assert!(self.len < MAX_ARGS, "a kernel takes at most {MAX_ARGS} arguments");
        if let Some(map) = a.tensor_map() {
            assert!(self.map_len < MAX_MAPS, "a kernel takes at most {MAX_MAPS} tensor maps");
            self.maps[self.map_len] = map;
            self.map_of[self.len] = self.map_len;
            self.map_len += 1;
        } else {
            self.slots[self.len] = a.slot();
        }
        self.len += 1;
        self
    }
    fn pointers(&mut self) -> [*mut c_void; MAX_ARGS] {
        let mut out = [std::ptr::null_mut(); MAX_ARGS];
        for (i, o) in out.iter_mut().enumerate().take(self.len) {
            *o = match self.map_of[i] {
                NOT_MAP => self.slots[i].as_mut_ptr() as *mut c_void,
                map => self.maps[map].words.as_mut_ptr() as *mut c_void,
            };
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pointers a launch hands the driver: each ordinary argument's bytes in its own slot, each tensor map's 128
    /// bytes whole and 64-byte aligned, in parameter order.
    #[test]
    fn tensor_map_arguments_are_passed_whole_and_aligned() {
        let map = |first: u64| TensorMap {
            words: std::array::from_fn(|i| first + i as u64),
        };
        let mut args = Args::new().arg(map(100)).arg(7i32).arg(map(200)).arg(2.5f32);
        let pointers = args.pointers();
        let read_map = |p: *mut c_void| {
            assert_eq!(p as usize % 64, 0, "a tensor map's copy is 64-byte aligned");
            unsafe { *(p as *const [u64; 16]) }
        };
        assert_eq!(read_map(pointers[0]), map(100).words);
        assert_eq!(unsafe { *(pointers[1] as *const i32) }, 7);
        assert_eq!(read_map(pointers[2]), map(200).words);
        assert_eq!(unsafe { *(pointers[3] as *const f32) }, 2.5);
        assert!(pointers[4..].iter().all(|p| p.is_null()));
    }
}
