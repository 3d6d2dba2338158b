//! Safetensors checkpoints read the way a fine-tune needs them: the header (an 8-byte
//! little-endian length, then JSON) parsed here, the data memory-mapped, and each tensor made on
//! its own when asked for, so a load holds one tensor at a time in host memory, never the file.
//! A checkpoint is one file, a sharded one's `*.safetensors.index.json`, or a Hugging Face model
//! directory; PyTorch pickles are refused, since loading one runs whatever code it holds.
use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::{Kind, Tensor};

use crate::exit::UsageError;

/// One tensor of a checkpoint, as its header describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub name: String,
    pub kind: Kind,
    pub shape: Vec<i64>,
    shard: usize,
    begin: usize,
    end: usize,
}

/// A checkpoint's tensors (names, types and shapes) and where their bytes are; the bytes are
/// mapped only by `Checkpoint::map`.
pub struct Checkpoint {
    /// What the user named, for messages.
    pub shown: String,
    pub entries: Vec<Entry>,
    /// A Hugging Face model directory's `config.json`.
    pub config: Option<PathBuf>,
    shards: Vec<Shard>,
}

struct Shard {
    path: PathBuf,
    /// Where the data starts: past the 8-byte length and the header.
    data_start: usize,
    map: Option<Map>,
}

impl Checkpoint {
    /// The headers of the checkpoint at `path`; no tensor data is read.
    pub fn headers(path: &Path) -> Result<Checkpoint> {
        let shown = path.display().to_string();
        let (files, config) = files_of(path)?;
        let mut shards = vec![];
        let mut entries = vec![];
        for (i, f) in files.iter().enumerate() {
            let (data_start, mut e) = header(f, i)?;
            entries.append(&mut e);
            shards.push(Shard {
                path: f.clone(),
                data_start,
                map: None,
            });
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = entries.iter().find(|e| !seen.insert(e.name.clone())) {
            bail!("{shown}: the tensor {} is in more than one shard", dup.name);
        }
        // File order: each shard's pages are read once, front to back.
        entries.sort_by_key(|e| (e.shard, e.begin));
        Ok(Checkpoint {
            shown,
            entries,
            config,
            shards,
        })
    }

    /// Maps every shard for reading tensors.
    pub fn map(&mut self) -> Result<()> {
        for s in &mut self.shards {
            if s.map.is_none() {
                s.map = Some(Map::open(&s.path)?);
            }
        }
        Ok(())
    }

    /// The entries by name, to look them up as a plan names them.
    pub fn by_name(&self) -> std::collections::HashMap<&str, &Entry> {
        self.entries.iter().map(|e| (e.name.as_str(), e)).collect()
    }

    /// The entry's values in the checkpoint's type, made in `staging`'s buffer (valid until the
    /// buffer's next use, as the borrow says); the pages they were read from are released from
    /// this process (the page cache keeps them).
    pub fn tensor<'s>(&self, e: &Entry, staging: &'s mut Staging) -> Result<Staged<'s>> {
        let shard = &self.shards[e.shard];
        let map = shard.map.as_ref().context("the checkpoint is not mapped")?;
        let (from, to) = (shard.data_start + e.begin, shard.data_start + e.end);
        let bytes = &map.bytes()[from..to];
        if bytes.len() > staging.bytes {
            bail!(
                "{}: the tensor {} is larger than the staging buffer",
                self.shown,
                e.name
            );
        }
        let ptr = staging.buf.data_ptr() as *mut u8;
        // SAFETY: the buffer holds `staging.bytes` ≥ bytes.len() bytes, aligned as libtorch
        // aligns every allocation, and is borrowed mutably for as long as the view lives.
        let t = unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len());
            Tensor::f_from_blob(ptr, &e.shape, &[], e.kind, tch::Device::Cpu)?
        };
        map.release(from, to);
        Ok(Staged {
            t,
            _buffer: std::marker::PhantomData,
        })
    }

    /// The bytes of the largest tensor.
    pub fn largest_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.end - e.begin).max().unwrap_or(0)
    }
}

/// One host buffer the size of the checkpoint's largest tensor, in which each tensor is made in
/// turn: a load's host memory is this buffer, whatever the allocator keeps of freed blocks (a
/// fresh allocation per tensor left glibc holding four 4 MiB blocks of a checkpoint of them).
pub struct Staging {
    buf: Tensor,
    bytes: usize,
}

impl Staging {
    pub fn new(bytes: usize) -> Result<Staging> {
        let buf = Tensor::f_empty([bytes.max(1) as i64], (Kind::Uint8, tch::Device::Cpu))?;
        Ok(Staging { buf, bytes })
    }
}

/// A tensor made in a staging buffer, usable while the buffer is borrowed.
pub struct Staged<'s> {
    t: Tensor,
    _buffer: std::marker::PhantomData<&'s mut Staging>,
}

impl std::ops::Deref for Staged<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        &self.t
    }
}

