//! Data sets: synthetic, `.npz`, `.safetensors`, MNIST IDX files, CIFAR-10 and image folders,
//! read in place through a memory map where the file allows (the imagefolder cache, an
//! uncompressed npz, safetensors) or loaded into memory on the CPU, and checked against the
//! model's per-sample shape and class count before training starts. Batches are made by
//! [`gather`] (in the step, or ahead of it by the [`loader`]).
//!
//! Sources (`data.source`):
//! - `synthetic`: `data.samples` samples of a learnable task, deterministic from the seed: every
//!   class has a fixed random template (for `[C, L]` signals with `L >= 16`, a wave whose period
//!   is the class's own, 4 to 32 samples, plus two weaker random waves; random values otherwise) and a sample is its class's template plus
//!   `data.noise` × N(0, 1). Classes are balanced in both splits.
//! - `npz`: a NumPy `.npz` with arrays `x` (any float or integer dtype, converted to float32;
//!   shape `[N, ..]`) and `y` (integer class indices, shape `[N]`), as written by
//!   `numpy.savez(path, x=x, y=y)` or `numpy.savez_compressed`.
//! - `safetensors`: the same two tensors `x` and `y` in a `.safetensors` file.
//! - `mnist`: a directory with the (gunzipped) IDX files `train-images-idx3-ubyte`,
//!   `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and `t10k-labels-idx1-ubyte`; pixels are
//!   scaled to [0, 1]. The train files are the training split and the t10k files the validation
//!   split, so `data.val_fraction` is ignored; `data.val_path`, if set, names another directory
//!   whose t10k files are used instead.
//!
//! Without `data.val_path`, npz and safetensors hold out `round(N × val_fraction)` samples (at
//! least one, leaving at least one for training), chosen by a seeded shuffle.
//!
//! Samples whose number of values matches the model's input are reshaped to its shape (8×8
//! images feed an mlp with 64 inputs; `[N, L]` signals feed a darts model expecting `[1, L]`).
//!
//! All randomness here comes from a SplitMix64 keyed by the seed, never from torch's global
//! generator, so splits, synthetic data and epoch orders replay exactly on resume.
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use tch::{Device, Kind, Tensor};

use crate::human::human_bytes;
use crate::spec::{Data, DataSource};

mod augment;
mod gather;
mod images;
mod loader;
mod mapped;
mod rng;
mod store;
mod wait;

pub use augment::{Augmenter, Draw};
use gather::{Recipe, Source, Staged};
use loader::Loader;
use rng::{stream, SplitMix64};
use store::{Map, Store};
pub use wait::DataWait;

/// A set's samples as stored, in memory or mapped from their file: images stay uint8 (a
/// quarter of float32), other integer data in its own type, float data as float32. A batch is
/// gathered from them and only then converted to float32, divided (images: by 255) and
/// normalized, the same elementwise operations a whole-set conversion would make, so the values
/// are the same. A held-out split is a list of rows into the file's samples, not a copy of them.
#[derive(Debug)]
pub struct Dataset {
    source: Source,
    /// Kept on a device (small, unaugmented data on CUDA): samples and labels there.
    resident: Option<Resident>,
    /// Training batches made ahead by background threads.
    loader: Option<Loader>,
    /// Nanoseconds the steps waited for batches since the last [`Dataset::take_wait`].
    wait_ns: AtomicU64,
}

/// The samples kept on a device, where batches are gathered with its own kernels.
#[derive(Debug)]
struct Resident {
    x: Tensor,
    y: Tensor,
    rows: Option<Tensor>,
    norm: Option<(Tensor, Tensor)>,
}

impl Dataset {
    pub fn new(x: Tensor, y: Tensor) -> Self {
        let store = Store::memory(x).expect("samples of a stored element type");
        Dataset::of(
            store,
            Vec::<i64>::try_from(&y.to_kind(Kind::Int64)).expect("int64 labels"),
        )
    }

    fn of(store: Store, labels: Vec<i64>) -> Self {
        Dataset::from_source(Source {
            store: Arc::new(store),
            labels: Arc::new(labels),
            rows: None,
            recipe: Arc::new(Recipe::default()),
        })
    }

    fn from_source(source: Source) -> Self {
        Dataset {
            source,
            resident: None,
            loader: None,
            wait_ns: AtomicU64::new(0),
        }
    }

    fn recipe(&mut self) -> &mut Recipe {
        Arc::make_mut(&mut self.source.recipe)
    }

    /// Samples divided by `d` once they are float32 (uint8 pixels to [0, 1]).
    fn divided_by(mut self, d: f64) -> Self {
        self.recipe().divisor = Some(d as f32);
        self
    }

    /// The set of `rows` of this one, sharing its samples.
    fn rows(&self, rows: &[i64]) -> Self {
        let rows = match &self.source.rows {
            Some(r) => rows.iter().map(|&k| r[k as usize]).collect(),
            None => rows.to_vec(),
        };
        let mut d = Dataset::from_source(Source {
            rows: Some(Arc::new(rows)),
            ..self.source.clone()
        });
        d.set_augment(None);
        d
    }

    pub fn augment(&self) -> Option<&Augmenter> {
        self.source.recipe.augment.as_ref()
    }

    pub fn set_augment(&mut self, a: Option<Augmenter>) {
        self.recipe().augment = a;
    }

    /// Whether the samples are read through a memory map of their file.
    pub fn is_mapped(&self) -> bool {
        self.source.store.is_mapped()
    }

    /// The samples `idx` of epoch `epoch` (0-based), augmented when the set is, as `(x, y)` on
    /// the CPU (or on the device the set is kept on).
    pub fn batch_at(&self, idx: &[i64], epoch: i64) -> (Tensor, Tensor) {
        if self.resident.is_some() {
            return self.batch(&Tensor::from_slice(idx));
        }
        let t = Instant::now();
        let staged = match &self.loader {
            Some(l) => l.take(idx, epoch),
            None => {
                let mut s = Staged::default();
                self.source.gather_into(idx, epoch, &mut s);
                s
            }
        };
        self.wait_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let xy = self.tensors(&staged);
        if let Some(l) = &self.loader {
            l.give_back(staged);
        }
        xy
    }

    /// A staged batch as CPU tensors `(x, y)`.
    fn tensors(&self, s: &Staged) -> (Tensor, Tensor) {
        let mut shape = vec![s.y.len() as i64];
        shape.extend(self.sample_shape());
        (
            Tensor::from_slice(&s.x).view(shape.as_slice()),
            Tensor::from_slice(&s.y),
        )
    }

    /// Seconds the steps waited for their batches since the last call.
    pub fn take_wait(&self) -> f64 {
        self.wait_ns.swap(0, Ordering::Relaxed) as f64 * 1e-9
    }

    /// Bytes its samples and labels take as stored (a split counts the file's).
    pub fn bytes(&self) -> u64 {
        self.source.store.len_bytes() + self.source.labels.len() as u64 * 8
    }

    /// Bytes of one micro-batch of `n` samples as the loader stages it (float32 and labels).
    pub fn batch_bytes(&self, n: i64) -> u64 {
        self.source.sample_bytes() * n.max(0) as u64
    }

    /// Keeps the samples on `device`, where batches are then drawn: a step copies only the
    /// indices, not the samples. Only without augmentation, which runs on the host.
    pub fn keep_on(&mut self, device: Device) {
        debug_assert!(self.augment().is_none());
        let r = &self.source.recipe;
        let norm = r.norm.as_ref().map(|(m, d)| {
            let shape = norm_shape(&self.sample_shape(), m.len());
            let t = |v: &[f32]| Tensor::from_slice(v).view(shape.as_slice()).to_device(device);
            (t(m), t(d))
        });
        self.resident = Some(Resident {
            x: self.source.store.tensor().to_device(device),
            y: Tensor::from_slice(&self.source.labels).to_device(device),
            rows: self.source.rows.as_ref().map(|r| Tensor::from_slice(r)),
            norm,
        });
    }

