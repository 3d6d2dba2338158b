//! Augmentation of training images: torchvision's `RandomCrop(size, padding)` (the padding
//! filled with black, that is 0 before normalisation) and `RandomHorizontalFlip(0.5)`.
//!
//! Each sample's crop offset and flip are drawn from a generator keyed by (seed, epoch, sample
//! index), never from torch's generator: a resumed run, and a run whose micro-batch an OOM
//! backoff changed, see exactly the same images.
use tch::{Kind, Tensor};

use super::{stream, SplitMix64};

const TAG_AUGMENT: u64 = 0x6175_676d_656e_7400; // "augment"

#[derive(Debug, Clone)]
pub struct Augmenter {
    pub seed: i64,
    pub padding: i64,
    pub flip: bool,
    /// The padding's value per channel: black after normalisation, (0 - mean) / std.
    pub fill: Vec<f64>,
    /// Samples in the training set, so (epoch, index) pairs never share a stream.
    pub samples: i64,
}

/// One sample's draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draw {
    pub dy: i64,
    pub dx: i64,
    pub flip: bool,
}

impl Augmenter {
    pub fn draw(&self, epoch: i64, index: i64) -> Draw {
        let mut r: SplitMix64 = stream(self.seed, TAG_AUGMENT, epoch.wrapping_mul(self.samples).wrapping_add(index));
        let span = 2 * self.padding as u64 + 1;
        let dy = r.below(span) as i64;
        let dx = r.below(span) as i64;
        let flip = self.flip && r.next_u64() >> 63 == 1;
        Draw { dy, dx, flip }
    }

    /// `x` is `[B, C, H, W]` holding the samples `idx` of the training set, in order.
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
