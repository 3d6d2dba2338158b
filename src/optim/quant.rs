//! Block-wise 8-bit quantization of optimizer state (Dettmers et al. 2022, "8-bit Optimizers via
//! Block-wise Quantization"), as bitsandbytes and torchao store Adam's moments.
//!
//! A tensor is cut into blocks of [`BLOCK`] consecutive values (the last one may be shorter).
//! Each block keeps its absolute maximum as an fp32 scale, and each value the index (a `u8`
//! code) of the entry of a 256-entry map in [-1, 1] nearest to `value / absmax`. The maps are
//! bitsandbytes' dynamic maps (`create_dynamic_map`): a dynamic exponent and a fraction whose
//! bits shrink as the exponent grows, fine near zero and coarse near one; signed for Adam's
//! first moment, unsigned (twice the fractions, no sign) for the second.
//!
//! "Nearest" is decided against the fp32 midpoints between neighbouring map entries, a value on
//! a midpoint going to the larger entry (torchao's binary search does the same; bitsandbytes'
//! kernel breaks such exact ties either way). Everything here writes into tensors the caller
//! allocated: no operation allocates anything sized like the tensor.
use tch::{Device, Kind, Tensor};

/// Values per block, as torchao's `AdamW8bit` uses (bitsandbytes' optimizers use 256 too on
/// recent versions, 2048 on older ones): a small block keeps an outlier from coarsening many
/// values, at 4 bytes of scale per 256 values (1.6% on top of the codes).
pub const BLOCK: i64 = 256;

/// Parameters with fewer values keep fp32 state, as bitsandbytes' `min_8bit_size` and torchao's
/// `AdamW8bit` do: their state is small, and a single short block quantizes them badly.
pub const MIN_8BIT_SIZE: i64 = 4096;

/// Scale blocks for `n` values.
pub fn blocks(n: i64) -> i64 {
    (n + BLOCK - 1) / BLOCK
}

/// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`, computed as it
/// computes it (fp32 `linspace`, fp32 means and products), sorted: 256 values in [-1, 1]
/// (signed) or [0, 1].
pub fn dynamic_map(signed: bool) -> Vec<f32> {
    const MAX_EXPONENT_BITS: i32 = 7;
    let cpu = (Kind::Float, Device::Cpu);
    let mut data: Vec<f32> = Vec::with_capacity(256);
    for i in 0..MAX_EXPONENT_BITS {
        // non_sign_bits = 7 for both maps in bitsandbytes; the unsigned map has twice the
        // fractions per exponent instead of a sign.
        let fraction_items = if signed { (1i64 << i) + 1 } else { (1i64 << (i + 1)) + 1 };
        let boundaries = Tensor::linspace(0.1, 1.0, fraction_items, cpu);
        let k = fraction_items - 1;
        let means = (boundaries.narrow(0, 0, k) + boundaries.narrow(0, 1, k)).g_div_scalar(2.0);
        // Python's `10 ** (-(max_exponent_bits - 1) + i)`: a float (C's pow) below 10**0, the
        // int 1 at it.
        let e = -(MAX_EXPONENT_BITS - 1) + i;
        let scale = if e < 0 { 10f64.powf(e as f64) } else { 1.0 };
        data.extend(Vec::<f32>::try_from(means.g_mul_scalar(scale)).expect("a CPU float tensor"));
        if signed {
            data.extend(Vec::<f32>::try_from(means.g_mul_scalar(-scale)).expect("a CPU float tensor"));
        }
    }
    data.push(0.0);
    data.push(1.0);
    assert_eq!(data.len(), 256, "the dynamic map has 256 entries");
    data.sort_by(|a, b| a.partial_cmp(b).expect("no NaN in the map"));
    data
}

/// The fp32 midpoints between neighbouring entries of a sorted map: code `k` is chosen for
/// `x` with `midpoints[k - 1] <= x < midpoints[k]`.
pub fn midpoints(map: &[f32]) -> Vec<f32> {
    map.windows(2).map(|w| (w[0] + w[1]) * 0.5).collect()
}

/// One map on one device: its entries (for dequantizing) and midpoints (for quantizing).
pub struct Map {
    pub values: Tensor,
    pub midpoints: Tensor,
}

