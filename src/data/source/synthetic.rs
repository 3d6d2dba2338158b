//! `synthetic`: `data.samples` samples of a learnable task, deterministic from the seed: every
//! class has a fixed random template (for `[C, L]` signals with `L >= 16`, a wave whose period
//! is the class's own, 4 to 32 samples, plus two weaker random waves; random values otherwise)
//! and a sample is its class's template plus `data.noise` × N(0, 1). Classes are balanced in
//! both splits.
use std::path::Path;

use anyhow::{bail, Result};
use tch::Tensor;

use super::DataClasses;
use super::{Opened, Part, Reader, Want};
use crate::data::rng::stream;
use crate::data::split::{permutation, val_count};
use crate::data::store::Store;
use crate::spec::schema::Data;

const TAG_TEMPLATES: u64 = 0x7465_6d70_6c61_7465; // "template"
const TAG_SAMPLES: u64 = 0x7361_6d70_6c65_7300; // "samples"

pub struct Synthetic;

impl Reader for Synthetic {
    /// The data follows the model.
    fn sample_shape(&self, _: &Data, _: &Path) -> Result<Option<Vec<i64>>> {
        Ok(None)
    }

    fn open(&self, want: &Want) -> Result<Opened> {
        synthetic(want)
    }

    /// Synthetic samples are made for the model's classes.
    fn classes(&self, _: &Data, _: &Path) -> Result<Option<DataClasses>> {
        Ok(None)
    }

    fn how_read(&self, _: &Data) -> &'static str {
        "generated in memory"
    }
}

fn synthetic(want: &Want) -> Result<Opened> {
    let (data, input_shape, num_classes, seed) = (want.data, want.input_shape, want.num_classes, want.seed);
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
    let make = |count: i64, index: i64, what: &str| -> Part {
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
        let x = Store::memory(Tensor::from_slice(&xs).reshape(&shape)).expect("float32 samples");
        Part::new(x, Tensor::from_slice(&labels), format!("synthetic data ({what})"))
    };
    Ok(Opened {
        train: make(n - n_val, 0, "training"),
        val: Some(make(n_val, 1, "validation")),
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
