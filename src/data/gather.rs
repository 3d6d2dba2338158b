//! A batch made from stored samples, in plain Rust off libtorch's allocator: each sample is read
//! from its store (memory or a map), converted to float32, divided, normalized and augmented
//! into a staging buffer (a resized crop and colour jitter work on the pixels before they are
//! normalized). Every value is computed with the float32 operations, in the order, that
//! `Tensor::to_kind`, `/` and `(x - mean) / std` use, so a batch is bit for bit the one a tensor
//! pipeline would make. A batch depends only on its sample indices and epoch; the loader's
//! threads call this in any order.
use std::sync::Arc;

use super::augment::Augmenter;
use super::store::Store;

/// How a batch is made from stored samples.
#[derive(Debug, Clone, Default)]
pub struct Recipe {
    /// x / divisor once float32 (uint8 pixels: 255).
    pub divisor: Option<f32>,
    /// (x - mean) / std per channel (the sample's first dimension); one value for all.
    pub norm: Option<(Vec<f32>, Vec<f32>)>,
    pub augment: Option<Augmenter>,
    /// The file of float samples not checked for NaN and infinities when opened (read in place,
    /// so opening reads none of them), named as "data.path x.safetensors": each sample is
    /// checked as a batch reads it. None: checked whole when loaded, or integers.
    pub unchecked: Option<Arc<str>>,
}

/// A sample with a NaN or an infinity, found as a batch read it: its file and its index there.
#[derive(Debug)]
pub struct NotFinite {
    pub what: Arc<str>,
    pub row: i64,
}

impl std::fmt::Display for NotFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: x contains NaN or infinite values (sample {}, counting from 0); replace or drop that sample",
            self.what, self.row
        )
    }
}

/// A batch staged on the host: float32 samples (or int64 token ids) and int64 labels (a class
/// a sample, or a target a token).
#[derive(Debug, Default)]
pub struct Staged {
    pub x: Vec<f32>,
    /// Token sets: the token ids, `x` stays empty.
    pub tokens: Vec<i64>,
    pub y: Vec<i64>,
}

/// What a set's labels are.
#[derive(Debug, Clone, Default)]
pub enum Targets {
    /// One class index a sample, in `labels`.
    #[default]
    Classes,
    /// Token windows of `seq_len + 1` tokens a stored row: x is a row's first `seq_len`, y its
    /// last `seq_len` (the next token of each).
    Next,
    /// Token ids with targets of their own, row for row (`[N, seq_len]`, -100 where a token
    /// carries no loss).
    Stored(Arc<Store>),
}

/// Everything a batch is made from, cheap to clone for the loader's threads.
#[derive(Debug, Clone)]
pub struct Source {
    pub store: Arc<Store>,
    pub labels: Arc<Vec<i64>>,
    /// This set's rows of the store; None: all of them, in order.
    pub rows: Option<Arc<Vec<i64>>>,
    pub recipe: Arc<Recipe>,
    pub targets: Targets,
}

impl Source {
    pub fn len(&self) -> i64 {
        match (&self.rows, &self.targets) {
            (Some(r), _) => r.len() as i64,
            (None, Targets::Classes) => self.labels.len() as i64,
            (None, _) => self.store.shape[0],
        }
    }

    /// Whether the samples are token ids, each token with its own target.
    pub fn is_tokens(&self) -> bool {
        !matches!(self.targets, Targets::Classes)
    }

    /// The shape of one sample as the model takes it.
    pub fn sample_shape(&self) -> Vec<i64> {
        match self.targets {
            Targets::Next => vec![self.store.shape[1] - 1],
            _ => self.store.shape[1..].to_vec(),
        }
    }

    /// Labels one sample has: 1 (its class), or one a token.
    pub fn labels_per_sample(&self) -> usize {
        match self.targets {
            Targets::Classes => 1,
            _ => self.sample_shape().iter().product::<i64>() as usize,
        }
    }

    fn row(&self, k: i64) -> i64 {
        match &self.rows {
            Some(r) => r[k as usize],
            None => k,
        }
    }

