//! Tensor buffers for IO binding: allocated once, viewed with any shape that fits, never copied.
//!
//! ONNX Runtime binds inputs and outputs to tensors of a fixed shape, while a KV cache grows by
//! one row per step. A *view* here is an ONNX Runtime tensor of the shape needed now over the
//! first elements of a buffer allocated once at full capacity: binding it costs no copy and no
//! allocation of the data.

use std::ptr::NonNull;

use ort::memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType};
use ort::session::Session;
use ort::value::{DynTensor, TensorElementType};
use ort::AsPointer;

use super::pack::FloatType;

/// ONNX Runtime's element type for a float type.
pub(crate) fn element(ty: FloatType) -> TensorElementType {
    match ty {
        FloatType::F32 => TensorElementType::Float32,
        FloatType::F16 => TensorElementType::Float16,
    }
}

fn element_size(ty: TensorElementType) -> usize {
    match ty {
        TensorElementType::Float16 | TensorElementType::Bfloat16 => 2,
        TensorElementType::Float64 | TensorElementType::Int64 | TensorElementType::Uint64 => 8,
        TensorElementType::Int8 | TensorElementType::Uint8 | TensorElementType::Bool => 1,
        TensorElementType::Int16 | TensorElementType::Uint16 => 2,
        _ => 4,
    }
}

thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Buffers allocated by this module on the calling thread since it started (KV caches, bound
/// inputs and outputs): a resident step allocates none. Per thread, so that models stepping on
/// other threads do not count.
pub fn buffer_allocations() -> u64 {
    ALLOCATIONS.with(|a| a.get())
}

/// A buffer allocated once, with its capacity in elements.
pub(crate) struct Buffer {
    pub tensor: DynTensor,
    pub ty: TensorElementType,
    pub capacity: usize,
}

impl Buffer {
    /// A buffer of `shape` from `alloc`: zero-filled in host memory; in a device's memory, as
    /// the device gives it (a KV cache is only read where it has been written).
    pub fn zeros(alloc: &Allocator, ty: TensorElementType, shape: &[i64]) -> ort::Result<Buffer> {
        ALLOCATIONS.with(|a| a.set(a.get() + 1));
        let mut tensor = DynTensor::new(alloc, ty, shape.to_vec())?;
        let capacity = shape.iter().product::<i64>().max(0) as usize;
        let bytes = capacity * element_size(ty);
        if tensor.memory_info().is_cpu_accessible() {
            // SAFETY: a freshly allocated host tensor of `capacity` elements owns `bytes` bytes.
            unsafe { std::ptr::write_bytes(tensor.data_ptr_mut().cast::<u8>(), 0, bytes) };
        }
        Ok(Buffer {
            tensor,
            ty,
            capacity,
        })
    }

    /// Bytes per element.
    pub fn element_bytes(&self) -> usize {
        element_size(self.ty)
    }

    /// A tensor of `shape` over the first elements of this buffer (no copy).
    ///
    /// The view must not outlive the buffer: owners keep views in fields dropped before their
    /// buffers, or rebuild them every step.
    pub fn view(&mut self, alloc: &Allocator, shape: &[i64]) -> ort::Result<DynTensor> {
        self.view_at(alloc, 0, shape)
    }

    /// A tensor of `shape` over this buffer's elements from element `offset` on (no copy): one
    /// row of a batch, in host or device memory.
    ///
    /// The view must not outlive the buffer, as [`view`](Self::view)'s.
    pub fn view_at(
        &mut self,
        alloc: &Allocator,
        offset: usize,
        shape: &[i64],
    ) -> ort::Result<DynTensor> {
        let n = shape.iter().product::<i64>().max(0) as usize;
        if offset + n > self.capacity {
            return Err(ort::Error::new(format!(
                "view of {n} elements from element {offset} over a buffer of {}",
                self.capacity
            )));
        }
        // An address inside the buffer's allocation (host or device: only ONNX Runtime reads it).
        let data = self
            .tensor
            .data_ptr_mut()
            .cast::<u8>()
            .wrapping_add(offset * element_size(self.ty))
            .cast::<std::ffi::c_void>();
        let mut out: *mut ort::sys::OrtValue = std::ptr::null_mut();
        // SAFETY: `data` points to element `offset` of `capacity` elements of `ty` in memory
        // described by the buffer's memory info; the view covers at most the rest. The created value does not
        // own the data (ONNX Runtime never frees external data).
        let status = unsafe {
            (ort::api().CreateTensorWithDataAsOrtValue)(
                self.tensor.memory_info().ptr(),
                data,
                n * element_size(self.ty),
                shape.as_ptr(),
                shape.len(),
                self.ty.into(),
                &mut out,
            )
        };
        status_result(status)?;
        let Some(ptr) = NonNull::new(out) else {
            return Err(ort::Error::new(
                "CreateTensorWithDataAsOrtValue returned null",
            ));
        };
        // SAFETY: `ptr` is a valid tensor value we own; the allocator only keeps a handle.
        Ok(unsafe { DynTensor::from_ptr(ptr, Some(alloc)) })
    }

    /// Whether the buffer is in memory the host can read and write.
    pub fn on_host(&self) -> bool {
        self.tensor.memory_info().is_cpu_accessible()
    }

    /// Writes `bytes` over elements from `at` on, in host or device memory (a device buffer
    /// through ONNX Runtime's copy from a host buffer).
    ///
    /// # Errors
    ///
    /// A range past the buffer, ONNX Runtime's copy.
    pub fn write_at(&mut self, alloc: &Allocator, at: usize, bytes: &[u8]) -> ort::Result<()> {
        let size = element_size(self.ty);
        let n = bytes.len() / size;
        let start = at * size;
        if at + n > self.capacity {
            return Err(ort::Error::new(format!(
                "write of {n} elements from element {at} over a buffer of {}",
                self.capacity
            )));
        }
        if self.on_host() {
            self.as_bytes()[start..start + n * size].copy_from_slice(&bytes[..n * size]);
            return Ok(());
        }
        let host = Allocator::default();
        let mut staging = Buffer::zeros(&host, self.ty, &[n as i64])?;
        staging.as_bytes().copy_from_slice(&bytes[..n * size]);
        let src = staging.view(&host, &[n as i64])?;
        let mut dst = self.view_at(alloc, at, &[n as i64])?;
        src.copy_into(&mut dst)
    }

    /// Sets `n` elements from `at` on to zero, in host or device memory.
    ///
    /// # Errors
    ///
    /// As [`write_at`](Self::write_at).
    pub fn zero_at(&mut self, alloc: &Allocator, at: usize, n: usize) -> ort::Result<()> {
        if self.on_host() {
            let size = element_size(self.ty);
            let end = ((at + n) * size).min(self.capacity * size);
            self.as_bytes()[(at * size).min(end)..end].fill(0);
            return Ok(());
        }
        self.write_at(alloc, at, &vec![0u8; n * element_size(self.ty)])
    }

    /// The bytes of `n` elements from `at` on, from host or device memory.
    ///
    /// # Errors
    ///
    /// A range past the buffer, ONNX Runtime's copy.
    pub fn read_at(&mut self, alloc: &Allocator, at: usize, n: usize) -> ort::Result<Vec<u8>> {
        let size = element_size(self.ty);
        if at + n > self.capacity {
            return Err(ort::Error::new(format!(
                "read of {n} elements from element {at} of a buffer of {}",
                self.capacity
            )));
        }
        if self.on_host() {
            return Ok(self.as_bytes()[at * size..(at + n) * size].to_vec());
        }
        let host = Allocator::default();
        let mut staging = Buffer::zeros(&host, self.ty, &[n as i64])?;
        let src = self.view_at(alloc, at, &[n as i64])?;
        let mut dst = staging.view(&host, &[n as i64])?;
        src.copy_into(&mut dst)?;
        drop(dst);
        Ok(staging.as_bytes().to_vec())
    }

    /// Copies this buffer's first `shape` elements (in `alloc`'s memory) over `to`'s first (in
    /// `to_alloc`'s), through ONNX Runtime's copy: host or device on either side.
    ///
    /// # Errors
    ///
    /// A shape past either buffer, ONNX Runtime's copy.
    pub fn copy_prefix_to(
        &mut self,
        alloc: &Allocator,
        to: &mut Buffer,
        to_alloc: &Allocator,
        shape: &[i64],
    ) -> ort::Result<()> {
        let src = self.view(alloc, shape)?;
        let mut dst = to.view(to_alloc, shape)?;
        src.copy_into(&mut dst)
    }

    /// Where the buffer lives.
    pub fn placement(&self) -> Placement {
        let m = self.tensor.memory_info();
        Placement {
            device: m.allocation_device().as_str().to_string(),
            id: m.device_id(),
        }
    }

    /// The buffer's bytes (CPU buffers only).
    pub fn as_bytes(&mut self) -> &mut [u8] {
        let n = self.capacity * element_size(self.ty);
        // SAFETY: the buffer holds `capacity` elements of `element_size(ty)` bytes, in CPU memory.
        unsafe { std::slice::from_raw_parts_mut(self.tensor.data_ptr_mut().cast::<u8>(), n) }
    }

    /// The buffer's data as `T` (CPU buffers only).
    pub fn as_slice<T>(&mut self) -> &mut [T] {
        debug_assert_eq!(std::mem::size_of::<T>(), element_size(self.ty));
        // SAFETY: the buffer holds `capacity` elements of the size of `T`, in CPU memory.
        unsafe {
            std::slice::from_raw_parts_mut(self.tensor.data_ptr_mut().cast::<T>(), self.capacity)
        }
    }
}

/// An ONNX Runtime status as a result (releasing it).
fn status_result(status: ort::sys::OrtStatusPtr) -> ort::Result<()> {
    if status.0.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null status is a valid OrtStatus, released once here.
    let msg = unsafe {
        let m = std::ffi::CStr::from_ptr((ort::api().GetErrorMessage)(status.0))
            .to_string_lossy()
            .into_owned();
        (ort::api().ReleaseStatus)(status.0);
        m
    };
    Err(ort::Error::new(msg))
}

/// Where memory lives, as ONNX Runtime names it: device `Cpu` or `Cuda`, and its index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// ONNX Runtime's device name (`Cpu`, `Cuda`, …).
    pub device: String,
    /// The device's index.
    pub id: i32,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.device, self.id)
    }
}

