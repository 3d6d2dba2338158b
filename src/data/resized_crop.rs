//! torchvision's `RandomResizedCrop(size, scale, ratio)` on one float32 image `[C, H, W]`, the
//! output the image's own size: a box drawn as `transforms.v2.RandomResizedCrop.make_params`
//! draws it (ten tries of an area share and a log-uniform aspect ratio, then the central crop),
//! cut out and resized back with `antialias=True` bilinear interpolation, computed as libtorch's
//! CPU kernel (`_upsample_bilinear2d_aa`) computes it: separable, width first, its float32
//! weights per output pixel normalised to sum to 1.
//!
//! The draws come from the data's own generator, not torch's: the box's distribution is
//! torchvision's, its values are not. Given a box, the pixels equal torchvision's
//! `F.resized_crop(img, top, left, height, width, size, antialias=True)` within 5e-7 (the sums'
//! order and fused multiply-adds in libtorch's vector code differ at the last bit).
use super::rng::SplitMix64;
use crate::spec::schema::ResizedCrop;

/// A crop box in the image's pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropBox {
    pub top: usize,
    pub left: usize,
    pub height: usize,
    pub width: usize,
}

/// The box `RandomResizedCrop.make_params` would draw on an `h`×`w` image, with `r`'s draws.
pub(crate) fn draw_box(c: &ResizedCrop, h: usize, w: usize, r: &mut SplitMix64) -> CropBox {
    let area = (h * w) as f64;
    let (lr0, lr1) = (c.ratio[0].ln(), c.ratio[1].ln());
    let uniform = |r: &mut SplitMix64, lo: f64, hi: f64| lo + (hi - lo) * r.unit();
    for _ in 0..10 {
        let target = area * uniform(r, c.scale[0], c.scale[1]);
        let aspect = uniform(r, lr0, lr1).exp();
        // Python's round: halves to even.
        let bw = (target * aspect).sqrt().round_ties_even() as usize;
        let bh = (target / aspect).sqrt().round_ties_even() as usize;
        if 0 < bw && bw <= w && 0 < bh && bh <= h {
            let top = r.below((h - bh + 1) as u64) as usize;
            let left = r.below((w - bw + 1) as u64) as usize;
            return CropBox {
                top,
                left,
                height: bh,
                width: bw,
            };
        }
    }
    central_box(c, h, w)
}

/// The fallback: the whole image, or its centre at the nearest allowed aspect ratio.
fn central_box(c: &ResizedCrop, h: usize, w: usize) -> CropBox {
    let in_ratio = w as f64 / h as f64;
    let (rmin, rmax) = (c.ratio[0].min(c.ratio[1]), c.ratio[0].max(c.ratio[1]));
    let (bh, bw) = if in_ratio < rmin {
        ((w as f64 / rmin).round_ties_even() as usize, w)
    } else if in_ratio > rmax {
        (h, (h as f64 * rmax).round_ties_even() as usize)
    } else {
        (h, w)
    };
    CropBox {
        top: (h - bh) / 2,
        left: (w - bw) / 2,
        height: bh,
        width: bw,
    }
}

/// One axis of the resize: for each output pixel, the first input pixel it reads and the
/// weights of those it reads, as libtorch's `_compute_weights_aa` makes them in float32.
struct Taps {
    first: Vec<usize>,
    weights: Vec<Vec<f32>>,
}

fn taps(input: usize, output: usize) -> Taps {
    let scale = input as f32 / output as f32;
    let support: f32 = if scale >= 1.0 { (scale as f64) as f32 } else { 1.0 };
    let invscale: f32 = if scale >= 1.0 { (1.0 / scale as f64) as f32 } else { 1.0 };
    let filter = |x: f32| -> f32 {
        let x = x.abs();
        if x < 1.0 {
            (1.0 - x as f64) as f32
        } else {
            0.0
        }
    };
    let mut t = Taps {
        first: Vec::with_capacity(output),
        weights: Vec::with_capacity(output),
    };
    for i in 0..output {
        let center = (scale as f64 * (i as f64 + 0.5)) as f32;
        let xmin = (((center - support) as f64 + 0.5) as i64).max(0);
        let xsize = ((((center + support) as f64) + 0.5) as i64).min(input as i64) - xmin;
        let mut w: Vec<f32> = (0..xsize.max(0))
            .map(|j| filter(((((j + xmin) as f32 - center) as f64 + 0.5) * invscale as f64) as f32))
            .collect();
        let total: f32 = w.iter().fold(0.0, |a, &b| a + b);
        if total != 0.0 {
            w.iter_mut().for_each(|x| *x /= total);
        }
        t.first.push(xmin as usize);
        t.weights.push(w);
    }
    t
}

