//! The search `fit` runs for one setting, and the choice among settings, apart from how a
//! probe is carried out (so both are tested without libtorch).
use serde::Serialize;

/// What one probe measured at one micro-batch.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measured {
    pub micro_batch: i64,
    pub fits: bool,
    /// Peak memory over the probe's steps (reserved on CUDA, allocated CPU tensor bytes on the
    /// CPU); absent when it ran out of memory.
    pub peak_bytes: Option<u64>,
    /// Over the steps after the first (the first pays for warm-up).
    pub samples_per_s: Option<f64>,
}

impl Measured {
    /// A probe at `micro_batch` that did not fit: nothing measured.
    pub fn out_of_memory(micro_batch: i64) -> Measured {
        Measured {
            micro_batch,
            fits: false,
            peak_bytes: None,
            samples_per_s: None,
        }
    }
}

/// The largest micro-batch in `1..=max` that fits, by doubling from 1 until a probe fails (or
/// `max` fits), then bisecting between the last fit and the first failure. Assumes memory
/// grows with the micro-batch. `None` when even 1 does not fit.
pub fn largest_fit<E>(max: i64, mut probe: impl FnMut(i64) -> Result<Measured, E>) -> Result<Option<Measured>, E> {
    let mut best: Option<Measured> = None;
    let mut fail: Option<i64> = None;
    let mut b = 1;
    loop {
        let m = probe(b)?;
        if !m.fits {
            fail = Some(b);
            break;
        }
        best = Some(m);
        if b >= max {
            break;
        }
        b = (b * 2).min(max);
    }
    if let Some(mut hi) = fail {
        let mut lo = best.as_ref().map_or(0, |m| m.micro_batch);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            let m = probe(mid)?;
            if m.fits {
                lo = mid;
                best = Some(m);
            } else {
                hi = mid;
            }
        }
    }
    Ok(best)
}

/// The largest divisor of `effective` that is at most `limit`: the micro-batch that keeps the
/// effective batch with a whole number of accumulation steps.
pub fn micro_batch_for(effective: i64, limit: i64) -> Option<i64> {
    (1..=limit.min(effective)).rev().find(|d| effective % d == 0)
}

/// How much faster a later candidate must measure to displace an earlier one: a few steps'
/// throughput is noisy, and earlier settings (the spec's own first) change less.
pub const FASTER_BY: f64 = 1.10;

/// The fastest of the candidates (setting index, measured), in order: a later one wins only
/// when it is more than 10% faster than the best so far.
pub fn fastest(candidates: &[(usize, Measured)]) -> Option<&(usize, Measured)> {
    candidates
        .iter()
        .fold(None, |best: Option<&(usize, Measured)>, c| match best {
            Some(b) if c.1.samples_per_s.unwrap_or(0.0) <= b.1.samples_per_s.unwrap_or(0.0) * FASTER_BY => Some(b),
            _ => Some(c),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe that fits up to `limit`, recording what was asked.
    fn fake(limit: i64, asked: &mut Vec<i64>) -> impl FnMut(i64) -> Result<Measured, ()> + '_ {
        move |b| {
            asked.push(b);
            Ok(Measured {
                micro_batch: b,
                fits: b <= limit,
                peak_bytes: (b <= limit).then_some(b as u64 * 100),
                samples_per_s: Some(b as f64),
            })
        }
    }

    #[test]
    fn doubles_then_bisects_to_the_exact_largest_fit() {
        for limit in 1..=70 {
            let mut asked = vec![];
            let got = largest_fit(64, fake(limit, &mut asked)).unwrap().unwrap();
            assert_eq!(got.micro_batch, limit.min(64), "limit {limit}: asked {asked:?}");
            assert!(asked.len() <= 13, "limit {limit}: {} probes {asked:?}", asked.len());
        }
        let mut asked = vec![];
        largest_fit(64, fake(11, &mut asked)).unwrap();
        assert_eq!(asked, [1, 2, 4, 8, 16, 12, 10, 11]);
        let mut asked = vec![];
        largest_fit(24, fake(100, &mut asked)).unwrap();
        assert_eq!(asked, [1, 2, 4, 8, 16, 24], "the last doubling stops at the maximum");
    }

    #[test]
    fn nothing_fits_when_one_does_not() {
        let mut asked = vec![];
        assert_eq!(largest_fit(64, fake(0, &mut asked)).unwrap(), None);
        assert_eq!(asked, [1]);
    }

    #[test]
    fn the_micro_batch_divides_the_effective_batch() {
        assert_eq!(micro_batch_for(32, 11), Some(8));
        assert_eq!(micro_batch_for(32, 32), Some(32));
        assert_eq!(micro_batch_for(32, 100), Some(32));
        assert_eq!(micro_batch_for(24, 7), Some(6));
        assert_eq!(micro_batch_for(13, 12), Some(1));
        assert_eq!(micro_batch_for(13, 0), None);
    }

    #[test]
    fn the_fastest_wins_unless_within_noise_of_an_earlier_one() {
        let m = |r: f64| Measured {
            micro_batch: 1,
            fits: true,
            peak_bytes: None,
            samples_per_s: Some(r),
        };
        assert_eq!(fastest(&[(0, m(5.0)), (1, m(7.0)), (2, m(6.0))]).unwrap().0, 1);
        assert_eq!(
            fastest(&[(0, m(5.0)), (1, m(7.0)), (2, m(7.5))]).unwrap().0,
            1,
            "7.5 is within 10% of 7"
        );
        assert_eq!(fastest(&[(0, m(5.0)), (1, m(5.4))]).unwrap().0, 0);
        assert!(fastest(&[]).is_none());
    }
}