impl Map {
    pub fn new(signed: bool, device: Device) -> Self {
        let values = dynamic_map(signed);
        Map {
            midpoints: Tensor::from_slice(&midpoints(&values)).to_device(device),
            values: Tensor::from_slice(&values).to_device(device),
        }
    }
}

/// Flat `x` (its first `n` values) as 2-D views of whole rows: the full blocks `[n / 256, 256]`
/// and the short last block `[1, n % 256]`, where there are such.
fn rows(x: &Tensor, n: i64) -> Vec<Tensor> {
    let (full, rest) = (n / BLOCK, n % BLOCK);
    let mut out = Vec::with_capacity(2);
    if full > 0 {
        out.push(x.narrow(0, 0, full * BLOCK).view([full, BLOCK]));
    }
    if rest > 0 {
        out.push(x.narrow(0, full * BLOCK, rest).view([1, rest]));
    }
    out
}

/// `absmax` (one value per block) as columns matching `rows`.
fn scales(absmax: &Tensor, n: i64) -> Vec<Tensor> {
    let (full, rest) = (n / BLOCK, n % BLOCK);
    let mut out = Vec::with_capacity(2);
    if full > 0 {
        out.push(absmax.narrow(0, 0, full).view([full, 1]));
    }
    if rest > 0 {
        out.push(absmax.narrow(0, full, 1).view([1, 1]));
    }
    out
}

/// Quantizes fp32 `x` into `codes` (u8, one per value) and `absmax` (fp32, one per block), all
/// flat (contiguous views), through `scratch` (fp32) and `index` (i32), each as long as `x`.
/// A block of zeros gets the smallest normal fp32 as its scale, so that it divides to zeros
/// (not NaN); any other block's scale is its absolute maximum.
pub fn quantize(x: &Tensor, codes: &Tensor, absmax: &Tensor, map: &Map, scratch: &Tensor, index: &Tensor) {
    let n = x.numel() as i64;
    let _ = x.abs_out(scratch);
    for (r, s) in rows(scratch, n).iter().zip(scales(absmax, n)) {
        let _ = r.amax_out(&s, [1], true);
    }
    let _ = absmax.shallow_clone().clamp_min_(f32::MIN_POSITIVE as f64);
    for ((xr, out), s) in rows(x, n).iter().zip(rows(scratch, n)).zip(scales(absmax, n)) {
        let _ = xr.div_out(&out, &s);
    }
    let _ = scratch.bucketize_tensor_out(index, &map.midpoints, true, true);
    codes.shallow_clone().copy_(index);
}

