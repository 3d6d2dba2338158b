//! Where a set's samples live: a tensor in memory, or a read-only memory map of the file that
//! holds them (the imagefolder cache, an uncompressed npz or a safetensors file). A mapped set
//! costs no anonymous memory: the kernel's page cache holds what fits and reads the rest again
//! when a batch touches it.
use std::fs;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tch::{Kind, Tensor};

/// A file mapped read-only, whole.
pub struct Map {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only and lives until the last Arc drops; reads need no locking.
unsafe impl Send for Map {}
unsafe impl Sync for Map {}

impl Map {
    pub fn open(path: &Path) -> Result<Map> {
        use std::os::fd::AsRawFd;
        let f = fs::File::open(path).with_context(|| format!("{}: cannot open it", path.display()))?;
        let len = f.metadata()?.len() as usize;
        if len == 0 {
            return Ok(Map {
                ptr: std::ptr::null(),
                len: 0,
            });
        }
        // SAFETY: a fresh read-only shared mapping of a file we opened; checked for failure.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            bail!(
                "{}: cannot map it into memory ({})",
                path.display(),
                std::io::Error::last_os_error()
            );
        }
        Ok(Map {
            ptr: ptr as *const u8,
            len,
        })
    }

    pub fn bytes(&self) -> &[u8] {
        match self.len {
            0 => &[],
            // SAFETY: ptr maps len readable bytes until drop.
            n => unsafe { std::slice::from_raw_parts(self.ptr, n) },
        }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: unmapping exactly what open mapped.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }
}

/// The element types a store holds and a batch converts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    U8,
    I8,
    I16,
    I32,
    I64,
    F32,
    /// Token ids of a flat token file (no tensor kind of their own: batches read them as int64).
    U16,
    U32,
}

impl Elem {
    pub fn of(k: Kind) -> Option<Elem> {
        Some(match k {
            Kind::Uint8 => Elem::U8,
            Kind::Int8 => Elem::I8,
            Kind::Int16 => Elem::I16,
            Kind::Int => Elem::I32,
            Kind::Int64 => Elem::I64,
            Kind::Float => Elem::F32,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            Elem::U8 | Elem::I8 => 1,
            Elem::I16 | Elem::U16 => 2,
            Elem::I32 | Elem::F32 | Elem::U32 => 4,
            Elem::I64 => 8,
        }
    }

    pub fn is_integer(self) -> bool {
        self != Elem::F32
    }

    /// Little-endian values of this type in `b`, as float32 (the same rounding as
    /// `Tensor::to_kind(Float)`: to nearest).
    pub fn to_f32(self, b: &[u8], out: &mut [f32]) {
        match self {
            Elem::U8 => out.iter_mut().zip(b).for_each(|(o, &v)| *o = v as f32),
            Elem::I8 => out.iter_mut().zip(b).for_each(|(o, &v)| *o = v as i8 as f32),
            Elem::I16 => convert(b, out, |c: [u8; 2]| i16::from_le_bytes(c) as f32),
            Elem::I32 => convert(b, out, |c: [u8; 4]| i32::from_le_bytes(c) as f32),
            Elem::I64 => convert(b, out, |c: [u8; 8]| i64::from_le_bytes(c) as f32),
            Elem::F32 => convert(b, out, f32::from_le_bytes),
            Elem::U16 => convert(b, out, |c: [u8; 2]| u16::from_le_bytes(c) as f32),
            Elem::U32 => convert(b, out, |c: [u8; 4]| u32::from_le_bytes(c) as f32),
        }
    }

    /// Little-endian integers of this type in `b`, as int64 (token ids); float32 is truncated.
    pub fn to_i64(self, b: &[u8], out: &mut [i64]) {
        match self {
            Elem::U8 => out.iter_mut().zip(b).for_each(|(o, &v)| *o = v as i64),
            Elem::I8 => out.iter_mut().zip(b).for_each(|(o, &v)| *o = v as i8 as i64),
            Elem::I16 => convert(b, out, |c: [u8; 2]| i16::from_le_bytes(c) as i64),
            Elem::U16 => convert(b, out, |c: [u8; 2]| u16::from_le_bytes(c) as i64),
            Elem::I32 => convert(b, out, |c: [u8; 4]| i32::from_le_bytes(c) as i64),
            Elem::U32 => convert(b, out, |c: [u8; 4]| u32::from_le_bytes(c) as i64),
            Elem::I64 => convert(b, out, i64::from_le_bytes),
            Elem::F32 => convert(b, out, |c: [u8; 4]| f32::from_le_bytes(c) as i64),
        }
    }
}

fn convert<const N: usize, T>(b: &[u8], out: &mut [T], f: impl Fn([u8; N]) -> T) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(N)) {
        *o = f(c.try_into().expect("chunks of N bytes"));
    }
}

