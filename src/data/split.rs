//! Splitting and ordering, from a SplitMix64 keyed by the seed, never from torch's global
//! generator, so that held-out splits and epoch orders replay exactly on resume.
use anyhow::{bail, Result};

use super::dataset::{Dataset, Splits};
use super::rng::{stream, SplitMix64};

const TAG_EPOCH: u64 = 0x6570_6f63_685f_6f72; // "epoch_or"
const TAG_HOLDOUT: u64 = 0x686f_6c64_6f75_7400; // "holdout"

/// Deterministic permutation of `0..n` for `(seed, epoch)`, independent of torch's RNG, so a
/// resumed run replays exactly the same order. Empty for `n <= 0`.
pub fn epoch_order(n: i64, seed: i64, epoch: i64) -> Vec<i64> {
    permutation(n, &mut stream(seed, TAG_EPOCH, epoch))
}

/// Fisher–Yates shuffle of `0..n`.
pub(super) fn permutation(n: i64, rng: &mut SplitMix64) -> Vec<i64> {
    let mut v: Vec<i64> = (0..n.max(0)).collect();
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
    v
}

/// Validation count for `n` samples: round(n × fraction), at least 1, leaving at least 1.
pub(super) fn val_count(n: i64, fraction: f64) -> i64 {
    ((n as f64 * fraction).round() as i64).clamp(1, n - 1)
}

/// Splits `all` into a seeded, shuffled holdout of `round(N × fraction)` samples and the rest;
/// both keep the file's order.
pub(super) fn holdout(all: Dataset, fraction: f64, seed: i64, what: &str) -> Result<Splits> {
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
