//! Where the optimizer state lives and how a checkpoint names it.
use std::collections::{BTreeSet, HashMap, HashSet};

use tch::{Device, Tensor};

use super::rule::Slot;
use crate::host::{Home, Host};

/// Every parameter's state: its slot tensors, laid out as the rule says (`Rule::layout`: by
/// default shaped and typed like the parameter), on the parameter's device or on the host (empty for a
/// parameter this process does not step).
pub struct StateStore {
    /// Each parameter's slots (kept for the parameters stepped elsewhere too: names and shapes).
    layouts: Vec<Vec<Slot>>,
    params: Vec<ParamState>,
    home: Home,
}

pub struct ParamState {
    /// One tensor per slot.
    pub tensors: Vec<Tensor>,
    /// Whether an update or a restored checkpoint has written `tensors` (see `ParamUpdate`).
    pub written: bool,
}

/// A slot's zeros: like the parameter (its strides too) where the slot is shaped and typed
/// like it.
fn zeros(s: &Slot, p: &Tensor) -> Tensor {
    match s.size == p.size() && s.kind == p.kind() {
        true => p.zeros_like(),
        false => Tensor::zeros(&s.size, (s.kind, p.device())),
    }
}

/// Zeros for `slots` of parameter `p`, on `home`.
fn fresh(slots: &[Slot], p: &Tensor, home: Home, host: &Host) -> Vec<Tensor> {
    tch::no_grad(|| match home {
        Home::Device => slots.iter().map(|s| zeros(s, p)).collect(),
        Home::Host => slots
            .iter()
            .map(|s| {
                let mut t = host.empty(&s.size, s.kind);
                let _ = t.zero_();
                t
            })
            .collect(),
    })
}

/// A checkpoint's state tensor named `<slot>/<param name>`.
fn state_name(slot: &str, param: &str) -> String {
    format!("{slot}/{param}")
}

impl StateStore {
    /// Zeros laid out by `layout` for each parameter `i` with `stepped(i)`, on `home`: PyTorch's
    /// lazily created state starts at zero too (SGD's momentum buffer is tracked by `written`).
    pub fn allocate(
        layout: impl Fn(usize, &Tensor) -> Vec<Slot>,
        params: &[(String, Tensor)],
        stepped: impl Fn(usize) -> bool,
        home: Home,
        host: &Host,
    ) -> Self {
        let layouts: Vec<Vec<Slot>> = params.iter().enumerate().map(|(i, (_, p))| layout(i, p)).collect();
        let params = params
            .iter()
            .zip(&layouts)
            .enumerate()
            .map(|(i, ((_, p), slots))| ParamState {
                tensors: match stepped(i) {
                    true => fresh(slots, p, home, host),
                    false => Vec::new(),
                },
                written: false,
            })
            .collect();
        StateStore { layouts, params, home }
    }

    /// Parameter `i`, which had no state (frozen), gets `slots`, as zeros where this process
    /// steps it, not yet written: it starts training.
    pub fn start(&mut self, i: usize, slots: Vec<Slot>, p: &Tensor, stepped: bool, host: &Host) {
        self.params[i] = ParamState {
            tensors: match stepped {
                true => fresh(&slots, p, self.home, host),
                false => Vec::new(),
            },
            written: false,
        };
        self.layouts[i] = slots;
    }

    /// Parameter `i`'s slots.
    pub fn layout_of(&self, i: usize) -> &[Slot] {
        &self.layouts[i]
    }

    pub fn home(&self) -> Home {
        self.home
    }

    /// Moves every state tensor to `home`: host tensors (pinned on CUDA) or the parameter's
    /// device. Values are copied exactly; a checkpoint names them the same either way.
    pub fn place(&mut self, home: Home, host: &Host, params: &[(String, Tensor)]) {
        if home == self.home {
            return;
        }
        tch::no_grad(|| {
            for (st, (_, p)) in self.params.iter_mut().zip(params) {
                for t in st.tensors.iter_mut() {
                    *t = match home {
                        Home::Host => host.copy_of(t),
                        Home::Device => Host::new(p.device()).to_device(t),
                    };
                }
            }
        });
        self.home = home;
    }

    pub fn of(&self, i: usize) -> &[Tensor] {
        &self.params[i].tensors
    }