    /// Training batches are made ahead by `data.workers` threads, up to `data.prefetch` at a
    /// time; none with `data.prefetch = 0`.
    pub fn start_loader(&mut self, data: &Data) {
        let depth = data.prefetch.max(0) as usize;
        let threads = workers(data).min(depth);
        self.loader = (depth > 0).then(|| Loader::start(self.source.clone(), depth, threads));
    }

    /// The micro-batches the steps will ask for next, in order, for the loader to make.
    pub fn plan(&self, epoch: i64, batches: Vec<Vec<i64>>) {
        if let Some(l) = &self.loader {
            l.plan(epoch, batches);
        }
    }

    /// Whether a loader makes batches ahead.
    pub fn prefetches(&self) -> bool {
        self.loader.is_some()
    }

    /// Prefetch depth the loader gave up under host-memory pressure since the last call:
    /// (from, to, available RAM bytes).
    pub fn shed(&self) -> Vec<(usize, usize, u64)> {
        self.loader.as_ref().map(Loader::shed).unwrap_or_default()
    }

    /// Number of samples.
    pub fn len(&self) -> i64 {
        self.source.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape of one sample, `[C, H, W]` for images.
    pub fn sample_shape(&self) -> Vec<i64> {
        self.source.store.shape[1..].to_vec()
    }

    /// The samples at `idx` (a CPU int64 tensor of indices into this set), as float32 `(x, y)`
    /// where the samples are.
    pub fn batch(&self, idx: &Tensor) -> (Tensor, Tensor) {
        let Some(r) = &self.resident else {
            // As stored, converted and normalized: augmentation belongs to a training epoch.
            let mut plain = self.source.clone();
            Arc::make_mut(&mut plain.recipe).augment = None;
            let mut s = Staged::default();
            let idx = Vec::<i64>::try_from(idx).expect("int64 indices");
            plain.gather_into(&idx, 0, &mut s);
            return self.tensors(&s);
        };
        let rows = match &r.rows {
            Some(rows) => rows.index_select(0, idx),
            None => idx.shallow_clone(),
        };
        // Resident samples: the indices go over from pinned memory, without waiting.
        let rows = crate::host::Host::new(r.x.device()).input(&rows);
        let x = r.x.index_select(0, &rows);
        let x = match x.kind() {
            Kind::Float => x,
            _ => x.to_kind(Kind::Float),
        };
        let x = match self.source.recipe.divisor {
            Some(d) => x / d as f64,
            None => x,
        };
        let x = match &r.norm {
            Some((m, d)) => ((x - m) / d).contiguous(),
            None => x,
        };
        (x, r.y.index_select(0, &rows))
    }

    /// Every sample of the set, as a batch.
    pub fn samples(&self) -> Tensor {
        self.batch(&Tensor::arange(self.len(), (Kind::Int64, Device::Cpu))).0
    }

    /// Every label of the set, in order.
    pub fn labels(&self) -> Tensor {
        self.batch(&Tensor::arange(self.len(), (Kind::Int64, Device::Cpu))).1
    }
}

/// `check`'s line on the host memory the loader takes: the staged micro-batches of float32
/// samples, whatever the set's size, and how the set is read.
pub fn check_line(data: &Data, input_shape: &[i64], micro_batch: i64) -> String {
    let batch = micro_batch.max(1) as u64 * (input_shape.iter().product::<i64>() as u64 * 4 + 8);
    // The staged buffers, and the step's batch twice more: as a tensor, and (on a GPU) its
    // pinned copy on the way over.
    let buffers = data.prefetch.max(0) as u64 + 3;
    let shape = input_shape.iter().map(i64::to_string).collect::<Vec<_>>().join("×");
    let read = match (data.source, data.memory_map) {
        (DataSource::Synthetic, _) => "generated in memory",
        (DataSource::Imagefolder, true) => "its cache read in place through a memory map",
        (DataSource::Npz | DataSource::Safetensors, true) => {
            "read in place through a memory map (uncompressed npz, safetensors), else whole"
        }
        (DataSource::Mnist | DataSource::Cifar10, _) | (_, false) => "read whole into memory",
    };
    format!(
        "data loader      {buffers} micro-batch(es) of {micro_batch} × {shape} float32 (data.prefetch {} + 1 staged, the step's batch as a tensor and its pinned copy) = {} of host memory whatever the set's size, plus 24 bytes a sample (labels, the epoch's order); {} thread(s) (data.workers); the set {read}",
        data.prefetch,
        human_bytes(buffers * batch),
        workers(data).min(data.prefetch.max(1) as usize),
    )
}

/// Threads `data.workers` asks for: 0 means one per core.
pub fn workers(data: &Data) -> usize {
    match data.workers {
        w if w > 0 => w as usize,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get()),
    }
}

/// The shape of per-channel normalization values (`channels` of them, or 1) against a batch of
/// samples shaped `sample`: `[1, channels, 1, ..]`.
fn norm_shape(sample: &[i64], channels: usize) -> Vec<i64> {
    let mut shape = vec![1, channels as i64];
    shape.extend(std::iter::repeat_n(1, sample.len().saturating_sub(1)));
    shape
}

/// The training and validation sets.
#[derive(Debug)]
pub struct Splits {
    pub train: Dataset,
    pub val: Dataset,
}

/// Data that takes at most this share of what the run may use of a CUDA device stays there.
const RESIDENT_SHARE: u64 = 16;

impl Splits {
    /// Whether both sets stay on the device: on CUDA, without augmentation, and within a
    /// sixteenth of what the run may use of it (`budget`: the cap, or the device's total).
    pub fn stay_resident(&self, device: Device, budget: Option<u64>) -> bool {
        let small = |b: u64| (self.train.bytes() + self.val.bytes()).saturating_mul(RESIDENT_SHARE) <= b;
        device.is_cuda() && self.train.augment().is_none() && self.val.augment().is_none() && budget.is_some_and(small)
    }
}

/// Loads the configured source and checks it against the model: each sample of `x` must have
/// shape `input_shape` (the model's per-sample shape) or as many values (then it is reshaped),
/// and `y` must lie in `0..num_classes`. Errors name the file, both shapes and what to change.
pub fn load(data: &Data, input_shape: &[i64], num_classes: i64, seed: i64) -> Result<Splits> {
    let mut s = load_source(data, input_shape, num_classes, seed)?;
    if !data.mean.is_empty() {
        for part in [&mut s.train, &mut s.val] {
            part.recipe().norm = Some(normalization(&part.sample_shape(), &data.mean, &data.std)?);
        }
    }
    if data.augment.enabled() {
        let sample = s.train.sample_shape();
        if sample.len() != 3 {
            bail!(
                "data.augment: random crops and flips need images [C, H, W], but the samples have shape {sample:?}; remove [data.augment]"
            );
        }
        let c = sample[0] as usize;
        let fill = (0..c)
            .map(|i| match data.mean.len() {
                0 => 0.0,
                1 => -data.mean[0] / data.std[0],
                _ => -data.mean[i] / data.std[i],
            })
            .collect();
        let samples = s.train.len();
        s.train.set_augment(Some(Augmenter {
            seed,
            padding: data.augment.crop_padding,
            flip: data.augment.horizontal_flip,
            fill,
            samples,
        }));
    }
    Ok(s)
}

