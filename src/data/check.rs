//! The checks every set passes before training: its samples and labels against the model
//! (shapes, dtypes, class indices, finite values), and what is read whole against the host's
//! memory. Errors name the file, both shapes and what to change.
use std::path::Path;

use anyhow::{anyhow, bail, Result};
use tch::{Kind, Tensor};

use super::dataset::Dataset;
use super::gather::Targets;
use super::mapped;
use super::store::{Map, Store};
use crate::human::human_bytes;
use crate::spec::schema::{Data, DataSource};

pub(super) fn required_path(data: &Data) -> Result<&Path> {
    data.path
        .as_deref()
        .ok_or_else(|| anyhow!("data.path is required for this data.source"))
}

/// The config keys that set the model's input shape and class count, for error messages.
pub(super) struct ModelKeys<'a> {
    input_shape: &'a [i64],
    num_classes: i64,
}

impl<'a> ModelKeys<'a> {
    pub(super) fn new(input_shape: &'a [i64], num_classes: i64) -> Self {
        ModelKeys {
            input_shape,
            num_classes,
        }
    }

    /// What expects the input, e.g. "model.mlp.inputs".
    fn input_key(&self) -> &'static str {
        match self.input_shape.len() {
            1 => "model.mlp.inputs",
            2 => "model.darts (in_channels, input_length)",
            _ => "the model",
        }
    }

    /// What to set so that the model takes samples of shape `sample`.
    fn input_fix(&self, sample: &[i64]) -> String {
        let numel: i64 = sample.iter().product();
        match self.input_shape.len() {
            1 => format!("set model.mlp.inputs = {numel}"),
            2 => {
                let (c, l) = match sample {
                    [] => (1, 1),
                    [l] => (1, *l),
                    [c, ..] => (*c, numel / c.max(&1)),
                };
                format!("set model.darts.in_channels = {c} and model.darts.input_length = {l}")
            }
            // An image model given samples without a channel axis (a grayscale set saved [N, H, W]).
            3 if sample.len() == 2 => format!(
                "the model takes images [channels, height, width]: save x with a channel axis, as [N, 1, {}, {}] \
                 (a TorchScript model takes what model.torchscript.input_shape says)",
                sample[0], sample[1]
            ),
            _ => format!("give the model an input of {numel} values"),
        }
    }

    fn classes_key(&self) -> &'static str {
        match self.input_shape.len() {
            1 => "model.mlp.num_classes",
            2 => "model.darts.num_classes",
            _ => "the model's num_classes",
        }
    }
}

/// `x` from a file described by `what` ("data.path foo.npz") as a store: integer samples as
/// stored (every integer is finite, and each batch converts exactly as the whole set would),
/// float samples as float32, where the finite check must see what the model will.
pub(super) fn stored(x: Tensor, what: &str) -> Result<Store> {
    if x.size().is_empty() {
        bail!("{what}: x is a scalar; it must be an array of samples, shape [N, ..]");
    }
    if !is_real_number(x.kind()) {
        bail!(
            "{what}: x has dtype {}; it must be a float or integer array",
            dtype(x.kind())
        );
    }
    let x = match is_integer(x.kind()) {
        true => x,
        false => x.to_kind(Kind::Float),
    };
    Ok(Store::memory(x).expect("a stored element type"))
}