/// Dequantizes flat `codes` and `absmax` into fp32 `out` (`map[code] * absmax`), through
/// `index` (i32, as long as `out`).
pub fn dequantize(codes: &Tensor, absmax: &Tensor, map: &Map, out: &Tensor, index: &Tensor) {
    let n = out.numel() as i64;
    index.shallow_clone().copy_(codes);
    let _ = map.values.index_select_out(out, 0, index);
    for (r, s) in rows(out, n).iter().zip(scales(absmax, n)) {
        let _ = r.shallow_clone().g_mul_(&s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quantized(x: &Tensor, signed: bool) -> (Tensor, Tensor, Tensor) {
        let n = x.numel() as i64;
        let map = Map::new(signed, Device::Cpu);
        let codes = Tensor::zeros([n], (Kind::Uint8, Device::Cpu));
        let absmax = Tensor::zeros([blocks(n)], (Kind::Float, Device::Cpu));
        let scratch = Tensor::empty([n], (Kind::Float, Device::Cpu));
        let index = Tensor::empty([n], (Kind::Int, Device::Cpu));
        quantize(x, &codes, &absmax, &map, &scratch, &index);
        let back = Tensor::empty([n], (Kind::Float, Device::Cpu));
        dequantize(&codes, &absmax, &map, &back, &index);
        (codes, absmax, back)
    }

    fn floats(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t.contiguous()).unwrap()
    }

    #[test]
    fn the_maps_are_bitsandbytes_dynamic_maps() {
        for signed in [true, false] {
            let m = dynamic_map(signed);
            assert!(m.windows(2).all(|w| w[0] < w[1]), "sorted, distinct");
            assert_eq!(*m.last().unwrap(), 1.0);
            assert!(m.contains(&0.0));
        }
        let s = dynamic_map(true);
        // 127 magnitudes per sign, the smallest 0.55e-6 (exponent -6's one fraction).
        assert_eq!(s.iter().filter(|v| **v < 0.0).count(), 127);
        assert_eq!(s[0], -s[254]);
        assert!((s[128] - 0.55e-6).abs() < 1e-12, "{}", s[128]);
        let u = dynamic_map(false);
        assert_eq!(u[0], 0.0);
        assert!((u[1] - 0.325e-6).abs() < 1e-12, "{}", u[1]);
    }

    /// Every value comes back within half the map's widest gap, times its block's absmax (the
    /// gaps are widest near 1: 0.0141 signed, 0.0071 unsigned); a positive block maximum
    /// exactly.
    #[test]
    fn round_trips_are_bounded_by_the_map_spacing() {
        for signed in [true, false] {
            let map = dynamic_map(signed);
            let gap = map.windows(2).map(|w| w[1] - w[0]).fold(0.0f32, f32::max);
            // 3 full blocks and a short one, values over several orders of magnitude.
            let n = 3 * BLOCK + 77;
            let x = Tensor::randn([n], (Kind::Float, Device::Cpu))
                * Tensor::linspace(-6.0, 1.0, n, (Kind::Float, Device::Cpu)).exp2();
            let x = if signed { x } else { x.abs() };
            let (codes, absmax, back) = quantized(&x, signed);
            let (xs, bs, am) = (floats(&x), floats(&back), floats(&absmax));
            assert_eq!(am.len() as i64, blocks(n));
            let c = Vec::<u8>::try_from(&codes).unwrap();
            for (i, ((v, b), code)) in xs.iter().zip(&bs).zip(&c).enumerate() {
                let scale = am[i / BLOCK as usize];
                // Up to fp32 rounding of the division, the midpoint and the product.
                let bound = gap / 2.0 * scale * (1.0 + 1e-5);
                assert!((v - b).abs() <= bound, "value {i}: {v} came back {b} (bound {bound})");
                // The nearest entry: no other entry is closer to v / absmax.
                let y = v / scale;
                let d = (map[*code as usize] - y).abs();
                assert!(
                    map.iter().all(|m| (m - y).abs() >= d - 1e-7),
                    "value {i}: code {code} is not the nearest"
                );
            }
            for (b, a) in am.iter().enumerate() {
                let block = &xs[b * BLOCK as usize..((b + 1) * BLOCK as usize).min(n as usize)];
                let top = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert_eq!(*a, top, "block {b}'s scale is its absolute maximum");
                let at = block.iter().position(|v| v.abs() == top).unwrap() + b * BLOCK as usize;
                // The maps hold 1 but not -1 (the signed one's lowest entry is -0.9929): a
                // positive maximum comes back exactly.
                if xs[at] > 0.0 {
                    assert_eq!(bs[at], xs[at], "the block's maximum comes back exactly");
                }
            }
        }
    }

    #[test]
    fn near_zero_values_keep_their_relative_precision() {
        // The dynamic map is fine near zero: a value 1e-3 of its block's maximum comes back
        // within 6% (entries 1.1e-4 apart there; a linear 8-bit map, 1/127 apart, would round
        // it to 0).
        let mut v = vec![1e-3f32; 300];
        v[0] = 1.0;
        let (_, _, back) = quantized(&Tensor::from_slice(&v), true);
        let b = floats(&back);
        assert_eq!(b[0], 1.0);
        assert!(b[1..].iter().all(|x| (x - 1e-3).abs() < 6e-5), "{:?}", &b[1..4]);
    }

    #[test]
    fn zeros_and_ties() {
        let (codes, absmax, back) = quantized(&Tensor::zeros([300], (Kind::Float, Device::Cpu)), true);
        assert!(floats(&back).iter().all(|v| *v == 0.0));
        assert!(floats(&absmax).iter().all(|v| *v == f32::MIN_POSITIVE));
        let zero = dynamic_map(true).iter().position(|v| *v == 0.0).unwrap() as u8;
        assert!(Vec::<u8>::try_from(&codes).unwrap().iter().all(|c| *c == zero));
        // A value exactly on a midpoint takes the larger entry.
        let map = dynamic_map(false);
        let mid = midpoints(&map);
        let mut v = vec![mid[200], 1.0];
        v.resize(256, 0.0);
        let (codes, _, _) = quantized(&Tensor::from_slice(&v), false);
        assert_eq!(Vec::<u8>::try_from(&codes).unwrap()[0], 201);
    }
}