/// The mean and std, as float32, that normalize samples shaped `sample` per channel (its first
/// dimension), as `(x - mean) / std`; one value applies to every channel.
fn normalization(sample: &[i64], mean: &[f64], std: &[f64]) -> Result<(Vec<f32>, Vec<f32>)> {
    if sample.is_empty() {
        bail!("data.mean/data.std: normalise channels of samples [C, ..], but the samples are scalars");
    }
    let c = sample[0];
    if mean.len() != 1 && mean.len() as i64 != c {
        bail!(
            "data.mean/data.std: have {} values but the samples have {c} channels (shape {sample:?}); give one value per channel, or one for all",
            mean.len(),
        );
    }
    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect();
    Ok((f32s(mean), f32s(std)))
}

fn load_source(data: &Data, input_shape: &[i64], num_classes: i64, seed: i64) -> Result<Splits> {
    let model = ModelKeys::new(input_shape, num_classes);
    match data.source {
        DataSource::Synthetic => synthetic(data, input_shape, num_classes, seed),
        DataSource::Npz | DataSource::Safetensors => array_files(data, &model, seed),
        DataSource::Mnist => {
            let dir = required_path(data)?;
            let (vkey, vdir) = match &data.val_path {
                Some(v) => ("data.val_path", v.as_path()),
                None => ("data.path", dir),
            };
            // Look for every file first, so one error lists all that are missing.
            let (train_files, val_files) = if vdir == dir {
                let mut f = mnist_files(dir, &["train", "t10k"], "data.path")?;
                let v = f.split_off(2);
                (f, v)
            } else {
                (
                    mnist_files(dir, &["train"], "data.path")?,
                    mnist_files(vdir, &["t10k"], vkey)?,
                )
            };
            let (x, y) = read_mnist_pair(&train_files, "data.path")?;
            let train = checked(x, y, &format!("data.path {} (train files)", dir.display()), &model)?.divided_by(255.0);
            let (x, y) = read_mnist_pair(&val_files, vkey)?;
            let val = checked(x, y, &format!("{vkey} {} (t10k files)", vdir.display()), &model)?.divided_by(255.0);
            Ok(Splits { train, val })
        }
        DataSource::Cifar10 => {
            let dir = required_path(data)?;
            let (vkey, vdir) = match &data.val_path {
                Some(v) => ("data.val_path", v.as_path()),
                None => ("data.path", dir),
            };
            let train_files = images::cifar10_files(dir, true, "data.path")?;
            let val_files = images::cifar10_files(vdir, false, vkey)?;
            let (x, y) = images::read_cifar10(&train_files, "data.path")?.into_parts();
            let train =
                checked(x, y, &format!("data.path {} (data_batch files)", dir.display()), &model)?.divided_by(255.0);
            let (x, y) = images::read_cifar10(&val_files, vkey)?.into_parts();
            let val = checked(x, y, &format!("{vkey} {} (test_batch.bin)", vdir.display()), &model)?.divided_by(255.0);
            Ok(Splits { train, val })
        }
        DataSource::Imagefolder => {
            let root = required_path(data)?;
            let (channels, size) = match input_shape {
                [c, h, w] if h == w => (*c, *h),
                _ => bail!(
                    "data.source = \"imagefolder\" needs a model that takes square images [C, S, S], but it takes {input_shape:?}"
                ),
            };
            if data.image_size > 0 && data.image_size != size {
                bail!(
                    "data.image_size = {} but the model takes {size}×{size} images; set data.image_size = {size} (or leave it out), or the model's image_size = {}",
                    data.image_size,
                    data.image_size
                );
            }
            let what = format!("data.path {}", root.display());
            let (imgs, classes) = images::read_imagefolder(root, size, channels, "data.path", data)?;
            let all = checked_store(imgs.x, imgs.y, &what, &model)?.divided_by(255.0);
            match &data.val_path {
                Some(v) => {
                    let (imgs, vclasses) = images::read_imagefolder(v, size, channels, "data.val_path", data)?;
                    if vclasses != classes {
                        bail!(
                            "data.val_path {}: has classes {vclasses:?} but data.path has {classes:?}; both need the same class directories",
                            v.display()
                        );
                    }
                    let val = checked_store(imgs.x, imgs.y, &format!("data.val_path {}", v.display()), &model)?
                        .divided_by(255.0);
                    Ok(Splits { train: all, val })
                }
                None => holdout(all, data.val_fraction, seed, &what),
            }
        }
    }
}

/// An npz or safetensors file (and its validation file): mapped where it can be, else read
/// whole.
fn array_files(data: &Data, model: &ModelKeys, seed: i64) -> Result<Splits> {
    let path = required_path(data)?;
    let read = |key: &str, p: &Path| -> Result<Dataset> {
        let what = format!("{key} {}", p.display());
        let mapped = match (data.memory_map, data.source) {
            (false, _) => None,
            (true, DataSource::Npz) => mapped::npz(p),
            (true, _) => mapped::safetensors(p),
        };
        if let Some(m) = mapped {
            return checked_store(m.x, m.y, &what, model);
        }
        check_whole_file(p, data, &what)?;
        let (x, y) = match data.source {
            DataSource::Npz => read_npz(p, &what)?,
            _ => read_safetensors(p, &what)?,
        };
        checked(x, y, &what, model)
    };
    let all = read("data.path", path)?;
    match &data.val_path {
        Some(v) => Ok(Splits {
            train: all,
            val: read("data.val_path", v)?,
        }),
        None => holdout(all, data.val_fraction, seed, &format!("data.path {}", path.display())),
    }
}

/// The shape of one sample as the data set has it of its own, read cheaply (file headers, not
/// the samples), so image models can take their image size and channels from the data: None
/// where the data follows the model (synthetic data; an imagefolder tree without
/// `data.image_size`, whose images are resized to the model's size). An imagefolder's channel
/// count is the model's (it decodes to 1 or 3): 0 there.
pub fn sample_shape(data: &Data) -> Result<Option<Vec<i64>>> {
    let Some(path) = data.path.as_deref() else {
        return Ok(None);
    };
    Ok(match data.source {
        DataSource::Synthetic => None,
        DataSource::Cifar10 => Some(vec![3, 32, 32]),
        DataSource::Mnist => Some(vec![28, 28]),
        DataSource::Imagefolder => (data.image_size > 0).then(|| vec![0, data.image_size, data.image_size]),
        DataSource::Npz => Some(npz_sample_shape(path)?),
        DataSource::Safetensors => Some(safetensors_sample_shape(path)?),
    })
}

/// `x`'s shape without N from a safetensors file's JSON header.
fn safetensors_sample_shape(path: &Path) -> Result<Vec<i64>> {
    use std::io::Read;
    let what = format!("data.path {}", path.display());
    let mut f = fs::File::open(path).with_context(|| format!("{what}: cannot read it"))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .with_context(|| format!("{what}: not a safetensors file"))?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        bail!("{what}: not a safetensors file (a header of {len} bytes)");
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header)
        .with_context(|| format!("{what}: not a safetensors file"))?;
    let v: serde_json::Value =
        serde_json::from_slice(&header).with_context(|| format!("{what}: not a safetensors file"))?;
    let shape = v["x"]["shape"]
        .as_array()
        .ok_or_else(|| anyhow!("{what}: has no tensor x"))?;
    Ok(shape.iter().skip(1).filter_map(|d| d.as_i64()).collect())
}