    /// Bytes of one staged sample and its labels: float32 values and a label, or int64 tokens
    /// and targets.
    pub fn sample_bytes(&self) -> u64 {
        match self.targets {
            Targets::Classes => self.store.sample_values() as u64 * 4 + 8,
            _ => self.labels_per_sample() as u64 * 16,
        }
    }

    /// Token windows `idx` into `out`: int64 ids and their targets.
    fn gather_tokens(&self, idx: &[i64], out: &mut Staged) {
        let per = self.labels_per_sample();
        out.x.clear();
        out.tokens.clear();
        out.tokens.resize(idx.len() * per, 0);
        out.y.clear();
        out.y.resize(idx.len() * per, 0);
        let mut window = vec![0i64; per + 1];
        let rows = out.tokens.chunks_exact_mut(per).zip(out.y.chunks_exact_mut(per));
        for ((x, y), &k) in rows.zip(idx) {
            let r = self.row(k);
            match &self.targets {
                Targets::Next => {
                    self.store.elem.to_i64(self.store.row(r), &mut window);
                    x.copy_from_slice(&window[..per]);
                    y.copy_from_slice(&window[1..]);
                }
                Targets::Stored(t) => {
                    self.store.elem.to_i64(self.store.row(r), x);
                    t.elem.to_i64(t.row(r), y);
                }
                Targets::Classes => unreachable!("class sets gather float samples"),
            }
        }
    }

    /// The samples `idx` (indices into this set) of `epoch` into `out`, whose buffers are
    /// reused.
    pub fn gather_into(&self, idx: &[i64], epoch: i64, out: &mut Staged) -> Result<(), NotFinite> {
        if self.is_tokens() {
            self.gather_tokens(idx, out);
            return Ok(());
        }
        let per = self.store.sample_values();
        out.x.clear();
        out.x.resize(idx.len() * per, 0.0);
        out.y.clear();
        out.y.extend(idx.iter().map(|&k| self.labels[self.row(k) as usize]));
        let (mut scratch, mut tmp) = (vec![], vec![]);
        for (o, &k) in out.x.chunks_exact_mut(per.max(1)).zip(idx) {
            match &self.recipe.augment {
                Some(a) => {
                    scratch.resize(per, 0.0);
                    let [c, h, w] = self.store.shape[1..] else {
                        unreachable!("augmentation is refused for samples other than [C, H, W]")
                    };
                    if a.on_pixels() {
                        self.pixels(self.row(k), &mut scratch)?;
                        a.pixels_into(&mut scratch, [c, h, w], epoch, k, &mut tmp);
                        self.normalize(&mut scratch);
                    } else {
                        self.convert(self.row(k), &mut scratch)?;
                    }
                    a.crop_into(&scratch, [c, h, w], a.draw(epoch, k), o);
                }
                None => self.convert(self.row(k), o)?,
            }
        }
        Ok(())
    }

    /// Stored sample `r` as float32, divided and normalized, into `out`.
    fn convert(&self, r: i64, out: &mut [f32]) -> Result<(), NotFinite> {
        self.pixels(r, out)?;
        self.normalize(out);
        Ok(())
    }

    /// Stored sample `r` as float32 and divided (pixels in [0, 1]), into `out`.
    fn pixels(&self, r: i64, out: &mut [f32]) -> Result<(), NotFinite> {
        self.store.elem.to_f32(self.store.row(r), out);
        if let Some(what) = &self.recipe.unchecked {
            if !out.iter().all(|v| v.is_finite()) {
                return Err(NotFinite {
                    what: what.clone(),
                    row: r,
                });
            }
        }
        if let Some(d) = self.recipe.divisor {
            out.iter_mut().for_each(|v| *v /= d);
        }
        Ok(())
    }

    /// `(x - mean) / std` per channel, in place.
    fn normalize(&self, out: &mut [f32]) {
        if let Some((mean, std)) = &self.recipe.norm {
            let plane = out.len() / self.store.shape.get(1).copied().unwrap_or(1).max(1) as usize;
            for (i, v) in out.iter_mut().enumerate() {
                let c = if mean.len() == 1 { 0 } else { i / plane.max(1) };
                *v = (*v - mean[c]) / std[c];
            }
        }
    }
}
