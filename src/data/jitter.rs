//! torchvision's `ColorJitter(brightness, contrast, saturation, hue)` on one float32 image
//! `[C, H, W]` with values in [0, 1]: the four adjustments in a random order, each with a factor
//! drawn uniformly from its range, computed as `transforms.v2.functional`'s kernels compute them
//! on a float32 tensor (each result clamped to [0, 1]; saturation and hue leave a one-channel
//! image alone, and contrast takes its mean from the image itself there).
//!
//! The draws come from the data's own generator, not torch's. Given the order and factors, the
//! pixels equal torchvision's within 5e-7 (libtorch's vector code fuses some multiply-adds and
//! sums the contrast's mean in another order).
use super::rng::SplitMix64;
use crate::spec::schema::ColorJitter;

/// The ranges factors are drawn from; None: that adjustment is off.
#[derive(Debug, Clone, PartialEq)]
pub struct Jitter {
    pub brightness: Option<[f64; 2]>,
    pub contrast: Option<[f64; 2]>,
    pub saturation: Option<[f64; 2]>,
    pub hue: Option<[f64; 2]>,
}

/// One adjustment with its factor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Adjust {
    Brightness(f64),
    Contrast(f64),
    Saturation(f64),
    Hue(f64),
}

impl Jitter {
    /// As torchvision's `_check_input` takes the spec's values: a range that is only the
    /// unchanged value is off.
    pub fn of(c: &ColorJitter) -> Jitter {
        let range = |s: Option<crate::spec::schema::Spread>, center: f64| {
            s.map(|s| s.range(center))
                .filter(|r| !(r[0] == center && r[1] == center))
        };
        Jitter {
            brightness: range(c.brightness, 1.0),
            contrast: range(c.contrast, 1.0),
            saturation: range(c.saturation, 1.0),
            hue: range(c.hue, 0.0),
        }
    }

    /// The adjustments of one sample, in the order they apply.
    pub(crate) fn draw(&self, r: &mut SplitMix64) -> Vec<Adjust> {
        let mut order = [0usize, 1, 2, 3];
        for i in (1..4).rev() {
            order.swap(i, r.below(i as u64 + 1) as usize);
        }
        let mut factor = |range: Option<[f64; 2]>| range.map(|[lo, hi]| lo + (hi - lo) * r.unit());
        let f = [
            factor(self.brightness).map(Adjust::Brightness),
            factor(self.contrast).map(Adjust::Contrast),
            factor(self.saturation).map(Adjust::Saturation),
            factor(self.hue).map(Adjust::Hue),
        ];
        order.iter().filter_map(|&i| f[i]).collect()
    }
}

/// Applies `adjust` in order to `img` (`[C, H, W]`, C 1 or 3).
pub fn apply(adjust: &[Adjust], img: &mut [f32], c: usize) {
    for a in adjust {
        match *a {
            Adjust::Brightness(f) => img.iter_mut().for_each(|v| *v = (*v * f as f32).clamp(0.0, 1.0)),
            Adjust::Contrast(f) => {
                let mean = match c {
                    3 => mean(&grayscale(img)),
                    _ => mean(img),
                };
                img.iter_mut().for_each(|v| *v = blend(*v, mean, f));
            }
            Adjust::Saturation(f) if c == 3 => {
                let gray = grayscale(img);
                let plane = gray.len();
                for (i, v) in img.iter_mut().enumerate() {
                    *v = blend(*v, gray[i % plane], f);
                }
            }
            Adjust::Hue(f) if c == 3 => hue(img, f),
            Adjust::Saturation(_) | Adjust::Hue(_) => {}
        }
    }
}

/// `image1 * ratio + image2 * (1 - ratio)`, clamped to [0, 1].
fn blend(a: f32, b: f32, ratio: f64) -> f32 {
    (a * ratio as f32 + b * (1.0 - ratio) as f32).clamp(0.0, 1.0)
}

/// ITU-R 601-2 luma, as torchvision weighs it.
fn grayscale(img: &[f32]) -> Vec<f32> {
    let plane = img.len() / 3;
    let (r, g, b) = (&img[..plane], &img[plane..2 * plane], &img[2 * plane..]);
    (0..plane)
        .map(|i| r[i] * 0.2989f64 as f32 + g[i] * 0.587f64 as f32 + b[i] * 0.114f64 as f32)
        .collect()
}

fn mean(v: &[f32]) -> f32 {
    (v.iter().map(|&x| x as f64).sum::<f64>() / v.len().max(1) as f64) as f32
}