/// `x`'s shape without N from an .npz: the zip's central directory, then `x.npy`'s header,
/// when numpy stored it uncompressed (`numpy.savez`); a compressed archive
/// (`numpy.savez_compressed`) is read whole.
fn npz_sample_shape(path: &Path) -> Result<Vec<i64>> {
    match npz_header_shape(path) {
        Some(s) => Ok(s.into_iter().skip(1).collect()),
        None => {
            let (x, _) = read_npz(path, &format!("data.path {}", path.display()))?;
            Ok(x.size().into_iter().skip(1).collect())
        }
    }
}

fn npz_header_shape(path: &Path) -> Option<Vec<i64>> {
    let map = Map::open(path).ok()?;
    let m = mapped::zip_member(map.bytes(), "x.npy")?;
    if m.method != 0 {
        return None;
    }
    Some(mapped::npy_header(map.bytes().get(m.data..)?)?.shape)
}

/// Deterministic permutation of `0..n` for `(seed, epoch)`, independent of torch's RNG, so a
/// resumed run replays exactly the same order. Empty for `n <= 0`.
pub fn epoch_order(n: i64, seed: i64, epoch: i64) -> Vec<i64> {
    permutation(n, &mut stream(seed, TAG_EPOCH, epoch))
}

// ---------------------------------------------------------------------------------------------
// Randomness

const TAG_EPOCH: u64 = 0x6570_6f63_685f_6f72; // "epoch_or"
const TAG_HOLDOUT: u64 = 0x686f_6c64_6f75_7400; // "holdout"
const TAG_TEMPLATES: u64 = 0x7465_6d70_6c61_7465; // "template"
const TAG_SAMPLES: u64 = 0x7361_6d70_6c65_7300; // "samples"

/// Fisher–Yates shuffle of `0..n`.
fn permutation(n: i64, rng: &mut SplitMix64) -> Vec<i64> {
    let mut v: Vec<i64> = (0..n.max(0)).collect();
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
    v
}

/// Validation count for `n` samples: round(n × fraction), at least 1, leaving at least 1.
fn val_count(n: i64, fraction: f64) -> i64 {
    ((n as f64 * fraction).round() as i64).clamp(1, n - 1)
}

// ---------------------------------------------------------------------------------------------
// Synthetic

fn synthetic(data: &Data, input_shape: &[i64], num_classes: i64, seed: i64) -> Result<Splits> {
    let n = data.synthetic_samples();
    if n < 2 {
        bail!("data.samples = {n}: synthetic data needs at least 2 samples (one to train, one to validate)");
    }
    if num_classes < 1 || input_shape.iter().any(|&d| d < 1) {
        bail!(
            "synthetic data needs num_classes >= 1 and a positive input shape, got {num_classes} and {input_shape:?}"
        );
    }
    let n_val = val_count(n, data.val_fraction);
    let templates = templates(input_shape, num_classes, seed);
    let make = |count: i64, index: i64| -> Dataset {
        let mut rng = stream(seed, TAG_SAMPLES, index);
        // Balanced: label i % K, then shuffled.
        let labels: Vec<i64> = permutation(count, &mut rng)
            .into_iter()
            .map(|i| i % num_classes)
            .collect();
        let d = templates.len() / num_classes as usize;
        let mut xs = vec![0f32; count as usize * d];
        let noise = data.synthetic_noise();
        for (row, &label) in xs.chunks_exact_mut(d).zip(&labels) {
            let t = &templates[label as usize * d..(label as usize + 1) * d];
            for (pair, tp) in row.chunks_mut(2).zip(t.chunks(2)) {
                let (a, b) = rng.normal_pair();
                pair[0] = tp[0] + (noise * a) as f32;
                if pair.len() > 1 {
                    pair[1] = tp[1] + (noise * b) as f32;
                }
            }
        }
        let mut shape = vec![count];
        shape.extend_from_slice(input_shape);
        Dataset::new(Tensor::from_slice(&xs).reshape(&shape), Tensor::from_slice(&labels))
    };
    Ok(Splits {
        train: make(n - n_val, 0),
        val: make(n_val, 1),
    })
}