/// The safetensors files of `path` and the `config.json` beside them (a model directory's).
fn files_of(path: &Path) -> Result<(Vec<PathBuf>, Option<PathBuf>)> {
    if path.is_dir() {
        let config = Some(path.join("config.json")).filter(|c| c.is_file());
        let index = path.join("model.safetensors.index.json");
        let single = path.join("model.safetensors");
        if index.is_file() {
            return Ok((index_files(&index)?, config));
        }
        if single.is_file() {
            return Ok((vec![single], config));
        }
        for pickle in [
            "pytorch_model.bin",
            "model.pth",
            "model.pt",
            "pytorch_model.bin.index.json",
        ] {
            if path.join(pickle).is_file() {
                return Err(pickle_refused(&path.join(pickle)).into());
            }
        }
        // A memtrain run directory: its weights are in its checkpoints.
        let run = match path.join("checkpoints").is_dir() {
            true => format!(
                "; it is a run directory: name one of its checkpoints, {}/checkpoints/step-N/model.safetensors (checkpoints/best.json names the best)",
                path.display()
            ),
            false => String::new(),
        };
        return Err(UsageError(format!(
            "model.init_from: the directory {} holds neither model.safetensors nor model.safetensors.index.json{run}",
            path.display()
        ))
        .into());
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    if name.ends_with(".json") {
        return Ok((index_files(path)?, None));
    }
    if is_pickle(&name) {
        return Err(pickle_refused(path).into());
    }
    Ok((vec![path.to_path_buf()], None))
}

/// `.pth`, `.pt`, `.bin`, `.ckpt` and `.pkl` files; others are told by their header (`header`).
fn is_pickle(name: &str) -> bool {
    const PICKLES: [&str; 5] = [".pth", ".pt", ".bin", ".ckpt", ".pkl"];
    PICKLES.iter().any(|s| name.ends_with(s))
}

/// Whether a file whose header does not read starts as `torch.save` writes: a zip archive, or a
/// pickle's protocol opcode.
fn looks_pickled(path: &Path) -> bool {
    let mut head = [0u8; 2];
    let read = fs::File::open(path).and_then(|mut f| f.read_exact(&mut head));
    read.is_ok() && (head == *b"PK" || (head[0] == 0x80 && (2..=5).contains(&head[1])))
}

/// The refusal of a pickle, with the one line that converts it, run from the current
/// directory (the paths as given). transformers' `pytorch_model.bin` (or its shards) becomes the
/// directory's `model.safetensors`, so the directory, `config.json` and all, is what init_from
/// names. Every tensor is cloned: `save_file` refuses tensors that share memory (a tied
/// embedding and head).
pub fn pickle_refused(path: &Path) -> UsageError {
    let quoted = |p: &Path| format!("'{}'", p.display().to_string().replace('\'', "\\'"));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    let out = match name.starts_with("pytorch_model.bin") {
        true => dir.unwrap_or(Path::new("")).join("model.safetensors"),
        false => path.with_extension("safetensors"),
    };
    let load = match name.ends_with(".json") {
        // A sharded pickle: every shard its index names, into one file.
        true => format!(
            "import json; d = {}; sd = {{}}; [sd.update(torch.load(f'{{d}}/{{f}}', map_location='cpu', weights_only=True)) for f in sorted(set(json.load(open({}))['weight_map'].values()))]",
            quoted(dir.unwrap_or(Path::new("."))),
            quoted(path)
        ),
        false => format!("sd = torch.load({}, map_location='cpu', weights_only=True)", quoted(path)),
    };
    let target = match (out.file_name().is_some_and(|n| n == "model.safetensors"), dir) {
        (true, Some(d)) => format!("the directory {}", d.display()),
        _ => out.display().to_string(),
    };
    UsageError(format!(
        "model.init_from: {} is a PyTorch pickle, which memtrain does not load: loading a pickle can run any code it holds. Convert it once to safetensors (the `safetensors` package), then point init_from at {target}:\n  python -c \"import torch; from safetensors.torch import save_file; {load}; save_file({{k: v.contiguous().clone() for k, v in sd.items()}}, {})\"",
        path.display(),
        quoted(&out)
    ))
}

/// The shard files a `*.safetensors.index.json` names in its `weight_map`, in order of first
/// mention, each relative to the index's directory.
fn index_files(index: &Path) -> Result<Vec<PathBuf>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text =
        fs::read_to_string(index).with_context(|| format!("model.init_from: cannot read {}", index.display()))?;
    let parsed: Index = serde_json::from_str(&text).map_err(|e| {
        UsageError(format!(
            "model.init_from: {} is not a sharded checkpoint's index (a JSON object with a weight_map of tensor name to file): {e}",
            index.display()
        ))
    })?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = vec![];
    for f in parsed.weight_map.values() {
        let p = dir.join(f);
        if !files.contains(&p) {
            files.push(p);
        }
    }
    if let Some(gone) = files.iter().find(|f| !f.is_file()) {
        return Err(UsageError(format!(
            "model.init_from: {} names the shard {}, which does not exist",
            index.display(),
            gone.display()
        ))
        .into());
    }
    Ok(files)
}

