//! The operations an update is built from, in forms that round exactly like PyTorch's kernels.
//!
//! tch's generated bindings drop the optional `alpha` / `value` scalars of `add`, `addcmul` and
//! `addcdiv`, so those three calls are rebuilt from ops tch does have, in a form that rounds
//! exactly like the kernel PyTorch runs:
//!
//! * `a.add(b, alpha=s)` is a fused multiply-add (`fma(b, s, a)`, one rounding) in both the CPU
//!   and CUDA kernels. It is computed as `a.addcmul(b, s_t)` with `s_t` a 0-dim tensor holding
//!   `s` (an *alpha*): with `value = 1` the addcmul kernels reduce to the same single fused
//!   multiply-add.
//! * `a.addcmul_(b, c, value=v)`: on CPU the kernel evaluates `a + (v*b)*c`, reproduced as
//!   `a.addcmul_(b*v, c)`; on CUDA it evaluates `fma(v, b*c, a)`, reproduced as
//!   `a.addcmul_(b*c, v_t)`.
//! * `a.addcdiv_(b, c, value=v)`: on CPU `a + (v*b)/c`, reproduced as `a.addcdiv_(b*v, c)`;
//!   on CUDA `fma(v, b/c, a)`, reproduced as `a.addcmul_(b/c, v_t)`.
//!
//! A product with a Python float (`x * v`, `x.mul_(v)`) is computed against a *factor*: a 0-dim
//! CPU tensor of the kind PyTorch computes that product in (f64 for f64 tensors, f32 otherwise).
//! CPU kernels read it unrounded (as they read a Python number), CUDA kernels read a 0-dim CPU
//! tensor as a host scalar (as they read a Python number). tch's own scalar forms cannot be
//! used: `mul.Scalar_out` is ATen's generated out-variant, which computes into a fresh tensor of
//! the operand's size and copies it, and `mul_.Scalar` rounds `v` to bf16/f16 first.
//!
//! The alphas live on the parameter's device, the factors on the host; both are created before
//! the step (they allocate) and refilled in place when a value changes, so an update never
//! waits for the device and allocates nothing parameter-sized. (On the CPU, libtorch still
//! converts the Python numbers of `div_`/`add_` by a scalar into 0-dim temporaries of a few
//! bytes; PyTorch's own optimizer makes the same.) The CPU forms were checked bitwise against
//! PyTorch (a million elements per op, and multi-step runs of every optimizer variant on 1003
//! elements, with both the AVX2 and the default kernels); the CUDA forms follow the 2.11 kernel
//! sources (`DeviceAddCmulCdiv.cuh`) but were not run here.
//!
//! Reduced-precision parameters (bf16/f16, e.g. `precision = "bf16"`) are not bit-exact, only
//! within a few bf16 ulps of PyTorch, for lack of the `value` argument: PyTorch evaluates
//! `a + v*b*c` and `a + v*b/c` in f32 and rounds once, where the forms above round `v*b` to
//! bf16 first. On the CPU, `add(alpha)` is reproduced exactly as above (PyTorch's CPU kernel
//! rounds `alpha` to the tensor's dtype, like the 0-dim tensor does). On CUDA PyTorch keeps
//! `alpha` in f32, so a bf16 0-dim tensor would bias every step (momentum 0.9 would become
//! 0.8984); there `a + round(b*s)` is used instead, with the product in a workspace slot, and
//! the CPU forms of addcmul/addcdiv.
use tch::{Device, Kind, Tensor};

/// How many multipliers a rule may use (the length of [`Values`]).
pub const MULTIPLIERS: usize = 5;

/// One step's multipliers, each at the index the rule gives it.
pub type Values = [f64; MULTIPLIERS];

/// Which forms reproduce PyTorch's kernels for a parameter on one (device, kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forms {
    /// CPU kernels: `add(alpha)` through an alpha; addcmul/addcdiv as `a + (v*b)*c`.
    Cpu,
    /// CUDA kernels on f32/f64: `add(alpha)` through an alpha; addcmul/addcdiv as
    /// `fma(v, b*c, a)`.
    Device,
    /// bf16/f16 off the CPU: `add(alpha)` as `a + round(b*s)` (an alpha of the tensor's kind
    /// would round `s`); addcmul/addcdiv in their CPU forms.
    Unfused,
}

impl Forms {
    pub fn of(device: Device, kind: Kind) -> Forms {
        match (device, kind) {
            (Device::Cpu, _) => Forms::Cpu,
            (_, Kind::Float | Kind::Double) => Forms::Device,
            _ => Forms::Unfused,
        }
    }

    fn uses_alphas(self) -> bool {
        self != Forms::Unfused
    }
}

/// The kind PyTorch multiplies a tensor of `kind` by a Python float in.
fn factor_kind(kind: Kind) -> Kind {
    match kind {
        Kind::Double => Kind::Double,
        _ => Kind::Float,
    }
}

