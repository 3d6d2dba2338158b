//! A set as training reads it: its samples (in memory or mapped), labels and rows, the recipe
//! that turns them into float32 batches, and where those batches are made (in the step, ahead of
//! it by the [`Loader`], or on a device the set is kept on).
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::augment::Augmenter;
use super::gather::{NotFinite, Recipe, Source, Staged, Targets};
use super::loader::Loader;
use super::store::Store;
use crate::spec::schema::Data;

/// A set's samples as stored, in memory or mapped from their file: images stay uint8 (a
/// quarter of float32), other integer data in its own type, float data as float32. A batch is
/// gathered from them and only then converted to float32, divided (images: by 255) and
/// normalized, the same elementwise operations a whole-set conversion would make, so the values
/// are the same. A held-out split is a list of rows into the file's samples, not a copy of them.
#[derive(Debug)]
pub struct Dataset {
    pub(super) source: Source,
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
    /// A sample that is not finite, found when the set was copied over: the first batch says so.
    bad: Option<NotFinite>,
}

impl Dataset {
    pub fn new(x: Tensor, y: Tensor) -> Self {
        let store = Store::memory(x).expect("samples of a stored element type");
        Dataset::of(
            store,
            Vec::<i64>::try_from(&y.to_kind(Kind::Int64)).expect("int64 labels"),
        )
    }

    pub(super) fn of(store: Store, labels: Vec<i64>) -> Self {
        Dataset::from_source(Source {
            store: Arc::new(store),
            labels: Arc::new(labels),
            rows: None,
            recipe: Arc::new(Recipe::default()),
            targets: Targets::Classes,
        })
    }

    /// A set of token ids `store`, whose labels are `targets` (not classes).
    pub(super) fn tokens(store: Store, targets: Targets) -> Self {
        debug_assert!(!matches!(targets, Targets::Classes));
        Dataset::from_source(Source {
            store: Arc::new(store),
            labels: Arc::new(vec![]),
            rows: None,
            recipe: Arc::new(Recipe::default()),
            targets,
        })
    }

    /// The targets of samples `idx` that carry loss, where the set's shape alone says it: every
    /// next token of a token file does. None where targets of their own may be ignored.
    pub fn plain_target_count(&self, idx: &[i64]) -> Option<u64> {
        matches!(self.source.targets, Targets::Next).then(|| idx.len() as u64 * self.source.labels_per_sample() as u64)
    }

    /// Whether the samples are token ids (int64 batches, a target a token).
    pub fn is_tokens(&self) -> bool {
        self.source.is_tokens()
    }

    pub(super) fn from_source(source: Source) -> Self {
        Dataset {
            source,
            resident: None,
            loader: None,
            wait_ns: AtomicU64::new(0),
        }
    }

    pub(super) fn recipe(&mut self) -> &mut Recipe {
        Arc::make_mut(&mut self.source.recipe)
    }

    /// Samples divided by `d` once they are float32 (uint8 pixels to [0, 1]).
    pub(super) fn divided_by(mut self, d: f64) -> Self {
        self.recipe().divisor = Some(d as f32);
        self
    }

    /// The set of `rows` of this one, sharing its samples.
    pub(super) fn rows(&self, rows: &[i64]) -> Self {
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

    /// Each label `l` becomes `map[l]` (another folder's classes as the model numbers them).
    pub fn relabel(&mut self, map: &[i64]) {
        let labels = Arc::make_mut(&mut self.source.labels);
        labels.iter_mut().for_each(|l| *l = map[*l as usize]);
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
                self.source.gather_into(idx, epoch, &mut s).map(|()| s)
            }
        };
        // Inside the step's guard, which turns the panic into the run's error.
        let staged = staged.unwrap_or_else(|e| panic!("{e}"));
        self.wait_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let xy = self.tensors(&staged);
        if let Some(l) = &self.loader {
            l.give_back(staged);
        }
        xy
    }

    /// A staged batch as CPU tensors `(x, y)`.
    fn tensors(&self, s: &Staged) -> (Tensor, Tensor) {
        let mut shape = vec![(s.y.len() / self.source.labels_per_sample().max(1)) as i64];
        shape.extend(self.sample_shape());
        if self.is_tokens() {
            // Token ids stay integers: the model embeds them.
            return (
                Tensor::from_slice(&s.tokens).view(shape.as_slice()),
                Tensor::from_slice(&s.y).view(shape.as_slice()),
            );
        }
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
        // The copy reads every sample anyway: a set checked as it is read is checked here.
        let bad = self.source.recipe.unchecked.as_ref().and_then(|what| {
            let store = &self.source.store;
            let mut v = vec![0f32; store.sample_values()];
            let row = (0..store.shape[0]).find(|&r| {
                store.elem.to_f32(store.row(r), &mut v);
                !v.iter().all(|x| x.is_finite())
            })?;
            Some(NotFinite {
                what: what.clone(),
                row,
            })
        });
        self.resident = Some(Resident {
            bad,
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
        self.source.sample_shape()
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
            plain.gather_into(&idx, 0, &mut s).unwrap_or_else(|e| panic!("{e}"));
            return self.tensors(&s);
        };
        if let Some(bad) = &r.bad {
            panic!("{bad}");
        }
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
    /// Token sets never do: a batch of token ids is small beside the step it feeds.
    pub fn stay_resident(&self, device: Device, budget: Option<u64>) -> bool {
        let small = |b: u64| (self.train.bytes() + self.val.bytes()).saturating_mul(RESIDENT_SHARE) <= b;
        let plain = self.train.augment().is_none() && self.val.augment().is_none() && !self.train.is_tokens();
        device.is_cuda() && plain && budget.is_some_and(small)
    }
}

/// Threads `data.workers` asks for: 0 means one per core.
pub fn workers(data: &Data) -> usize {
    match data.workers {
        w if w > 0 => w as usize,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get()),
    }
}