/// Where the session wants each of its inputs (ONNX Runtime's own answer: the memory of the
/// execution provider whose kernel reads it), by input name.
///
/// # Errors
///
/// ONNX Runtime's.
pub(crate) fn input_placements(session: &Session) -> ort::Result<Vec<(String, Placement)>> {
    let names: Vec<String> = session
        .inputs()
        .iter()
        .map(|i| i.name().to_string())
        .collect();
    let mut infos: Vec<*const ort::sys::OrtMemoryInfo> = vec![std::ptr::null(); names.len()];
    // SAFETY: the session is valid; `infos` has room for one pointer per input; the returned
    // memory infos belong to the session and are only read here.
    let status = unsafe {
        (ort::api().SessionGetMemoryInfoForInputs)(session.ptr(), infos.as_mut_ptr(), infos.len())
    };
    status_result(status)?;
    let mut out = Vec::with_capacity(names.len());
    for (name, info) in names.into_iter().zip(infos) {
        if info.is_null() {
            return Err(ort::Error::new(format!(
                "no memory info for input `{name}`"
            )));
        }
        let mut dev: *const std::ffi::c_char = std::ptr::null();
        let mut id: std::ffi::c_int = 0;
        // SAFETY: `info` is a valid memory info of the session; the name it gives is a C string
        // owned by it.
        let device = unsafe {
            status_result((ort::api().MemoryInfoGetName)(info, &mut dev))?;
            status_result((ort::api().MemoryInfoGetId)(info, &mut id))?;
            std::ffi::CStr::from_ptr(dev).to_string_lossy().into_owned()
        };
        out.push((name, Placement { device, id }));
    }
    Ok(out)
}

/// The placement the session wants for input `name` (host memory when it does not say).
pub(crate) fn placement_of(wanted: &[(String, Placement)], name: &str) -> Placement {
    wanted
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, p)| p.clone())
        .unwrap_or(Placement {
            device: "Cpu".into(),
            id: 0,
        })
}

/// An allocator of `session` for memory at `p` (the default host allocator for the CPU).
///
/// # Errors
///
/// A device ONNX Runtime has no allocator for here.
pub(crate) fn allocator_at(session: &Session, p: &Placement) -> ort::Result<Allocator> {
    let device = match p.device.as_str() {
        "Cpu" => return Ok(Allocator::default()),
        "Cuda" => AllocationDevice::CUDA,
        other => AllocationDevice::new(other),
    };
    Allocator::new(
        session,
        MemoryInfo::new(device, p.id, AllocatorType::Device, MemoryType::Default)?,
    )
}

/// KV buffers (`K, V` per layer, for `layers` layers, set after set) against where the session
/// wants each: `(input name, where the buffer is, where the session reads it)`.
pub(crate) fn kv_placements<'a>(
    bufs: impl IntoIterator<Item = &'a Buffer>,
    layers: usize,
    wanted: &[(String, Placement)],
) -> Vec<(String, Placement, Placement)> {
    bufs.into_iter()
        .enumerate()
        .map(|(k, b)| {
            let kv = if k % 2 == 0 { "key" } else { "value" };
            let name = format!("past_key_values.{}.{kv}", (k / 2) % layers.max(1));
            let want = placement_of(wanted, &name);
            (name, b.placement(), want)
        })
        .collect()
}