/// One output value: the taps' weighted sum, in their order, in float32.
fn tap_sum(src: impl Fn(usize) -> f32, first: usize, w: &[f32]) -> f32 {
    let mut acc = src(first) * w[0];
    for (j, &wj) in w.iter().enumerate().skip(1) {
        acc += src(first + j) * wj;
    }
    acc
}

/// `src` (`[C, H, W]`) cropped to `b` and resized back to H×W into `out`; `tmp` is scratch.
pub fn resized_crop_into(src: &[f32], [c, h, w]: [usize; 3], b: CropBox, out: &mut [f32], tmp: &mut Vec<f32>) {
    // Width first, into `tmp` (`[C, box height, W]`); an axis already at its size is copied.
    tmp.clear();
    tmp.resize(c * b.height * w, 0.0);
    let tw = (b.width != w).then(|| taps(b.width, w));
    for ch in 0..c {
        for y in 0..b.height {
            let line = &src[(ch * h + b.top + y) * w + b.left..][..b.width];
            let row = &mut tmp[(ch * b.height + y) * w..][..w];
            match &tw {
                Some(t) => {
                    for (x, o) in row.iter_mut().enumerate() {
                        *o = tap_sum(|k| line[k], t.first[x], &t.weights[x]);
                    }
                }
                None => row.copy_from_slice(line),
            }
        }
    }
    let th = (b.height != h).then(|| taps(b.height, h));
    for ch in 0..c {
        let plane = &tmp[ch * b.height * w..][..b.height * w];
        for y in 0..h {
            let row = &mut out[(ch * h + y) * w..][..w];
            match &th {
                Some(t) => {
                    for (x, o) in row.iter_mut().enumerate() {
                        *o = tap_sum(|k| plane[k * w + x], t.first[y], &t.weights[y]);
                    }
                }
                None => row.copy_from_slice(&plane[y * w..][..w]),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::rng::stream;

    #[test]
    fn boxes_lie_inside_the_image_and_follow_scale_and_ratio() {
        let c = ResizedCrop::default();
        for k in 0..200 {
            let b = draw_box(&c, 32, 48, &mut stream(7, 1, k));
            assert!(b.top + b.height <= 32 && b.left + b.width <= 48, "{b:?}");
            let share = (b.height * b.width) as f64 / (32.0 * 48.0);
            assert!((0.05..=1.0).contains(&share), "{b:?}");
        }
        // A ratio no box of the whole area can have: the central crop at the nearest ratio
        // (20 / 4 = 5 rows of a 10×20 image).
        let wide = ResizedCrop {
            scale: [1.0, 1.0],
            ratio: [4.0, 5.0],
        };
        let b = draw_box(&wide, 10, 20, &mut stream(7, 1, 0));
        assert_eq!(
            b,
            CropBox {
                top: 2,
                left: 0,
                height: 5,
                width: 20
            }
        );
    }

    #[test]
    fn the_whole_image_resized_to_its_size_is_unchanged() {
        let src: Vec<f32> = (0..2 * 5 * 7).map(|v| v as f32 / 70.0).collect();
        let (mut out, mut tmp) = (vec![0.0; src.len()], vec![]);
        let whole = CropBox {
            top: 0,
            left: 0,
            height: 5,
            width: 7,
        };
        resized_crop_into(&src, [2, 5, 7], whole, &mut out, &mut tmp);
        assert_eq!(out, src);
        // Weights sum to one: a constant image stays (nearly) constant, up or down.
        let flat = vec![0.25f32; 3 * 9 * 9];
        let mut out = vec![0.0; flat.len()];
        let part = CropBox {
            top: 1,
            left: 2,
            height: 4,
            width: 6,
        };
        resized_crop_into(&flat, [3, 9, 9], part, &mut out, &mut tmp);
        assert!(out.iter().all(|v| (v - 0.25).abs() < 1e-7), "{out:?}");
    }
}