/// RGB to HSV, the hue turned by `f` (a share of the circle), and back, pixel by pixel.
fn hue(img: &mut [f32], f: f64) {
    let plane = img.len() / 3;
    for i in 0..plane {
        let [r, g, b] = [img[i], img[plane + i], img[2 * plane + i]];
        let (h, s, v) = rgb_to_hsv(r, g, b);
        let h = h + f as f32;
        // torch's remainder: the result takes the divisor's sign.
        let mut h = h % 1.0;
        if h != 0.0 && h < 0.0 {
            h += 1.0;
        }
        let [r, g, b] = hsv_to_rgb(h, s, v);
        (img[i], img[plane + i], img[2 * plane + i]) = (r, g, b);
    }
}

fn rgb_to_hsv(r: f32, g: f32, b: f32) -> (f32, f32, f32) {
    let maxc = r.max(g).max(b);
    let minc = r.min(g).min(b);
    let eqc = maxc == minc;
    let range = maxc - minc;
    let s = range / if eqc { 1.0 } else { maxc };
    let div = if eqc { 1.0 } else { range };
    let (rc, gc, bc) = ((maxc - r) / div, (maxc - g) / div, (maxc - b) / div);
    let (neq_r, eq_g) = (maxc != r, maxc == g);
    let mask = |m: bool| if m { 1.0f32 } else { 0.0 };
    let hg = (rc + 2.0 - bc) * mask(eq_g && neq_r);
    let hr = (bc - gc) * mask(!neq_r);
    let hb = (gc + 4.0 - rc) * mask(neq_r && !eq_g);
    let h = hr + hg + hb;
    let h = (h * (1.0f64 / 6.0) as f32 + 1.0) % 1.0;
    (h, s, maxc)
}

fn hsv_to_rgb(h: f32, s: f32, v: f32) -> [f32; 3] {
    let h6 = h * 6.0;
    let i = h6.floor();
    let f = h6 - i;
    let sxf = s * f;
    let one_minus_s = 1.0 - s;
    let q = ((1.0 - sxf) * v).clamp(0.0, 1.0);
    let t = ((sxf + one_minus_s) * v).clamp(0.0, 1.0);
    let p = (one_minus_s * v).clamp(0.0, 1.0);
    let vpqt = [v, p, q, t];
    const SELECT: [[usize; 6]; 3] = [[0, 2, 1, 1, 3, 0], [3, 0, 0, 2, 1, 1], [1, 1, 3, 0, 0, 2]];
    let i = (i as i32).rem_euclid(6) as usize;
    [vpqt[SELECT[0][i]], vpqt[SELECT[1][i]], vpqt[SELECT[2][i]]]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::rng::stream;
    use crate::spec::schema::Spread;

    #[test]
    fn draws_cover_each_adjustment_once_in_some_order() {
        let j = Jitter::of(&ColorJitter {
            brightness: Some(Spread::By(0.4)),
            contrast: Some(Spread::By(0.0)),
            saturation: Some(Spread::Range([0.5, 1.5])),
            hue: Some(Spread::By(0.1)),
        });
        assert_eq!(j.contrast, None, "0 is no change");
        assert_eq!(j.brightness, Some([0.6, 1.4]));
        let mut orders = std::collections::HashSet::new();
        for k in 0..50 {
            let d = j.draw(&mut stream(3, 9, k));
            assert_eq!(d.len(), 3);
            for a in &d {
                match *a {
                    Adjust::Brightness(f) => assert!((0.6..1.4).contains(&f)),
                    Adjust::Saturation(f) => assert!((0.5..1.5).contains(&f)),
                    Adjust::Hue(f) => assert!((-0.1..0.1).contains(&f)),
                    Adjust::Contrast(_) => panic!("contrast is off"),
                }
            }
            orders.insert(format!(
                "{:?}",
                d.iter().map(std::mem::discriminant).collect::<Vec<_>>()
            ));
        }
        assert!(orders.len() > 3, "the order varies: {orders:?}");
    }

    #[test]
    fn hue_turns_round_the_circle_and_gray_stays_gray() {
        // Pure red turned by a third of the circle is pure green.
        let mut px = vec![1.0f32, 0.0, 0.0];
        apply(&[Adjust::Hue(1.0 / 3.0)], &mut px, 3);
        assert!(
            (px[0]).abs() < 1e-6 && (px[1] - 1.0).abs() < 1e-6 && px[2].abs() < 1e-6,
            "{px:?}"
        );
        // Gray has no hue to turn; its luma weights sum to 0.9999, as torchvision's do.
        let mut gray = vec![0.5f32; 3];
        apply(&[Adjust::Hue(0.3), Adjust::Saturation(2.0)], &mut gray, 3);
        assert!(gray.iter().all(|&v| v == gray[0] && (v - 0.5).abs() < 1e-4), "{gray:?}");
        let mut one = vec![0.2f32, 0.9];
        apply(&[Adjust::Brightness(2.0), Adjust::Hue(0.2)], &mut one, 1);
        assert_eq!(one, [0.4, 1.0]);
    }
}
