//! Data sources (`data.source`), one file each behind [`Reader`]: each probes its sample shape,
//! opens its samples (in memory or mapped) with their labels, and says how `check` should describe
//! the way it reads them. What they share (the checks against the model, the held-out split,
//! normalization, augmentation and the loader) happens once, in the caller.
//!
//! A new source: copy `synthetic.rs` (or `safetensors.rs` for a file), add its variant to
//! `spec::DataSource` and one line to [`reader`].
use std::path::Path;

use anyhow::Result;
use tch::Tensor;

use super::gather::Targets;
use super::store::Store;
use crate::spec::schema::{Data, DataSource};

mod arrays;
mod cifar10;
pub(super) mod imagefolder;
pub(crate) mod jsonl;
mod mnist;
pub(super) mod npz;
mod safetensors;
mod synthetic;
mod token_cache;
mod tokens;

/// The reader of each source: the one place where sources are listed.
pub(super) fn reader(source: DataSource) -> &'static dyn Reader {
    match source {
        DataSource::Synthetic => &synthetic::Synthetic,
        DataSource::Npz => &npz::Npz,
        DataSource::Safetensors => &safetensors::Safetensors,
        DataSource::Mnist => &mnist::Mnist,
        DataSource::Cifar10 => &cifar10::Cifar10,
        DataSource::Imagefolder => &imagefolder::ImageFolder,
        DataSource::Tokens => &tokens::Tokens,
        DataSource::Jsonl => &jsonl::Jsonl,
    }
}

/// One data source.
pub(super) trait Reader: Sync {
    /// The shape of one sample as the source has it of its own, read cheaply (file headers, not
    /// the samples), at `path` (`data.path`); None where the data follows the model.
    fn sample_shape(&self, data: &Data, path: &Path) -> Result<Option<Vec<i64>>>;

    /// The training samples and labels, and the validation ones where the source has them apart
    /// (else they are held out of the training set by `data.val_fraction`).
    fn open(&self, want: &Want) -> Result<Opened>;

    /// How `check` says the set is read (after "the set ").
    fn how_read(&self, data: &Data) -> &'static str;

    /// The classes of the set at `path` (`data.path`) and `data.val_path`, read cheaply (the
    /// labels alone where the file allows); None where the data follows the model.
    fn classes(&self, data: &Data, path: &Path) -> Result<Option<DataClasses>>;

    /// How many samples `check` says the set has, where that is cheap to know ("1,024
    /// windows of 256 tokens"); None where it is not.
    fn extent(&self, _data: &Data) -> Option<String> {
        None
    }

    /// What `open` would refuse that `check` can see cheaply, against the model's vocabulary
    /// where it has one.
    fn check(&self, _data: &Data, _vocab: Option<i64>) -> Result<()> {
        Ok(())
    }
}

/// What a run asks of a source.
pub(super) struct Want<'a> {
    pub data: &'a Data,
    /// The model's per-sample shape.
    pub input_shape: &'a [i64],
    pub num_classes: i64,
    pub seed: i64,
}

/// Samples and labels as a source opened them, not yet checked against the model.
pub(super) struct Part {
    pub x: Store,
    pub y: Tensor,
    /// The key and file they came from, for errors: "data.path foo.npz".
    pub what: String,
    /// What a float32 sample is divided by (uint8 pixels: 255).
    pub divisor: Option<f64>,
    /// Classes (in `y`), or token targets.
    pub targets: Targets,
}

impl Part {
    pub fn new(x: Store, y: Tensor, what: String) -> Part {
        Part {
            x,
            y,
            what,
            divisor: None,
            targets: Targets::Classes,
        }
    }

    /// Token ids `x` with `targets` (not classes).
    pub fn tokens(x: Store, targets: Targets, what: String) -> Part {
        Part {
            targets,
            ..Part::new(x, Tensor::new(), what)
        }
    }

    /// Pixels, divided by 255 once float32.
    pub fn pixels(self) -> Part {
        Part {
            divisor: Some(255.0),
            ..self
        }
    }
}

/// Where a source with a test split of its own reads validation from: `data.val_path`, else its
/// test files beside the training ones in `data.path` (`dir`).
fn val_dir<'a>(data: &'a Data, dir: &'a Path) -> (&'static str, &'a Path) {
    match &data.val_path {
        Some(v) => ("data.val_path", v.as_path()),
        None => ("data.path", dir),
    }
}

/// Pixels read whole: the samples and labels `read` gets from `files` (named by `key` in its
/// errors), stored as `what` and divided by 255 once float32.
fn pixel_part(
    read: impl Fn(&[std::path::PathBuf], &str) -> Result<(Tensor, Tensor)>,
    files: &[std::path::PathBuf],
    key: &str,
    what: String,
) -> Result<Part> {
    let (x, y) = read(files, key)?;
    Ok(Part::new(super::check::stored(x, &what)?, y, what).pixels())
}

/// A source's sets.
pub(super) struct Opened {
    pub train: Part,
    /// None: held out of `train`.
    pub val: Option<Part>,
}

/// The classes a data set has of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataClasses {
    /// Named classes (an imagefolder's directories), in index order.
    Named(Vec<String>),
    /// Class indices `0..n`, the labels' range (the largest label + 1).
    Range(i64),
}

impl DataClasses {
    pub fn count(&self) -> i64 {
        match self {
            DataClasses::Named(n) => n.len() as i64,
            DataClasses::Range(n) => *n,
        }
    }

    /// How a message names them: "3 classes (cat, dog, fish)" or "labels 0 to 4".
    pub fn describe(&self) -> String {
        match self {
            DataClasses::Named(n) if n.len() <= 8 => format!("{} class(es) ({})", n.len(), n.join(", ")),
            DataClasses::Named(n) => format!("{} classes ({}, ...)", n.len(), n[..8].join(", ")),
            DataClasses::Range(n) => format!("labels 0 to {}, so {n} class(es)", n - 1),
        }
    }
}

/// The largest label + 1 of `labels` (None when there are none).
pub(crate) fn label_range(labels: impl IntoIterator<Item = i64>) -> Option<i64> {
    labels.into_iter().max().map(|m| m.max(0) + 1)
}
