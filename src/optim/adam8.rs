//! Adam and AdamW with 8-bit moments (`train.optimizer_state_bits = 8`): Dettmers et al. 2022,
//! as bitsandbytes' `Adam8bit`/`AdamW8bit` and torchao's `AdamW8bit` keep them.
//!
//! Each fp32 parameter with at least [`MIN_8BIT_SIZE`] values keeps each moment as u8 codes
//! (shaped like the parameter) and one fp32 scale per block of 256 values (see `quant`), in the
//! slots `exp_avg_q8`, `exp_avg_absmax`, `exp_avg_sq_q8`, `exp_avg_sq_absmax`. An update
//! dequantizes both moments into fp32 temporaries, runs exactly the fp32 rule (`adam::Adam`,
//! the same operations in the same order) on them, and quantizes them back: the parameter moves
//! by the fp32 moments of this step, and only what is carried to the next step is rounded (as
//! in both libraries). Smaller parameters, and parameters of another kind, keep the fp32 rule's
//! own state (`exp_avg`, `exp_avg_sq`).
//!
//! A checkpoint holds the codes and scales as they are, so a resumed run continues bit for bit.
use std::sync::Mutex;

use tch::{Device, Kind, Tensor};

use super::adam::Adam;
use super::forms::{Forms, Values};
use super::quant::{self, Map, MIN_8BIT_SIZE};
use super::rule::{ParamUpdate, Rule, Slot, Step};

/// The fp32 rule, with its moments stored in 8 bits where the parameter is large enough.
#[derive(Debug)]
pub struct Adam8 {
    adam: Adam,
    /// The signed (first moment) and unsigned (second moment) maps on each device the
    /// parameters are on, made by `prepare`.
    maps: Mutex<Vec<(Device, Maps)>>,
}

struct Maps {
    signed: Map,
    unsigned: Map,
}

impl std::fmt::Debug for Maps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Maps")
    }
}

/// Slot indices of a quantized parameter's state.
const M_CODES: usize = 0;
const M_ABSMAX: usize = 1;
const V_CODES: usize = 2;
const V_ABSMAX: usize = 3;

/// Whether `p`'s moments are stored in 8 bits.
fn quantized(p: &Tensor) -> bool {
    p.kind() == Kind::Float && p.numel() as i64 >= MIN_8BIT_SIZE
}

/// Bytes of 8-bit Adam state for a parameter of `numel` fp32 values: two 1-byte codes per
/// value and two fp32 scales per block, or the fp32 rule's 8 bytes per value below
/// `MIN_8BIT_SIZE`.
pub fn state_bytes_8bit(numel: u64) -> u64 {
    match numel as i64 >= MIN_8BIT_SIZE {
        true => 2 * numel + 2 * 4 * quant::blocks(numel as i64) as u64,
        false => 8 * numel,
    }
}

impl Adam8 {
    pub fn new(adam: Adam) -> Self {
        Adam8 {
            adam,
            maps: Mutex::new(Vec::new()),
        }
    }
}

impl Rule for Adam8 {
    /// The slots of a quantized parameter (`layout` gives each parameter's own).
    fn slots(&self) -> &'static [&'static str] {
        &["exp_avg_q8", "exp_avg_absmax", "exp_avg_sq_q8", "exp_avg_sq_absmax"]
    }

    fn layout(&self, p: &Tensor) -> Vec<Slot> {
        if !quantized(p) {
            return self.adam.layout(p);
        }
        let blocks = quant::blocks(p.numel() as i64);
        let [m, m_absmax, v, v_absmax] = self.slots() else {
            unreachable!("four slots")
        };
        let codes = |name| Slot {
            name,
            size: p.size(),
            kind: Kind::Uint8,
        };
        let absmax = |name| Slot {
            name,
            size: vec![blocks],
            kind: Kind::Float,
        };
        vec![codes(*m), absmax(*m_absmax), codes(*v), absmax(*v_absmax)]
    }

    fn prepare(&self, device: Device) {
        let mut maps = self.maps.lock().expect("the maps' lock is never poisoned");
        if !maps.iter().any(|(d, _)| *d == device) {
            maps.push((
                device,
                Maps {
                    signed: Map::new(true, device),
                    unsigned: Map::new(false, device),
                },
            ));
        }
    }

    /// The fp32 rule's two, and the two dequantized moments.
    fn temporaries(&self, forms: Forms) -> usize {
        self.adam.temporaries(forms) + 2
    }

    fn multipliers(&self, step: Step) -> Values {
        self.adam.multipliers(step)
    }

    fn update(&self, step: Step, u: ParamUpdate<'_>) {
        if !quantized(u.param) {
            return self.adam.update(step, u);
        }
        let ParamUpdate {
            param,
            grad,
            state,
            state_written,
            temps,
            forms,
            coefs,
        } = u;
        let maps = self.maps.lock().expect("the maps' lock is never poisoned");
        let (_, maps) = maps
            .iter()
            .find(|(d, _)| *d == param.device())
            .expect("prepared for every parameter's device");
        let flat = |t: &Tensor| t.view([-1]);
        let own = self.adam.temporaries(forms);
        let (m, v) = (flat(&temps[own]), flat(&temps[own + 1]));
        // The fp32 rule's first temporaries are dead outside its update: scratch here, the
        // second read as i32 (same element size) for the map indices.
        let scratch = flat(&temps[0]);
        let index = flat(&temps[1]).view_dtype(Kind::Int);
        let codes = |i: usize| flat(&state[i]);
        quant::dequantize(&codes(M_CODES), &state[M_ABSMAX], &maps.signed, &m, &index);
        quant::dequantize(&codes(V_CODES), &state[V_ABSMAX], &maps.unsigned, &v, &index);
        let mut moments = [temps[own].shallow_clone(), temps[own + 1].shallow_clone()];
        self.adam.update(
            step,
            ParamUpdate {
                param,
                grad,
                state: &mut moments,
                state_written,
                temps: &temps[..own],
                forms,
                coefs,
            },
        );
        quant::quantize(&m, &codes(M_CODES), &state[M_ABSMAX], &maps.signed, &scratch, &index);
        quant::quantize(&v, &codes(V_CODES), &state[V_ABSMAX], &maps.unsigned, &scratch, &index);
    }
}
