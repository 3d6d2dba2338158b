//! Augmentation of training images: torchvision's `RandomResizedCrop` ([`super::resized_crop`])
//! and `ColorJitter` ([`super::jitter`]) on the pixels in [0, 1] before normalisation, then
//! `RandomCrop(size, padding)` (the padding filled with black, that is 0 before normalisation)
//! and `RandomHorizontalFlip(0.5)` on the normalised image.
//!
//! Each sample's crop offset and flip are drawn from a generator keyed by (seed, epoch, sample
//! index), never from torch's generator: a resumed run, and a run whose micro-batch an OOM
//! backoff changed, see exactly the same images.
#[cfg(test)]
use tch::{Kind, Tensor};

use super::jitter::{self, Jitter};
use super::resized_crop::{draw_box, resized_crop_into};
use super::rng::{stream, SplitMix64};
use crate::spec::schema::ResizedCrop;

const TAG_AUGMENT: u64 = 0x6175_676d_656e_7400; // "augment"
                                                // Streams of their own, so the crop-and-flip draws stay those of runs without them.
const TAG_RESIZED_CROP: u64 = 0x7272_635f_626f_7800; // "rrc_box"
const TAG_JITTER: u64 = 0x6a69_7474_6572_0000; // "jitter"

#[derive(Debug, Clone)]
pub struct Augmenter {
    pub seed: i64,
    pub padding: i64,
    pub flip: bool,
    /// The padding's value per channel: black after normalisation, (0 - mean) / std.
    pub fill: Vec<f64>,
    /// Samples in the training set, so (epoch, index) pairs never share a stream.
    pub samples: i64,
    pub resized_crop: Option<ResizedCrop>,
    pub jitter: Option<Jitter>,
}

/// One sample's draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draw {
    pub dy: i64,
    pub dx: i64,
    pub flip: bool,
}

impl Augmenter {
    fn stream(&self, tag: u64, epoch: i64, index: i64) -> SplitMix64 {
        stream(self.seed, tag, epoch.wrapping_mul(self.samples).wrapping_add(index))
    }

    /// Whether some augmentation works on the pixels before they are normalised.
    pub fn on_pixels(&self) -> bool {
        self.resized_crop.is_some() || self.jitter.is_some()
    }

    /// The resized crop and colour jitter of sample `index` in `epoch`, in place on `img`
    /// (`[C, H, W]`, values in [0, 1]); `tmp` is scratch.
    pub fn pixels_into(&self, img: &mut [f32], [c, h, w]: [i64; 3], epoch: i64, index: i64, tmp: &mut Vec<f32>) {
        let shape = [c as usize, h as usize, w as usize];
        if let Some(rc) = &self.resized_crop {
            let b = draw_box(rc, shape[1], shape[2], &mut self.stream(TAG_RESIZED_CROP, epoch, index));
            let src = img.to_vec();
            resized_crop_into(&src, shape, b, img, tmp);
        }
        if let Some(j) = &self.jitter {
            let adjust = j.draw(&mut self.stream(TAG_JITTER, epoch, index));
            jitter::apply(&adjust, img, shape[0]);
        }
    }

    pub fn draw(&self, epoch: i64, index: i64) -> Draw {
        let mut r: SplitMix64 = self.stream(TAG_AUGMENT, epoch, index);
        let span = 2 * self.padding as u64 + 1;
        let dy = r.below(span) as i64;
        let dx = r.below(span) as i64;
        let flip = self.flip && r.next_u64() >> 63 == 1;
        Draw { dy, dx, flip }
    }