/// One template per class, flattened: `[num_classes × prod(input_shape)]`, each of unit RMS.
fn templates(input_shape: &[i64], num_classes: i64, seed: i64) -> Vec<f32> {
    let d: usize = input_shape.iter().product::<i64>() as usize;
    let len = *input_shape.last().unwrap_or(&1) as usize;
    let mut rng = stream(seed, TAG_TEMPLATES, 0);
    let mut out = vec![0f32; num_classes as usize * d];
    if input_shape.len() >= 2 && len >= 16 {
        // Signals: class k oscillates with its own period, spread geometrically from 4 samples
        // up to 32 (or L/4), so a few small convolutions see the class in any window, as in
        // real 1-D data where classes differ in local rhythm. Per class and channel: the class
        // wave plus two weaker ones of random period, all with random phases.
        let classes = num_classes as usize;
        let channels = (d / len).max(1);
        let top = (len as f64 / 4.0).clamp(4.0, 32.0);
        for (r, row) in out.chunks_exact_mut(len).enumerate() {
            let class = r / channels;
            let t = if classes > 1 {
                class as f64 / (classes - 1) as f64
            } else {
                0.0
            };
            let period = 4.0 * (top / 4.0).powf(t);
            let mut waves = vec![(std::f64::consts::TAU / period, rng.unit() * std::f64::consts::TAU, 1.0)];
            for _ in 0..2 {
                let p = 4.0 + rng.unit() * (top - 4.0);
                waves.push((
                    std::f64::consts::TAU / p,
                    rng.unit() * std::f64::consts::TAU,
                    0.3 * rng.unit(),
                ));
            }
            let mut sq = 0.0;
            for (i, v) in row.iter_mut().enumerate() {
                let s: f64 = waves.iter().map(|&(w, p, a)| a * (w * i as f64 + p).sin()).sum();
                sq += s * s;
                *v = s as f32;
            }
            let scale = 1.0 / (sq / len as f64).sqrt().max(1e-6);
            row.iter_mut().for_each(|v| *v = (*v as f64 * scale) as f32);
        }
    } else {
        for pair in out.chunks_mut(2) {
            let (a, b) = rng.normal_pair();
            pair[0] = a as f32;
            if pair.len() > 1 {
                pair[1] = b as f32;
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Files

fn required_path(data: &Data) -> Result<&Path> {
    data.path
        .as_deref()
        .ok_or_else(|| anyhow!("data.path is required for this data.source"))
}

/// The config keys that set the model's input shape and class count, for error messages.
struct ModelKeys<'a> {
    input_shape: &'a [i64],
    num_classes: i64,
}

impl<'a> ModelKeys<'a> {
    fn new(input_shape: &'a [i64], num_classes: i64) -> Self {
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

/// Converts and checks `x` and `y` from a file described by `what` ("data.path foo.npz").
fn checked(x: Tensor, y: Tensor, what: &str, model: &ModelKeys) -> Result<Dataset> {
    if x.size().is_empty() {
        bail!("{what}: x is a scalar; it must be an array of samples, shape [N, ..]");
    }
    if !is_real_number(x.kind()) {
        bail!(
            "{what}: x has dtype {}; it must be a float or integer array",
            dtype(x.kind())
        );
    }
    // Integer samples stay as stored (every integer is finite, and each batch converts exactly
    // as the whole set would); float samples become float32 here, where the finite check must
    // see what the model will.
    let x = match is_integer(x.kind()) {
        true => x,
        false => x.to_kind(Kind::Float),
    };
    checked_store(Store::memory(x).expect("a stored element type"), y, what, model)
}

/// Checks samples `x` (in memory or mapped) and labels `y` against the model.
fn checked_store(x: Store, y: Tensor, what: &str, model: &ModelKeys) -> Result<Dataset> {
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
    let finite = x.elem.is_integer()
        || x.bytes()
            .chunks_exact(4)
            .all(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")).is_finite());
    if !finite {
        bail!("{what}: x contains NaN or infinite values");
    }
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
    Ok(Dataset::of(x, labels))
}

/// Refuses a file read whole (not mapped) whose arrays would not fit in host memory: a
/// compressed npz by its arrays' inflated sizes, other files by their size.
fn check_whole_file(path: &Path, data: &Data, what: &str) -> Result<()> {
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
    images::check_memory(need, what, why, fix)
}

/// NumPy's name for a dtype, as users wrote it.
fn dtype(k: Kind) -> String {
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

/// Splits `all` into a seeded, shuffled holdout of `round(N × fraction)` samples and the rest;
/// both keep the file's order.
fn holdout(all: Dataset, fraction: f64, seed: i64, what: &str) -> Result<Splits> {
    let n = all.len();
    if n < 2 {
        bail!("{what}: has {n} sample; holding out a validation split needs at least 2 (or set data.val_path)");
    }
    let n_val = val_count(n, fraction);
    let perm = permutation(n, &mut stream(seed, TAG_HOLDOUT, 0));
    let mut val_idx = perm[..n_val as usize].to_vec();
    let mut train_idx = perm[n_val as usize..].to_vec();
    val_idx.sort_unstable();
    train_idx.sort_unstable();
    Ok(Splits {
        train: all.rows(&train_idx),
        val: all.rows(&val_idx),
    })
}

/// Finds `x` and `y` among named tensors, or says what the file has.
fn take_xy(named: Vec<(String, Tensor)>, what: &str, how: &str) -> Result<(Tensor, Tensor)> {
    let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    let mut x = None;
    let mut y = None;
    for (name, t) in named {
        match name.as_str() {
            "x" => x = Some(t),
            "y" => y = Some(t),
            _ => {}
        }
    }
    let missing: Vec<&str> = [("x", x.is_none()), ("y", y.is_none())]
        .iter()
        .filter(|m| m.1)
        .map(|m| m.0)
        .collect();
    match (x, y) {
        (Some(x), Some(y)) => Ok((x, y)),
        _ => bail!(
            "{what}: has no {} named {}; it has {}; it must hold x (samples) and y (class indices), {how}",
            if missing.len() == 1 { "array" } else { "arrays" },
            missing
                .iter()
                .map(|m| format!("\"{m}\""))
                .collect::<Vec<_>>()
                .join(" or "),
            if names.is_empty() {
                "none".to_owned()
            } else {
                format!("{names:?}")
            }
        ),
    }
}

fn read_npz(path: &Path, what: &str) -> Result<(Tensor, Tensor)> {
    const HOW: &str = "as written by numpy.savez(path, x=x, y=y)";
    let named = Tensor::read_npz(path).map_err(|e| {
        let e = e.to_string();
        // tch's reader takes little-endian numeric arrays only, and calls a big-endian one's
        // descriptor ">f4" not little-endian.
        let hint = if e.contains("fortran") {
            " (save C-ordered arrays: numpy.ascontiguousarray)"
        } else if e.contains("little-endian descr >") {
            " (the array is big-endian: save it as x.astype(x.dtype.newbyteorder('<')))"
        } else if e.contains("unrecognized descr") {
            " (an object or string array: save numeric arrays)"
        } else {
            ""
        };
        anyhow!("{what}: cannot read it as an .npz: {e}{hint}; it must be a NumPy .npz with arrays x and y, {HOW}")
    })?;
    take_xy(named, what, HOW)
}

fn read_safetensors(path: &Path, what: &str) -> Result<(Tensor, Tensor)> {
    const HOW: &str = "as written by safetensors.torch.save_file({\"x\": x, \"y\": y}, path)";
    let named = Tensor::read_safetensors(path).map_err(|e| {
        let e = e.to_string();
        anyhow!(
            "{what}: cannot read it as .safetensors: {e}{}; it must be a safetensors file with tensors x and y, {HOW}",
            crate::checkpoint::safetensors_hint(&e)
        )
    })?;
    take_xy(named, what, HOW)
}

// ---------------------------------------------------------------------------------------------
// MNIST

/// The canonical IDX file names of a split ("train" or "t10k"): images, labels.
fn mnist_names(split: &str) -> [String; 2] {
    [
        format!("{split}-images-idx3-ubyte"),
        format!("{split}-labels-idx1-ubyte"),
    ]
}

/// Paths of the images and labels files of each split in `splits`, in that order. The dotted
/// names some mirrors use (`train-images.idx3-ubyte`) are accepted too; gzipped files are not.
fn mnist_files(dir: &Path, splits: &[&str], key: &str) -> Result<Vec<PathBuf>> {
    let mut found = vec![];
    let mut missing = vec![];
    let mut gz = vec![];
    for name in splits.iter().flat_map(|s| mnist_names(s)) {
        let dotted = name.replacen("-idx", ".idx", 1);
        let hit = [&name, &dotted].into_iter().map(|n| dir.join(n)).find(|p| p.is_file());
        match hit {
            Some(p) => found.push(p),
            None => {
                gz.extend(
                    [&name, &dotted]
                        .into_iter()
                        .map(|n| format!("{n}.gz"))
                        .filter(|n| dir.join(n).exists()),
                );
                missing.push(name);
            }
        }
    }
    if missing.is_empty() {
        return Ok(found);
    }
    let d = dir.display();
    let needed: Vec<String> = splits.iter().flat_map(|s| mnist_names(s)).collect();
    let mut msg = format!(
        "{key} {d}: the MNIST directory lacks {}; data.source = \"mnist\" reads {}",
        missing.join(", "),
        needed.join(", ")
    );
    if !gz.is_empty() {
        msg.push_str(&format!(
            "; it has {}, which must be gunzipped first (gunzip -k {d}/*.gz)",
            gz.join(", ")
        ));
    }
    bail!(msg)
}

/// Images `[N, rows, cols]` as uint8 and labels `[N]` (uint8) from `[images, labels]` files.
fn read_mnist_pair(files: &[PathBuf], key: &str) -> Result<(Tensor, Tensor)> {
    let (idims, pixels) = read_idx(&files[0], 3, key)?;
    let (ldims, labels) = read_idx(&files[1], 1, key)?;
    if idims[0] != ldims[0] {
        bail!(
            "{key} {}: has {} images but {} has {} labels",
            files[0].display(),
            idims[0],
            files[1].display(),
            ldims[0]
        );
    }
    // Kept as the bytes they are; a batch becomes float32 in [0, 1].
    let x = Tensor::from_slice(&pixels).reshape(&idims);
    let y = Tensor::from_slice(&labels);
    Ok((x, y))
}

/// Reads an IDX file of unsigned bytes with `ndim` dimensions: (dims, data).
fn read_idx(path: &Path, ndim: usize, key: &str) -> Result<(Vec<i64>, Vec<u8>)> {
    let what = format!("{key} {}", path.display());
    let mut bytes = fs::read(path).with_context(|| format!("{what}: cannot read it"))?;
    let header = 4 + 4 * ndim;
    if bytes.len() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b {
        bail!("{what}: is gzip-compressed; gunzip it first");
    }
    if bytes.len() < header || bytes[0] != 0 || bytes[1] != 0 {
        bail!("{what}: is not an MNIST IDX file (bad header)");
    }
    if bytes[2] != 0x08 {
        bail!(
            "{what}: IDX data type 0x{:02x} is not supported; only unsigned bytes (0x08) are",
            bytes[2]
        );
    }
    if bytes[3] as usize != ndim {
        bail!(
            "{what}: has {} dimensions, expected {ndim} (is it the right file?)",
            bytes[3]
        );
    }
    let dims: Vec<i64> = bytes[4..header]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as i64)
        .collect();
    let expected: i64 = dims.iter().product();
    let have = (bytes.len() - header) as i64;
    if have != expected {
        bail!("{what}: header says {dims:?} ({expected} bytes of data) but the file has {have}; is it truncated?");
    }
    bytes.drain(..header);
    Ok((dims, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_says_its_sample_shape_from_headers() {
        let dir = tempfile::tempdir().unwrap();
        let x = Tensor::zeros([5, 3, 12, 12], (Kind::Float, Device::Cpu));
        let y = Tensor::zeros([5], (Kind::Int64, Device::Cpu));
        let st = dir.path().join("d.safetensors");
        Tensor::write_safetensors(&[("x", &x), ("y", &y)], &st).unwrap();
        let npz = dir.path().join("d.npz");
        Tensor::write_npz(&[("x", &x), ("y", &y)], &npz).unwrap();
        let data = |source, path: &Path| Data {
            source,
            path: Some(path.to_owned()),
            ..Data::default()
        };
        assert_eq!(
            sample_shape(&data(DataSource::Safetensors, &st)).unwrap(),
            Some(vec![3, 12, 12])
        );
        assert_eq!(
            sample_shape(&data(DataSource::Npz, &npz)).unwrap(),
            Some(vec![3, 12, 12])
        );
        // numpy.savez_compressed's (digits: 8×8 grey images, no channel axis) is read whole.
        let digits = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/digits.npz");
        assert_eq!(npz_header_shape(&digits), None, "deflated");
        assert_eq!(sample_shape(&data(DataSource::Npz, &digits)).unwrap(), Some(vec![8, 8]));
        assert_eq!(
            sample_shape(&data(DataSource::Cifar10, dir.path())).unwrap(),
            Some(vec![3, 32, 32])
        );
        let folder = Data {
            image_size: 48,
            ..data(DataSource::Imagefolder, dir.path())
        };
        assert_eq!(sample_shape(&folder).unwrap(), Some(vec![0, 48, 48]));
        assert_eq!(sample_shape(&data(DataSource::Imagefolder, dir.path())).unwrap(), None);
        assert_eq!(
            sample_shape(&Data::default()).unwrap(),
            None,
            "synthetic follows the model"
        );
        let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (10, 3, 32, 32), }\n";
        let mut npy = b"\x93NUMPY\x01\x00".to_vec();
        npy.extend((header.len() as u16).to_le_bytes());
        npy.extend(header.as_bytes());
        assert_eq!(mapped::npy_header(&npy).map(|h| h.shape), Some(vec![10, 3, 32, 32]));
    }

    #[test]
    fn only_small_unaugmented_data_stays_on_a_cuda_device() {
        let set = |n: i64| {
            Dataset::new(
                Tensor::zeros([n, 4], (Kind::Float, Device::Cpu)),
                Tensor::zeros([n], (Kind::Int64, Device::Cpu)),
            )
        };
        // 100 samples of 4 floats and a label: 2400 bytes.
        let s = Splits {
            train: set(80),
            val: set(20),
        };
        assert_eq!(s.train.bytes() + s.val.bytes(), 2400);
        let cuda = Device::Cuda(0);
        assert!(s.stay_resident(cuda, Some(2400 * 16)));
        assert!(
            !s.stay_resident(cuda, Some(2400 * 16 - 1)),
            "over a sixteenth of the budget"
        );
        assert!(!s.stay_resident(cuda, None));
        assert!(
            !s.stay_resident(Device::Cpu, Some(1 << 40)),
            "the CPU has nothing to copy"
        );
        let mut augmented = s;
        augmented.train.set_augment(Some(Augmenter {
            seed: 0,
            padding: 0,
            flip: true,
            fill: vec![0.0],
            samples: 80,
        }));
        assert!(
            !augmented.stay_resident(cuda, Some(1 << 40)),
            "augmentation runs on the host"
        );
    }

    /// A set of 20 random images [3, 8, 8] as uint8, normalized and augmented as ImageNet
    /// images would be, with the tensor pipeline that makes the same batches.
    fn augmented_images() -> (Dataset, Tensor, Augmenter, (Tensor, Tensor)) {
        tch::manual_seed(5);
        let x = Tensor::randint(256, [20, 3, 8, 8], (Kind::Uint8, Device::Cpu));
        let y = Tensor::arange(20, (Kind::Int64, Device::Cpu)).remainder(3);
        let (mean, std) = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
        let mut d = Dataset::new(x.shallow_clone(), y).divided_by(255.0);
        d.recipe().norm = Some(normalization(&[3, 8, 8], &mean, &std).unwrap());
        let aug = Augmenter {
            seed: 3,
            padding: 2,
            flip: true,
            fill: mean.iter().zip(std).map(|(m, s)| -m / s).collect(),
            samples: 20,
        };
        d.set_augment(Some(aug.clone()));
        let t = |v: &[f64]| Tensor::from_slice(v).to_kind(Kind::Float).view([1, 3, 1, 1]);
        (d, x, aug, (t(&mean), t(&std)))
    }

    #[test]
    fn batches_equal_a_tensor_pipeline_bit_for_bit() {
        let (d, x, aug, (m, s)) = augmented_images();
        let idx = [5i64, 0, 19, 7, 7];
        let (got, y) = d.batch_at(&idx, 2);
        let want = x.index_select(0, &Tensor::from_slice(&idx)).to_kind(Kind::Float) / 255.0;
        let want = aug.apply(&((want - &m) / &s).contiguous(), &idx, 2);
        let bits = |t: &Tensor| {
            Vec::<f32>::try_from(t.flatten(0, -1))
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&got), bits(&want));
        assert_eq!(Vec::<i64>::try_from(&y).unwrap(), vec![2, 0, 1, 1, 1]);
        // Other stored types convert as to_kind does.
        for kind in [Kind::Int8, Kind::Int16, Kind::Int, Kind::Int64, Kind::Float] {
            let v = (Tensor::randn([6, 5], (Kind::Float, Device::Cpu)) * 1000.0).to_kind(kind);
            let d = Dataset::new(v.shallow_clone(), Tensor::zeros([6], (Kind::Int64, Device::Cpu)));
            let (got, _) = d.batch_at(&[4, 1], 0);
            assert!(
                got.equal(&v.index_select(0, &Tensor::from_slice(&[4i64, 1])).to_kind(Kind::Float)),
                "{kind:?}"
            );
        }
    }

    #[test]
    fn the_loader_makes_the_same_batches_in_any_order_and_depth() {
        let (full, _, aug, _) = augmented_images();
        let mut d = full.rows(&(0..20).rev().step_by(2).collect::<Vec<i64>>());
        d.set_augment(Some(aug));
        let plan: Vec<Vec<i64>> = (0..5).map(|i| vec![2 * (i % 5), (2 * i + 1) % 10]).collect();
        let want: Vec<Tensor> = plan.iter().map(|b| d.batch_at(b, 1).0).collect();
        for (depth, threads) in [(1, 1), (4, 4), (3, 2)] {
            let mut l = Dataset::from_source(d.source.clone());
            l.set_augment(d.augment().cloned());
            l.start_loader(&Data {
                prefetch: depth,
                workers: threads,
                ..Data::default()
            });
            l.plan(1, plan.clone());
            // Taken in plan order, then one out of order (made on the spot), then on.
            for (b, w) in plan.iter().zip(&want).take(2) {
                assert!(l.batch_at(b, 1).0.equal(w));
            }
            assert!(l.batch_at(&plan[4], 1).0.equal(&want[4]));
            for (b, w) in plan.iter().zip(&want).skip(2) {
                assert!(l.batch_at(b, 1).0.equal(w), "depth {depth}, {threads} threads");
            }
            // Another epoch augments otherwise, whatever was staged.
            assert!(!l.batch_at(&plan[0], 2).0.equal(&want[0]));
        }
    }

    fn spec(source: DataSource, path: Option<PathBuf>) -> Data {
        Data {
            source,
            path,
            ..Default::default()
        }
    }

    fn synth(samples: i64, noise: f64) -> Data {
        Data {
            samples: Some(samples),
            noise: Some(noise),
            ..Default::default()
        }
    }

    fn equal(a: &Tensor, b: &Tensor) -> bool {
        a.size() == b.size() && a.equal(b)
    }

    fn err_of(r: Result<Splits>) -> String {
        format!("{:#}", r.expect_err("expected an error"))
    }

    fn digits_path() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("data/digits.npz")
    }

    #[test]
    fn synthetic_is_deterministic_by_seed() {
        let d = synth(64, 1.0);
        let a = load(&d, &[2, 32], 4, 7).unwrap();
        let b = load(&d, &[2, 32], 4, 7).unwrap();
        let c = load(&d, &[2, 32], 4, 8).unwrap();
        assert!(equal(&a.train.samples(), &b.train.samples()) && equal(&a.train.labels(), &b.train.labels()));
        assert!(equal(&a.val.samples(), &b.val.samples()) && equal(&a.val.labels(), &b.val.labels()));
        assert!(!equal(&a.train.samples(), &c.train.samples()));
        // Torch's global RNG plays no part.
        tch::manual_seed(1);
        let e = load(&d, &[2, 32], 4, 7).unwrap();
        tch::manual_seed(2);
        let f = load(&d, &[2, 32], 4, 7).unwrap();
        assert!(equal(&e.train.samples(), &f.train.samples()) && equal(&e.train.samples(), &a.train.samples()));
    }

    #[test]
    fn synthetic_shapes_sizes_and_balance() {
        let s = load(&synth(100, 1.0), &[3, 20], 5, 0).unwrap();
        assert_eq!(s.val.len(), 20);
        assert_eq!(s.train.len(), 80);
        assert_eq!(s.train.samples().size(), vec![80, 3, 20]);
        assert_eq!(s.train.samples().kind(), Kind::Float);
        assert_eq!(s.train.labels().kind(), Kind::Int64);
        let counts = Vec::<i64>::try_from(s.train.labels().bincount::<Tensor>(None, 5)).unwrap();
        assert_eq!(counts, vec![16; 5]);
        let counts = Vec::<i64>::try_from(s.val.labels().bincount::<Tensor>(None, 5)).unwrap();
        assert_eq!(counts, vec![4; 5]);
        // Tiny: val is still at least 1 and train keeps at least 1.
        let s = load(
            &Data {
                samples: Some(4),
                val_fraction: 0.01,
                ..synth(4, 1.0)
            },
            &[8],
            2,
            0,
        )
        .unwrap();
        assert_eq!((s.train.len(), s.val.len()), (3, 1));
    }

    /// Nearest class mean (from train) classifies val well at noise 1.0, for both template kinds.
    #[test]
    fn synthetic_is_learnable() {
        for shape in [vec![32i64], vec![1, 64]] {
            let k = 4;
            let s = load(&synth(400, 1.0), &shape, k, 3).unwrap();
            let tx = s.train.samples().flatten(1, -1);
            let means = Tensor::stack(
                &(0..k)
                    .map(|c| {
                        tx.index_select(0, &s.train.labels().eq(c).nonzero().squeeze_dim(1))
                            .mean_dim(0, false, Kind::Float)
                    })
                    .collect::<Vec<_>>(),
                0,
            );
            let vx = s.val.samples().flatten(1, -1);
            let dist = (vx.unsqueeze(1) - means.unsqueeze(0))
                .square()
                .sum_dim_intlist(2, false, Kind::Float);
            let pred = dist.argmin(1, false);
            let acc = pred
                .eq_tensor(&s.val.labels())
                .to_kind(Kind::Float)
                .mean(Kind::Float)
                .double_value(&[]);
            assert!(acc > 0.9, "shape {shape:?}: accuracy {acc}");
        }
    }

    #[test]
    fn synthetic_darts_size_has_the_right_shapes() {
        let s = load(&synth(512, 1.0), &[1, 3000], 5, 0).unwrap();
        assert_eq!(s.train.samples().size(), vec![410, 1, 3000]);
        assert_eq!(s.val.samples().size(), vec![102, 1, 3000]);
    }

    #[test]
    fn npz_round_trip_and_holdout() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.npz");
        let x = Tensor::arange(10 * 6, (Kind::Int, tch::Device::Cpu)).reshape([10, 2, 3]);
        let y = Tensor::from_slice(&[0i64, 1, 2, 0, 1, 2, 0, 1, 2, 0]);
        Tensor::write_npz(&[("x", &x), ("y", &y)], &p).unwrap();
        let d = Data {
            val_fraction: 0.3,
            ..spec(DataSource::Npz, Some(p.clone()))
        };
        let s = load(&d, &[2, 3], 3, 0).unwrap();
        assert_eq!((s.train.len(), s.val.len()), (7, 3));
        assert_eq!(s.train.samples().kind(), Kind::Float);
        assert_eq!(s.train.samples().size(), vec![7, 2, 3]);
        // Every sample lands in exactly one split, intact (x[i] starts at 6i, y[i] = i % 3).
        let mut seen: Vec<i64> = vec![];
        for part in [&s.train, &s.val] {
            for i in 0..part.len() {
                let first = part.samples().get(i).flatten(0, -1).get(0).double_value(&[]) as i64;
                assert_eq!(first % 6, 0);
                assert_eq!(part.labels().get(i).int64_value(&[]), (first / 6) % 3);
                seen.push(first / 6);
            }
        }
        seen.sort();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        // Same seed, same split; other seeds, other splits.
        assert!(equal(&s.val.samples(), &load(&d, &[2, 3], 3, 0).unwrap().val.samples()));
        assert!((1..20).any(|seed| !equal(&load(&d, &[2, 3], 3, seed).unwrap().val.samples(), &s.val.samples())));
        // A separate validation file replaces the holdout.
        let v = dir.path().join("v.npz");
        Tensor::write_npz(&[("x", &x.narrow(0, 0, 4)), ("y", &y.narrow(0, 0, 4))], &v).unwrap();
        let s = load(
            &Data {
                val_path: Some(v),
                ..d.clone()
            },
            &[6],
            3,
            0,
        )
        .unwrap();
        assert_eq!((s.train.len(), s.val.len()), (10, 4));
        assert_eq!(s.val.samples().size(), vec![4, 6]);
    }

    #[test]
    fn npz_errors() {
        let dir = tempfile::tempdir().unwrap();
        let x = Tensor::zeros([5, 4], (Kind::Float, tch::Device::Cpu));
        let y = Tensor::from_slice(&[0i64, 1, 0, 1, 0]);
        let write = |name: &str, items: &[(&str, &Tensor)]| {
            let p = dir.path().join(name);
            Tensor::write_npz(items, &p).unwrap();
            spec(DataSource::Npz, Some(p))
        };
        let e = err_of(load(&write("noy.npz", &[("x", &x), ("labels", &y)]), &[4], 2, 0));
        assert!(e.contains("no array named \"y\"") && e.contains("labels"), "{e}");
        let e = err_of(load(&write("ok.npz", &[("x", &x), ("y", &y)]), &[100], 2, 0));
        assert!(
            e.contains("[4]") && e.contains("[100]") && e.contains("model.mlp.inputs = 4"),
            "{e}"
        );
        let e = err_of(load(
            &write("short.npz", &[("x", &x), ("y", &y.narrow(0, 0, 3))]),
            &[4],
            2,
            0,
        ));
        assert!(e.contains("5 samples") && e.contains("3 labels"), "{e}");
        let e = err_of(load(&write("range.npz", &[("x", &x), ("y", &(&y * 7))]), &[4], 2, 0));
        assert!(e.contains("up to 7") && e.contains("model.mlp.num_classes = 8"), "{e}");
        let e = err_of(load(
            &write("fy.npz", &[("x", &x), ("y", &y.to_kind(Kind::Float))]),
            &[4],
            2,
            0,
        ));
        assert!(e.contains("integer class indices"), "{e}");
        let p = dir.path().join("junk.npz");
        fs::write(&p, b"not a zip").unwrap();
        let e = err_of(load(&spec(DataSource::Npz, Some(p)), &[4], 2, 0));
        assert!(e.contains("numpy.savez") && e.contains("junk.npz"), "{e}");
    }

    #[test]
    fn safetensors_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.safetensors");
        let x = Tensor::ones([6, 1, 5], (Kind::Double, tch::Device::Cpu));
        let y = Tensor::from_slice(&[0u8, 1, 2, 0, 1, 2]);
        Tensor::write_safetensors(&[("x", &x), ("y", &y)], &p).unwrap();
        let s = load(
            &Data {
                val_fraction: 0.5,
                ..spec(DataSource::Safetensors, Some(p))
            },
            &[1, 5],
            3,
            0,
        )
        .unwrap();
        assert_eq!((s.train.len(), s.val.len()), (3, 3));
        assert_eq!(
            (s.train.samples().kind(), s.train.labels().kind()),
            (Kind::Float, Kind::Int64)
        );
        let p = dir.path().join("nox.safetensors");
        Tensor::write_safetensors(&[("inputs", &x), ("y", &y)], &p).unwrap();
        let e = err_of(load(&spec(DataSource::Safetensors, Some(p)), &[1, 5], 3, 0));
        assert!(e.contains("no array named \"x\"") && e.contains("inputs"), "{e}");
    }

    #[test]
    fn digits_reshape_to_mlp_inputs() {
        let d = spec(DataSource::Npz, Some(digits_path()));
        let s = load(&d, &[64], 10, 0).unwrap();
        assert_eq!(s.train.len() + s.val.len(), 1797);
        assert_eq!(s.val.len(), 359); // round(1797 * 0.2)
        assert_eq!(s.train.samples().size(), vec![1438, 64]);
        for part in [&s.train, &s.val] {
            assert!(part.labels().min().int64_value(&[]) >= 0 && part.labels().max().int64_value(&[]) < 10);
            assert!(part.samples().min().double_value(&[]) >= 0.0 && part.samples().max().double_value(&[]) <= 1.0);
        }
        // Signals the other way round: 8×8 as 8 channels of length 8 works unchanged.
        let s = load(&d, &[8, 8], 10, 0).unwrap();
        assert_eq!(s.val.samples().size(), vec![359, 8, 8]);
        let e = err_of(load(&d, &[100], 10, 0));
        assert!(
            e.contains("samples of shape [8, 8] (64 values)")
                && e.contains("model.mlp.inputs expects [100]")
                && e.contains("set model.mlp.inputs = 64"),
            "{e}"
        );
        let e = err_of(load(&d, &[1, 100], 10, 0));
        assert!(
            e.contains("model.darts.in_channels = 8 and model.darts.input_length = 8"),
            "{e}"
        );
        let e = err_of(load(&d, &[64], 5, 0));
        assert!(e.contains("up to 9") && e.contains("num_classes = 10"), "{e}");
    }

    #[test]
    fn epoch_order_is_a_deterministic_permutation() {
        let a = epoch_order(1000, 5, 0);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_eq!(a, epoch_order(1000, 5, 0));
        assert_ne!(a, epoch_order(1000, 5, 1));
        assert_ne!(a, epoch_order(1000, 6, 0));
        assert_ne!(a, (0..1000).collect::<Vec<_>>());
        assert!(epoch_order(0, 1, 1).is_empty());
        assert_eq!(epoch_order(1, 1, 1), vec![0]);
    }

    fn write_idx(path: &Path, dims: &[u32], data: &[u8]) {
        let mut b = vec![0, 0, 0x08, dims.len() as u8];
        for d in dims {
            b.extend_from_slice(&d.to_be_bytes());
        }
        b.extend_from_slice(data);
        fs::write(path, b).unwrap();
    }

    #[test]
    fn mnist_idx_fixture() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        let images: Vec<u8> = (0..3 * 4 * 4).map(|i| (i * 5) as u8).collect();
        write_idx(&p.join("train-images-idx3-ubyte"), &[3, 4, 4], &images);
        write_idx(&p.join("train-labels-idx1-ubyte"), &[3], &[7, 0, 9]);
        write_idx(&p.join("t10k-images-idx3-ubyte"), &[2, 4, 4], &[255; 32]);
        write_idx(&p.join("t10k-labels-idx1-ubyte"), &[2], &[1, 2]);
        let d = spec(DataSource::Mnist, Some(p.to_path_buf()));
        let s = load(&d, &[16], 10, 0).unwrap();
        assert_eq!(s.train.samples().size(), vec![3, 16]);
        assert_eq!(Vec::<i64>::try_from(&s.train.labels()).unwrap(), vec![7, 0, 9]);
        assert_eq!(Vec::<i64>::try_from(&s.val.labels()).unwrap(), vec![1, 2]);
        let px = s.train.samples().get(1).get(3).double_value(&[]);
        assert!((px - (19.0 * 5.0) / 255.0).abs() < 1e-6, "{px}");
        assert_eq!(s.val.samples().min().double_value(&[]), 1.0);
        // As images with a channel: [1, 4, 4] has the same 16 values.
        let s = load(&d, &[1, 4, 4], 10, 0).unwrap();
        assert_eq!(s.train.samples().size(), vec![3, 1, 4, 4]);
        // Truncated file.
        fs::write(p.join("t10k-labels-idx1-ubyte"), [0, 0, 8, 1, 0, 0, 0, 2, 1]).unwrap();
        let e = err_of(load(&d, &[16], 10, 0));
        assert!(e.contains("truncated"), "{e}");
        // Gzipped files only.
        let gz = tempfile::tempdir().unwrap();
        for n in ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"] {
            fs::write(gz.path().join(n), [0x1f, 0x8b]).unwrap();
        }
        let e = err_of(load(
            &spec(DataSource::Mnist, Some(gz.path().to_path_buf())),
            &[16],
            10,
            0,
        ));
        assert!(e.contains("train-images-idx3-ubyte.gz") && e.contains("gunzip"), "{e}");
        assert!(
            e.contains("lacks train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte"),
            "{e}"
        );
        // Validation from another directory (dotted names, as some mirrors ship them).
        let v = tempfile::tempdir().unwrap();
        write_idx(&v.path().join("t10k-images.idx3-ubyte"), &[1, 4, 4], &[0; 16]);
        write_idx(&v.path().join("t10k-labels.idx1-ubyte"), &[1], &[3]);
        let s = load(
            &Data {
                val_path: Some(v.path().to_path_buf()),
                ..d.clone()
            },
            &[16],
            10,
            0,
        )
        .unwrap();
        assert_eq!((s.train.len(), s.val.len()), (3, 1));
    }
}