/// One (device, kind)'s 0-dim tensors, one alpha (where its forms use them) and one factor per
/// multiplier.
struct Set {
    device: Device,
    kind: Kind,
    alphas: Option<Vec<Tensor>>,
    factors: Vec<Tensor>,
    /// The bits of the value each index holds; None until first filled.
    filled: [Option<u64>; MULTIPLIERS],
}

impl Set {
    fn new(device: Device, kind: Kind, forms: Forms) -> Self {
        let zeros = |k: Kind, d: Device| (0..MULTIPLIERS).map(|_| Tensor::scalar_tensor(0.0, (k, d))).collect();
        Set {
            device,
            kind,
            alphas: forms.uses_alphas().then(|| zeros(kind, device)),
            factors: zeros(factor_kind(kind), Device::Cpu),
            filled: [None; MULTIPLIERS],
        }
    }

    fn refill(&mut self, values: &Values) {
        for (i, v) in values.iter().enumerate() {
            if self.filled[i] == Some(v.to_bits()) {
                continue;
            }
            if let Some(alphas) = &mut self.alphas {
                let _ = alphas[i].fill_(*v);
            }
            let _ = self.factors[i].fill_(*v);
            self.filled[i] = Some(v.to_bits());
        }
    }
}

/// The multipliers as 0-dim tensors for every (device, kind) the parameters have.
#[derive(Default)]
pub struct Multipliers {
    sets: Vec<Set>,
}

impl Multipliers {
    /// Creates (device, kind)'s tensors if they do not exist yet: the only allocation here.
    pub fn prepare(&mut self, device: Device, kind: Kind, forms: Forms) {
        if !self.sets.iter().any(|s| s.device == device && s.kind == kind) {
            self.sets.push(Set::new(device, kind, forms));
        }
    }

    /// Writes this step's values, in place, where they differ from the last step's.
    pub fn refill(&mut self, values: &Values) {
        for s in &mut self.sets {
            s.refill(values);
        }
    }

    /// (device, kind)'s multipliers, prepared and refilled beforehand.
    pub fn coefs(&self, device: Device, kind: Kind) -> Coefs<'_> {
        let set = self
            .sets
            .iter()
            .find(|s| s.device == device && s.kind == kind)
            .expect("prepared for every parameter");
        Coefs { set }
    }

    /// Forgets every (device, kind) off `device`: their parameters have moved.
    pub fn retain_on(&mut self, device: Device) {
        self.sets.retain(|s| s.device == device);
    }
}

/// One parameter's multipliers for this step.
#[derive(Clone, Copy)]
pub struct Coefs<'a> {
    set: &'a Set,
}

impl<'a> Coefs<'a> {
    pub fn get(&self, i: usize) -> Coef<'a> {
        Coef {
            alpha: self.set.alphas.as_ref().map(|a| &a[i]),
            factor: &self.set.factors[i],
        }
    }
}

/// A multiplier `s`: its factor and, where the forms fuse `add(alpha)`, its alpha.
#[derive(Clone, Copy)]
pub struct Coef<'a> {
    alpha: Option<&'a Tensor>,
    factor: &'a Tensor,
}

impl<'a> Coef<'a> {
    /// The alpha of the device forms of addcmul/addcdiv (`Forms::Device`, which has them).
    pub fn alpha(&self) -> &'a Tensor {
        self.alpha.expect("the device forms use alphas")
    }
}

/// `a.add(b, alpha=s)` into `out`. Through the alpha this is PyTorch's single fused multiply-add;
/// without (`Forms::Unfused`) `s` stays in f32, as in PyTorch's CUDA kernel, but the product is
/// rounded once more.
pub fn add_scaled_into(out: &Tensor, a: &Tensor, b: &Tensor, s: Coef) {
    match s.alpha {
        Some(t) => {
            let _ = a.addcmul_out(out, b, t);
        }
        None => {
            scale_into(out, b, s);
            let _ = out.shallow_clone().g_add_(a);
        }
    }
}

/// `a.add_(b, alpha=s)`, in place; see `add_scaled_into`. `Forms::Unfused` builds the product
/// in `scratch`, a parameter-shaped temporary the rule reserved for it.
pub fn add_scaled_(a: &mut Tensor, b: &Tensor, s: Coef, scratch: Option<&Tensor>) {
    match s.alpha {
        Some(t) => {
            let _ = a.addcmul_(b, t);
        }
        None => {
            let scratch = scratch.expect("the unfused forms reserve a scratch temporary");
            scale_into(scratch, b, s);
            let _ = a.g_add_(scratch);
        }
    }
}

/// `out = x * s`, as Python's `x * s`.
pub fn scale_into(out: &Tensor, x: &Tensor, s: Coef) {
    let _ = x.mul_out(out, s.factor);
}

/// `x.mul_(s)`, as Python's.
pub fn scale_(x: &mut Tensor, s: Coef) {
    let _ = x.g_mul_(s.factor);
}