/// Checks samples `x` (in memory or mapped) and labels `y` against the model.
pub(super) fn checked_store(x: Store, y: Tensor, what: &str, model: &ModelKeys) -> Result<Dataset> {
    let xs = x.shape.clone();
    let ys = y.size();
    if !is_integer(y.kind()) {
        bail!(
            "{what}: y has dtype {}; it must hold integer class indices (e.g. y.astype(numpy.int64))",
            dtype(y.kind())
        );
    }
    if ys.len() != 1 {
        let hint = if ys.len() == 2 && ys[1] > 1 {
            " (one-hot labels? use y.argmax(1))"
        } else {
            ""
        };
        bail!("{what}: y has shape {ys:?}; it must be 1-D, one class index per sample{hint}");
    }
    let n = xs[0];
    if ys[0] != n {
        bail!(
            "{what}: x has {n} samples (shape {xs:?}) but y has {} labels; they must have the same length",
            ys[0]
        );
    }
    if n == 0 {
        bail!("{what}: has no samples (x has shape {xs:?})");
    }
    let sample = &xs[1..];
    let want = model.input_shape;
    let x = if sample == want {
        x
    } else {
        let numel: i64 = sample.iter().product();
        let want_numel: i64 = want.iter().product();
        if numel != want_numel {
            bail!(
                "{what}: x has samples of shape {sample:?} ({numel} values) but {} expects {want:?} ({want_numel} values); {}",
                model.input_key(),
                model.input_fix(sample)
            );
        }
        let mut shape = vec![n];
        shape.extend_from_slice(want);
        x.reshaped(shape)
    };
    // A mapped file is checked as batches read it: a scan here would read the whole file
    // before the first step, however large.
    let finite = x.elem.is_integer()
        || x.is_mapped()
        || x.bytes()
            .chunks_exact(4)
            .all(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")).is_finite());
    if !finite {
        bail!("{what}: x contains NaN or infinite values");
    }
    let unchecked = (!x.elem.is_integer() && x.is_mapped()).then(|| what.into());
    let y = y.to_kind(Kind::Int64);
    let (lo, hi) = (y.min().int64_value(&[]), y.max().int64_value(&[]));
    let k = model.num_classes;
    if lo < 0 {
        bail!("{what}: y has a negative label ({lo}); labels must be class indices in 0..{k}");
    }
    if hi >= k {
        bail!(
            "{what}: y has labels up to {hi} but the model has num_classes = {k} (labels must lie in 0..{k}); set {} = {}",
            model.classes_key(),
            hi + 1
        );
    }
    let labels = Vec::<i64>::try_from(&y.contiguous()).expect("int64 labels");
    let mut d = Dataset::of(x, labels);
    d.recipe().unchecked = unchecked;
    Ok(d)
}

/// Checks token windows `x` (in memory or mapped) and their `targets` against the model: the
/// window length against its input, every id below its vocabulary size. A mapped file is read
/// through once for this, at the page cache's pace, without holding it.
pub(super) fn checked_tokens(x: Store, targets: Targets, what: &str, model: &ModelKeys) -> Result<Dataset> {
    let sample = match targets {
        Targets::Next => vec![x.shape[1] - 1],
        _ => x.shape[1..].to_vec(),
    };
    let want = model.input_shape;
    if sample != want {
        bail!(
            "{what}: windows of {sample:?} tokens (data.seq_len) but the model takes inputs of shape {want:?}; set data.seq_len to the model's context length"
        );
    }
    let k = model.num_classes;
    if let Some((at, id)) = first_outside(&x, k, false) {
        bail!(
            "{what}: the token at position {at} (counting from 0) has id {id}, outside the model's vocabulary of {k} ids (0..{k}); the data was tokenized for a larger vocabulary: set the model's vocab_size to at least {}",
            id + 1
        );
    }
    if let Targets::Stored(y) = &targets {
        if let Some((at, id)) = first_outside(y, k, true) {
            bail!("{what}: the target at position {at} (counting from 0) is {id}, outside the model's vocabulary of {k} ids (0..{k}, or -100 for no loss)");
        }
    }
    Ok(Dataset::tokens(x, targets))
}

/// The first value of `s` outside `0..k` (or -100 where `ignored` allows it), with its position.
fn first_outside(s: &Store, k: i64, ignored: bool) -> Option<(usize, i64)> {
    // Ids of this type are all below k: nothing to read.
    let max = match s.elem {
        super::store::Elem::U8 => 1 << 8,
        super::store::Elem::U16 => 1 << 16,
        _ => i64::MAX,
    };
    if max <= k {
        return None;
    }
    const CHUNK: usize = 1 << 16;
    let size = s.elem.size();
    let mut v = vec![0i64; CHUNK];
    for (c, b) in s.bytes().chunks(CHUNK * size).enumerate() {
        let v = &mut v[..b.len() / size];
        s.elem.to_i64(b, v);
        let bad = |&id: &i64| !((0..k).contains(&id) || (ignored && id == -100));
        if let Some(i) = v.iter().position(bad) {
            return Some((c * CHUNK + i, v[i]));
        }
    }
    None
}

/// Refuses a file read whole (not mapped) whose arrays would not fit in host memory: a
/// compressed npz by its arrays' inflated sizes, other files by their size.
pub(super) fn check_whole_file(path: &Path, data: &Data, what: &str) -> Result<()> {
    let Ok(map) = Map::open(path) else {
        return Ok(()); // the reader says what is wrong with it
    };
    let b = map.bytes();
    let members = ["x.npy", "y.npy"].map(|n| mapped::zip_member(b, n));
    let compressed = members.iter().flatten().any(|m| m.method != 0);
    let need = match members {
        [Some(x), Some(y)] if data.source == DataSource::Npz => x.size + y.size,
        _ => b.len() as u64,
    };
    let why = match (compressed, data.memory_map) {
        (true, _) => "a compressed .npz (numpy.savez_compressed) is inflated whole into memory",
        (false, false) => "data.memory_map = false reads it whole into memory",
        (false, true) => "it cannot be read in place (its x is not uint8, int8-64 or float32 in C order), so it is read whole into memory",
    };
    let fix = match (compressed, data.memory_map) {
        (true, _) => "save it uncompressed with numpy.savez(path, x=x, y=y), which is read in place through a memory map whatever its size, or use a machine with more memory",
        (false, false) => "set data.memory_map = true to read it in place, or use a machine with more memory",
        (false, true) => "store x as uint8, an integer type or float32, C-ordered, or use a machine with more memory",
    };
    check_memory(need, what, why, fix)
}

/// NumPy's name for a dtype, as users wrote it.
pub(super) fn dtype(k: Kind) -> String {
    match k {
        Kind::Uint8 => "uint8".into(),
        Kind::Int8 => "int8".into(),
        Kind::Int16 => "int16".into(),
        Kind::Int => "int32".into(),
        Kind::Int64 => "int64".into(),
        Kind::Half => "float16".into(),
        Kind::BFloat16 => "bfloat16".into(),
        Kind::Float => "float32".into(),
        Kind::Double => "float64".into(),
        Kind::Bool => "bool".into(),
        Kind::ComplexFloat => "complex64".into(),
        Kind::ComplexDouble => "complex128".into(),
        k => format!("{k:?}"),
    }
}

fn is_integer(k: Kind) -> bool {
    matches!(k, Kind::Uint8 | Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64)
}

fn is_real_number(k: Kind) -> bool {
    is_integer(k) || matches!(k, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double)
}

/// Refuses images whose pixel bytes would not fit in host memory, where they are read whole:
/// they stay uint8 at rest, and only batches become float32.
pub fn check_budget(n: i64, sample: &[i64], what: &str) -> Result<()> {
    let need = (n * sample.iter().product::<i64>()) as u64;
    let shape = sample.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("×");
    check_memory(
        need,
        what,
        &format!("{n} images of {shape} are kept whole in memory as uint8"),
        "use a smaller image size (data.image_size and the model's), fewer images, or a machine with more memory",
    )
}

/// Refuses `need` bytes of data that `why` must be in memory when they exceed the host-memory
/// budget: available RAM and, on CPU runs, what is left under the CPU cap.
pub fn check_memory(need: u64, what: &str, why: &str, fix: &str) -> Result<()> {
    let host = crate::sysmem::host_memory().ok();
    let available = host.map(|h| h.ram_available_bytes).filter(|&b| b > 0);
    let cpu = crate::shim::cpu_alloc_stats();
    let cap = cpu.cap.map(|c| c.saturating_sub(cpu.allocated));
    let budget = match (available, cap) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    };
    if let Some(b) = budget.filter(|&b| need > b) {
        bail!(
            "{what}: needs {} in memory ({why}), more than the host-memory budget of {} ({}{}); {fix}",
            human_bytes(need),
            human_bytes(b),
            available
                .map(|a| format!("{} of RAM available", human_bytes(a)))
                .unwrap_or_else(|| "RAM unknown".into()),
            cap.map(|c| format!(", {} left under the CPU cap memory.limit", human_bytes(c)))
                .unwrap_or_default(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_beyond_the_host_budget_is_refused_with_sizes() {
        let e = format!(
            "{:#}",
            check_budget(1 << 40, &[3, 224, 224], "data.path x").unwrap_err()
        );
        assert!(
            e.contains("images of 3×224×224 are kept whole in memory") && e.contains("host-memory budget"),
            "{e}"
        );
        check_budget(10, &[3, 8, 8], "data.path x").unwrap();
    }
}