/// Reads one file's header: where its data starts, and its entries. A pickle under another
/// name is refused as one.
fn header(path: &Path, shard: usize) -> Result<(usize, Vec<Entry>)> {
    match header_of(path, shard) {
        Err(_) if looks_pickled(path) => Err(pickle_refused(path).into()),
        read => read,
    }
}

fn header_of(path: &Path, shard: usize) -> Result<(usize, Vec<Entry>)> {
    const NOT: &str = " (not a safetensors file: its header does not read)";
    const CUT: &str = " (the file is cut short or damaged: its tensors do not fit the bytes it holds)";
    let bad = |why: String| {
        UsageError(format!(
            "model.init_from: cannot read {} as safetensors: {why}",
            path.display()
        ))
    };
    let mut f = fs::File::open(path).with_context(|| format!("model.init_from: cannot open {}", path.display()))?;
    let size = f.metadata()?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| bad(format!("it is shorter than a header{NOT}")))?;
    let n = u64::from_le_bytes(len);
    if n > size.saturating_sub(8) || n > 100 << 20 {
        return Err(bad(format!(
            "its header length ({n} bytes) does not fit the file ({size} bytes){NOT}"
        ))
        .into());
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text).map_err(|e| bad(e.to_string()))?;
    let json: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&text).map_err(|e| bad(format!("its header is not a JSON object: {e}{NOT}")))?;
    let data_start = 8 + n as usize;
    let data_len = (size - 8 - n) as usize;
    let mut entries = vec![];
    for (name, v) in json {
        if name == "__metadata__" {
            continue;
        }
        let e = entry(&name, &v, shard).map_err(|why| bad(format!("tensor {name}: {why}")))?;
        if e.end > data_len {
            return Err(bad(format!("tensor {name} ends past the end of the file{CUT}")).into());
        }
        entries.push(e);
    }
    Ok((data_start, entries))
}

fn entry(name: &str, v: &serde_json::Value, shard: usize) -> Result<Entry, String> {
    let dtype = v["dtype"].as_str().ok_or("no dtype")?;
    let kind = kind_of(dtype).ok_or_else(|| format!("the type {dtype} is not one memtrain reads"))?;
    let shape: Vec<i64> = v["shape"]
        .as_array()
        .ok_or("no shape")?
        .iter()
        .map(|d| d.as_i64().filter(|&d| d >= 0))
        .collect::<Option<_>>()
        .ok_or("a shape that is not a list of sizes")?;
    let offsets: Vec<usize> = v["data_offsets"]
        .as_array()
        .and_then(|a| a.iter().map(|o| o.as_u64().map(|o| o as usize)).collect())
        .filter(|o: &Vec<usize>| o.len() == 2 && o[0] <= o[1])
        .ok_or("no data_offsets [begin, end]")?;
    let bytes = shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes();
    if offsets[1] - offsets[0] != bytes {
        return Err(format!(
            "its shape {shape:?} of {dtype} is {bytes} bytes, but its offsets hold {}",
            offsets[1] - offsets[0]
        ));
    }
    Ok(Entry {
        name: name.to_owned(),
        kind,
        shape,
        shard,
        begin: offsets[0],
        end: offsets[1],
    })
}

fn kind_of(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "F64" => Kind::Double,
        "F32" => Kind::Float,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        "I64" => Kind::Int64,
        "I32" => Kind::Int,
        "I16" => Kind::Int16,
        "I8" => Kind::Int8,
        "U8" => Kind::Uint8,
        "BOOL" => Kind::Bool,
        _ => return None,
    })
}

/// A file mapped read-only.
struct Map {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Map {
    fn open(path: &Path) -> Result<Map> {
        use std::os::fd::AsRawFd;
        let f = fs::File::open(path).with_context(|| format!("model.init_from: cannot open {}", path.display()))?;
        let len = f.metadata()?.len() as usize;
        // SAFETY: a fresh read-only private mapping of a file we opened; checked for failure.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            bail!(
                "model.init_from: cannot map {} ({})",
                path.display(),
                std::io::Error::last_os_error()
            );
        }
        Ok(Map { ptr, len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: ptr maps len readable bytes until drop.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// Drops the whole pages of `from..to` from this process's resident set, so reading a
    /// large checkpoint does not grow it by the file.
    fn release(&self, from: usize, to: usize) {
        // SAFETY: sysconf has no preconditions.
        let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(1) as usize;
        let start = from.div_ceil(page) * page;
        let end = to / page * page;
        if end > start {
            // SAFETY: a range inside our read-only shared mapping; the pages read back from the
            // file if touched again.
            unsafe {
                libc::madvise(
                    (self.ptr as *mut u8).add(start) as *mut libc::c_void,
                    end - start,
                    libc::MADV_DONTNEED,
                )
            };
        }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what open mapped.
        unsafe { libc::munmap(self.ptr, self.len.max(1)) };
    }
}

#[cfg(test)]
mod tests;