    /// Whether parameter `i`'s state has been written (see `ParamState::written`).
    pub fn of_written(&self, i: usize) -> bool {
        self.params[i].written
    }

    pub fn param_mut(&mut self, i: usize) -> &mut ParamState {
        &mut self.params[i]
    }

    /// The live state (shallow clones), named, in parameter then slot order.
    pub fn named(&self, params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(params.len() * 2);
        for (((name, _), st), slots) in params.iter().zip(&self.params).zip(&self.layouts) {
            for (slot, t) in slots.iter().zip(&st.tensors) {
                out.push((state_name(slot.name, name), t.shallow_clone()));
            }
        }
        out
    }

    /// The names of parameter `i` (named `param`)'s state tensors, in slot order.
    pub fn names_of(&self, i: usize, param: &str) -> Vec<String> {
        self.layouts[i]
            .iter()
            .map(|slot| state_name(slot.name, param))
            .collect()
    }

    /// Copies `saved` into the state (onto each tensor's device and kind) after checking that
    /// it names exactly this state, with each parameter's shape; `stepped` says which
    /// parameters have state here. On a mismatch nothing is written and the problems come back.
    pub fn load(
        &mut self,
        params: &[(String, Tensor)],
        saved: &[(String, Tensor)],
        written: bool,
        stepped: impl Fn(usize) -> bool,
    ) -> Result<(), Vec<String>> {
        let sources = self.match_saved(params, saved, stepped)?;
        tch::no_grad(|| {
            for (st, row) in self.params.iter_mut().zip(sources) {
                for (dst, src) in st.tensors.iter_mut().zip(row) {
                    dst.copy_(src);
                }
            }
        });
        self.params.iter_mut().for_each(|p| p.written = written);
        Ok(())
    }

    /// Pairs every slot of every stepped parameter with its saved tensor, in state order, or
    /// lists what does not fit.
    fn match_saved<'a>(
        &self,
        params: &[(String, Tensor)],
        saved: &'a [(String, Tensor)],
        stepped: impl Fn(usize) -> bool,
    ) -> Result<Vec<Vec<&'a Tensor>>, Vec<String>> {
        let mut given: HashMap<&str, &Tensor> = HashMap::with_capacity(saved.len());
        let mut duplicated = BTreeSet::new();
        for (name, t) in saved {
            if given.insert(name.as_str(), t).is_some() {
                duplicated.insert(name.as_str());
            }
        }
        let mut missing = Vec::new();
        let mut shape_errors = Vec::new();
        let mut known = HashSet::with_capacity(params.len() * 2);
        let mut sources = Vec::with_capacity(params.len());
        for (i, (name, _)) in params.iter().enumerate() {
            let mut row = Vec::with_capacity(self.layouts[i].len());
            for (full, slot) in self.names_of(i, name).into_iter().zip(&self.layouts[i]) {
                let want = &slot.size;
                match given.get(full.as_str()) {
                    Some(src) => {
                        if src.size() != *want {
                            shape_errors.push(format!("{full} has shape {:?}, the state {want:?}", src.size()));
                        }
                        row.push(*src);
                    }
                    None => missing.push(full.clone()),
                }
                known.insert(full);
            }
            if !stepped(i) {
                row.clear();
            }
            sources.push(row);
        }
        let unexpected: BTreeSet<&str> = given.keys().copied().filter(|n| !known.contains(*n)).collect();
        let mut problems = Vec::new();
        if !missing.is_empty() {
            problems.push(format!("missing {}", missing.join(", ")));
        }
        if !unexpected.is_empty() {
            problems.push(format!("unexpected {}", Vec::from_iter(unexpected).join(", ")));
        }
        if !duplicated.is_empty() {
            problems.push(format!("duplicated {}", Vec::from_iter(duplicated).join(", ")));
        }
        problems.extend(shape_errors);
        match problems.is_empty() {
            true => Ok(sources),
            false => Err(problems),
        }
    }

    /// Moves every state tensor to `device` (state on the host stays there).
    pub fn move_to(&mut self, device: Device) {
        if self.home == Home::Host {
            return;
        }
        tch::no_grad(|| {
            for t in self.params.iter_mut().flat_map(|p| &mut p.tensors) {
                if t.device() != device {
                    *t = t.to_device(device);
                }
            }
        });
    }
}