enum Bytes {
    /// A contiguous CPU tensor; kept so its storage outlives the pointer.
    Memory {
        _t: Tensor,
        ptr: *const u8,
        len: usize,
    },
    Mapped {
        map: Arc<Map>,
        offset: usize,
        len: usize,
    },
}

/// Samples `[N, ..]` of one element type, contiguous, row after row.
pub struct Store {
    bytes: Bytes,
    pub elem: Elem,
    pub shape: Vec<i64>,
}

// SAFETY: the bytes are never written after the store is made (the tensor is private to it).
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = match self.bytes {
            Bytes::Memory { .. } => "memory",
            Bytes::Mapped { .. } => "mapped",
        };
        write!(f, "Store({how}, {:?}, {:?})", self.elem, self.shape)
    }
}

impl Store {
    /// `t` (a CPU tensor of a store's element type) as a store; None for other kinds.
    pub fn memory(t: Tensor) -> Option<Store> {
        let elem = Elem::of(t.kind())?;
        let t = t.contiguous();
        let len = t.numel() * elem.size();
        let bytes = Bytes::Memory {
            ptr: t.data_ptr() as *const u8,
            len,
            _t: t.shallow_clone(),
        };
        Some(Store::from_bytes(bytes, elem, t.size()))
    }

    /// `len` bytes at `offset` of a mapped file, holding samples of `shape`.
    pub fn mapped(map: Arc<Map>, offset: usize, elem: Elem, shape: Vec<i64>) -> Result<Store> {
        let Some(len) = span(&shape, elem.size()) else {
            bail!("the file's header gives an impossible shape {shape:?}");
        };
        let end = offset.saturating_add(len);
        if end > map.bytes().len() {
            bail!(
                "the file is shorter than its header says ({} bytes, the samples end at {end})",
                map.bytes().len(),
            );
        }
        Ok(Store::from_bytes(Bytes::Mapped { map, offset, len }, elem, shape))
    }

    fn from_bytes(bytes: Bytes, elem: Elem, shape: Vec<i64>) -> Store {
        Store { bytes, elem, shape }
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self.bytes, Bytes::Mapped { .. })
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Memory { len: 0, .. } => &[],
            // SAFETY: the tensor keeps ptr..ptr+len alive and unchanged.
            Bytes::Memory { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
            Bytes::Mapped { map, offset, len } => &map.bytes()[*offset..*offset + *len],
        }
    }

    /// Bytes the samples take.
    pub fn len_bytes(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// Values in one sample.
    pub fn sample_values(&self) -> usize {
        self.shape[1..].iter().product::<i64>() as usize
    }

    /// The bytes of sample `r`.
    pub fn row(&self, r: i64) -> &[u8] {
        let n = self.sample_values() * self.elem.size();
        &self.bytes()[r as usize * n..(r as usize + 1) * n]
    }

    /// The same bytes seen as samples of another shape with as many values.
    pub fn reshaped(self, shape: Vec<i64>) -> Store {
        debug_assert_eq!(shape.iter().product::<i64>(), self.shape.iter().product::<i64>());
        Store { shape, ..self }
    }

    /// A flat store `[T]` as windows `[T / w, w]` of its first values (a shorter tail left out).
    pub fn windows(self, w: i64) -> Store {
        let n = self.shape[0] / w.max(1);
        let len = (n * w) as usize * self.elem.size();
        let bytes = match self.bytes {
            Bytes::Mapped { map, offset, .. } => Bytes::Mapped { map, offset, len },
            Bytes::Memory { _t, ptr, .. } => Bytes::Memory { _t, ptr, len },
        };
        Store {
            bytes,
            elem: self.elem,
            shape: vec![n, w],
        }
    }

    /// The whole store as a tensor in memory (a copy when mapped).
    pub fn tensor(&self) -> Tensor {
        match &self.bytes {
            Bytes::Memory { _t, .. } => {
                let numel = self.shape.iter().product::<i64>();
                _t.flatten(0, -1).narrow(0, 0, numel).view(self.shape.as_slice())
            }
            Bytes::Mapped { .. } => {
                let kind = match self.elem {
                    Elem::U8 => Kind::Uint8,
                    Elem::I8 => Kind::Int8,
                    Elem::I16 => Kind::Int16,
                    Elem::I32 => Kind::Int,
                    Elem::I64 => Kind::Int64,
                    Elem::F32 => Kind::Float,
                    // Token ids: int64, as batches give them.
                    Elem::U16 | Elem::U32 => {
                        let mut v = vec![0i64; self.bytes().len() / self.elem.size()];
                        self.elem.to_i64(self.bytes(), &mut v);
                        return Tensor::from_slice(&v).view(self.shape.as_slice());
                    }
                };
                Tensor::from_data_size(self.bytes(), &self.shape, kind)
            }
        }
    }
}

/// Bytes of `shape` at `elt` bytes an element; None for a negative dimension or a size that
/// does not fit (a header that lies).
pub fn span(shape: &[i64], elt: usize) -> Option<usize> {
    shape
        .iter()
        .try_fold(elt, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
}