    /// One sample `src` (`[C, H, W]`, float32) cropped and flipped by `d` into `out`: padded
    /// pixel (y, x) is `src[y - p][x - p]` inside the image and the channel's fill outside; the
    /// crop starts at (dy, dx) and a flip reads its columns right to left.
    pub fn crop_into(&self, src: &[f32], [c, h, w]: [i64; 3], d: Draw, out: &mut [f32]) {
        let p = self.padding;
        let (h, w) = (h as usize, w as usize);
        for ch in 0..c as usize {
            // As a tensor pipeline makes it: zeros + fill, in float32.
            let fill = 0.0f32 + self.fill[ch.min(self.fill.len() - 1)] as f32;
            let plane = &src[ch * h * w..(ch + 1) * h * w];
            for r in 0..h {
                let sy = r as i64 + d.dy - p;
                let row = &mut out[(ch * h + r) * w..(ch * h + r + 1) * w];
                if !(0..h as i64).contains(&sy) {
                    row.fill(fill);
                    continue;
                }
                let line = &plane[sy as usize * w..(sy as usize + 1) * w];
                for (k, o) in row.iter_mut().enumerate() {
                    let col = if d.flip { w - 1 - k } else { k };
                    let sx = col as i64 + d.dx - p;
                    *o = if (0..w as i64).contains(&sx) {
                        line[sx as usize]
                    } else {
                        fill
                    };
                }
            }
        }
    }

    /// `x` is `[B, C, H, W]` holding the samples `idx` of the training set, in order.
    #[cfg(test)]
    pub fn apply(&self, x: &Tensor, idx: &[i64], epoch: i64) -> Tensor {
        let (b, c, h, w) = x.size4().expect("augmentation needs images [N, C, H, W]");
        let p = self.padding;
        let src = if p > 0 {
            let fill = Tensor::from_slice(&self.fill).to_kind(x.kind()).view([1, c, 1, 1]);
            let padded = Tensor::zeros([b, c, h + 2 * p, w + 2 * p], (x.kind(), x.device())) + fill;
            padded.narrow(2, p, h).narrow(3, p, w).copy_(x);
            padded
        } else {
            x.shallow_clone()
        };
        let out: Vec<Tensor> = idx
            .iter()
            .enumerate()
            .map(|(i, &k)| {
                let d = self.draw(epoch, k);
                let s = src.get(i as i64).narrow(1, d.dy, h).narrow(2, d.dx, w);
                if d.flip {
                    s.flip([2])
                } else {
                    s
                }
            })
            .collect();
        Tensor::stack(&out, 0).to_kind(Kind::Float).contiguous()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aug(padding: i64, flip: bool) -> Augmenter {
        Augmenter {
            seed: 1,
            padding,
            flip,
            fill: vec![-1.0],
            samples: 100,
            resized_crop: None,
            jitter: None,
        }
    }

    #[test]
    fn draws_are_keyed_by_seed_epoch_and_sample() {
        let a = aug(4, true);
        assert_eq!(a.draw(0, 5), a.draw(0, 5));
        let draws: Vec<Draw> = (0..100).map(|i| a.draw(0, i)).collect();
        assert!(draws.iter().all(|d| (0..=8).contains(&d.dy) && (0..=8).contains(&d.dx)));
        let flips = draws.iter().filter(|d| d.flip).count();
        assert!((30..=70).contains(&flips), "{flips} of 100 flipped");
        assert_ne!(draws, (0..100).map(|i| a.draw(1, i)).collect::<Vec<_>>());
        assert!(
            aug(0, false).draw(3, 3)
                == Draw {
                    dy: 0,
                    dx: 0,
                    flip: false
                }
        );
    }

    #[test]
    fn crops_shift_and_flips_mirror() {
        let x = Tensor::arange(16, tch::kind::FLOAT_CPU).view([1, 1, 4, 4]) + 1.0;
        let a = aug(1, true);
        // Find samples with known draws, and check what each produced.
        for k in 0..40 {
            let d = a.draw(0, k);
            let out = a.apply(&x, &[k], 0).get(0).get(0);
            let v = |r: i64, c: i64| out.double_value(&[r, c]);
            // Padded pixel (py, px) holds x[py-1][px-1], or the fill -1 outside.
            let want = |r: i64, c: i64| {
                let c = if d.flip { 3 - c } else { c };
                let (py, px) = (r + d.dy - 1, c + d.dx - 1);
                if (0..4).contains(&py) && (0..4).contains(&px) {
                    (py * 4 + px + 1) as f64
                } else {
                    -1.0
                }
            };
            for r in 0..4 {
                for c in 0..4 {
                    assert_eq!(v(r, c), want(r, c), "sample {k} draw {d:?} at ({r}, {c})");
                }
            }
        }
    }
}
