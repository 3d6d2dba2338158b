//! Data sets, one source a file under [`source`] (synthetic, `.npz`, `.safetensors`, MNIST IDX
//! files, CIFAR-10 and image folders), read in place through a memory map where the file allows
//! (the imagefolder cache, an uncompressed npz, safetensors) or loaded into memory on the CPU,
//! and checked against the model's per-sample shape and class count before training starts
//! ([`check`]). Batches are made by [`gather`] (in the step, or ahead of it by the [`loader`]).
//!
//! Without `data.val_path`, npz, safetensors and imagefolder hold out `round(N × val_fraction)`
//! samples (at least one, leaving at least one for training), chosen by a seeded shuffle
//! ([`split`]).
//!
//! Samples whose number of values matches the model's input are reshaped to its shape (8×8
//! images feed an mlp with 64 inputs; `[N, L]` signals feed a darts model expecting `[1, L]`).
//!
//! All randomness here comes from a SplitMix64 keyed by the seed, never from torch's global
//! generator, so splits, synthetic data and epoch orders replay exactly on resume.
use anyhow::{bail, Result};

use crate::human::human_bytes;
use crate::spec::schema::Data;

mod augment;
mod check;
pub mod classes;
mod dataset;
mod gather;
pub mod jitter;
mod loader;
mod mapped;
pub mod resized_crop;
mod rng;
mod source;
mod split;
mod store;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod token_tests;
mod wait;

pub use augment::{Augmenter, Draw};
pub use dataset::{workers, Dataset, Splits};
use jitter::Jitter;
pub use source::jsonl::eos_by_name;
use source::{reader, Opened, Part, Want};
pub use split::epoch_order;
pub use wait::DataWait;

/// Loads the configured source and checks it against the model: each sample of `x` must have
/// shape `input_shape` (the model's per-sample shape) or as many values (then it is reshaped),
/// and `y` must lie in `0..num_classes`. Errors name the file, both shapes and what to change.
pub fn load(data: &Data, input_shape: &[i64], num_classes: i64, seed: i64) -> Result<Splits> {
    let mut s = open(data, input_shape, num_classes, seed)?;
    if s.train.is_tokens() && (!data.mean.is_empty() || data.augment.enabled()) {
        bail!("data.mean/data.std and [data.augment] apply to images, not token ids; remove them");
    }
    if !data.mean.is_empty() {
        for part in [&mut s.train, &mut s.val] {
            part.recipe().norm = Some(normalization(&part.sample_shape(), &data.mean, &data.std)?);
        }
    }
    if data.augment.enabled() {
        let sample = s.train.sample_shape();
        if sample.len() != 3 {
            bail!(
                "data.augment: random crops, flips and colour jitter need images [C, H, W], but the samples have shape {sample:?}; remove [data.augment]"
            );
        }
        let c = sample[0] as usize;
        if data.augment.color_jitter.is_some() && c != 1 && c != 3 {
            bail!(
                "data.augment.color_jitter: adjusts images of 1 or 3 channels (gray or RGB), but the samples have {c} (shape {sample:?}); remove color_jitter"
            );
        }
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
            resized_crop: data.augment.random_resized_crop,
            jitter: data.augment.color_jitter.as_ref().map(Jitter::of),
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

/// The configured source's sets, checked against the model, the validation set held out of the
/// training set where the source has none apart.
fn open(data: &Data, input_shape: &[i64], num_classes: i64, seed: i64) -> Result<Splits> {
    let want = Want {
        data,
        input_shape,
        num_classes,
        seed,
    };
    let Opened { train, val } = reader(data.source).open(&want)?;
    let model = check::ModelKeys::new(input_shape, num_classes);
    let checked = |p: Part| -> Result<Dataset> {
        if !matches!(p.targets, gather::Targets::Classes) {
            return check::checked_tokens(p.x, p.targets, &p.what, &model);
        }
        let d = check::checked_store(p.x, p.y, &p.what, &model)?;
        Ok(match p.divisor {
            Some(v) => d.divided_by(v),
            None => d,
        })
    };
    let what = train.what.clone();
    let train = checked(train)?;
    match val {
        Some(v) => Ok(Splits {
            train,
            val: checked(v)?,
        }),
        None => split::holdout(train, data.val_fraction, seed, &what),
    }
}

/// What loading the data would refuse that can be seen without loading it (a jsonl set's
/// tokenizer against the model's vocabulary, its first document's fields; an image folder's
/// class directory without an image): `check` refuses it as `run` would.
pub fn check_source(data: &Data, vocab: Option<i64>) -> Result<()> {
    reader(data.source)
        .check(data, vocab)
        .map_err(|e| crate::exit::UsageError(format!("{e:#}")).into())
}

/// `check`'s line on the host memory the loader takes: the staged micro-batches of float32
/// samples (token sets: int64 ids and targets), whatever the set's size, and how the set is read.
pub fn check_line(data: &Data, input_shape: &[i64], micro_batch: i64) -> String {
    let values = input_shape.iter().product::<i64>() as u64;
    let (per_sample, what) = match data.source.is_tokens() {
        true => (values * 16, "int64 token ids and targets"),
        false => (values * 4 + 8, "float32"),
    };
    let batch = micro_batch.max(1) as u64 * per_sample;
    // The staged buffers, and the step's batch twice more: as a tensor, and (on a GPU) its
    // pinned copy on the way over.
    let buffers = data.prefetch.max(0) as u64 + 3;
    let shape = input_shape.iter().map(i64::to_string).collect::<Vec<_>>().join("×");
    let source = reader(data.source);
    let read = source.how_read(data);
    let extent = source.extent(data).map(|e| format!(": {e}")).unwrap_or_default();
    format!(
        "data loader      {buffers} micro-batch(es) of {micro_batch} × {shape} {what} (data.prefetch {} + 1 staged, the step's batch as a tensor and its pinned copy) = {} of host memory whatever the set's size, plus 24 bytes a sample (labels, the epoch's order); {} thread(s) (data.workers); the set {read}{extent}",
        data.prefetch,
        human_bytes(buffers * batch),
        workers(data).min(data.prefetch.max(1) as usize),
    )
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
    reader(data.source).sample_shape(data, path)
}