/// Ping-pong KV cache buffers: per layer a K and a V buffer in each of two sets.
pub(crate) struct PingPong {
    pub sets: [Vec<Buffer>; 2],
}

impl PingPong {
    /// Binds a view of `rows` rows of set `from` as every layer's `past_key_values.*` and a view
    /// of `rows + 1` rows of the other set as its `present.*`: the graph reads one buffer and
    /// writes the other, with no copy by us and no allocation of cache memory.
    pub fn bind(
        &mut self,
        binding: &mut ort::session::IoBinding,
        alloc: &Allocator,
        from: usize,
        heads: i64,
        rows: i64,
        head_dim: i64,
    ) -> ort::Result<()> {
        self.bind_batch(binding, alloc, from, 1, heads, rows, head_dim)
    }

    /// As [`bind`](Self::bind) for `batch` rows, each laid out compactly after the other: a
    /// view of fewer rows than the last present is that present's first rows.
    #[allow(clippy::too_many_arguments)]
    pub fn bind_batch(
        &mut self,
        binding: &mut ort::session::IoBinding,
        alloc: &Allocator,
        from: usize,
        batch: i64,
        heads: i64,
        rows: i64,
        head_dim: i64,
    ) -> ort::Result<()> {
        self.bind_growing(binding, alloc, from, batch, heads, rows, 1, head_dim)
    }

    /// As [`bind_batch`](Self::bind_batch) for a call that appends `added` rows (a prefill
    /// chunk): the present views are `rows + added` long.
    #[allow(clippy::too_many_arguments)]
    pub fn bind_growing(
        &mut self,
        binding: &mut ort::session::IoBinding,
        alloc: &Allocator,
        from: usize,
        batch: i64,
        heads: i64,
        rows: i64,
        added: i64,
        head_dim: i64,
    ) -> ort::Result<()> {
        let (a, b) = self.sets.split_at_mut(1);
        let (src, dst) = if from == 0 {
            (&mut a[0], &mut b[0])
        } else {
            (&mut b[0], &mut a[0])
        };
        for (i, (s, d)) in src.chunks_mut(2).zip(dst.chunks_mut(2)).enumerate() {
            for (j, kv) in ["key", "value"].iter().enumerate() {
                let past = s[j].view(alloc, &[batch, heads, rows, head_dim])?;
                let present = d[j].view(alloc, &[batch, heads, rows + added, head_dim])?;
                binding.bind_input(format!("past_key_values.{i}.{kv}"), &past)?;
                binding.bind_output(format!("present.{i}.{kv}"), present)?;
            }
        }
        Ok(())
    }
}

/// Reads a float tensor (f32 or f16) into `out` as f32.
pub(crate) fn read_floats(buf: &mut Buffer, n: usize, out: &mut Vec<f32>) {
    out.clear();
    match buf.ty {
        TensorElementType::Float16 => {
            out.extend(buf.as_slice::<half::f16>()[..n].iter().map(|v| v.to_f32()))
        }
        _ => out.extend_from_slice(&buf.as_slice::<f32>()[..n]),
    }
}

/// Reads row `row` of `n` floats (f32 or f16) of a buffer into `out` as f32.
pub(crate) fn read_row(buf: &mut Buffer, row: usize, n: usize, out: &mut Vec<f32>) {
    out.clear();
    let r = row * n..(row + 1) * n;
    match buf.ty {
        TensorElementType::Float16 => {
            out.extend(buf.as_slice::<half::f16>()[r].iter().map(|v| v.to_f32()))
        }
        _ => out.extend_from_slice(&buf.as_slice::<f32>()[r]),
    }
}

/// Writes f32 values as row `row` (rows of `values.len()`) of a float buffer (f32 or f16).
pub(crate) fn write_row(buf: &mut Buffer, row: usize, values: &[f32]) {
    let at = row * values.len();
    match buf.ty {
        TensorElementType::Float16 => {
            let dst = &mut buf.as_slice::<half::f16>()[at..at + values.len()];
            for (d, &s) in dst.iter_mut().zip(values) {
                *d = half::f16::from_f32(s);
            }
        }
        _ => buf.as_slice::<f32>()[at..at + values.len()].copy_from_slice(values),
    }
}
