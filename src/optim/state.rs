//! Where the optimizer state lives and how a checkpoint names it.
use std::collections::{BTreeSet, HashMap, HashSet};

use tch::{Device, Tensor};

use crate::host::{Home, Host};

/// Every parameter's state: its slot tensors, on the parameter's device and kind (empty for a
/// parameter this process does not step).
pub struct StateStore {
    slots: &'static [&'static str],
    params: Vec<ParamState>,
    home: Home,
}

pub struct ParamState {
    /// One tensor per slot.
    pub tensors: Vec<Tensor>,
    /// Whether an update or a restored checkpoint has written `tensors` (see `ParamUpdate`).
    pub written: bool,
}

/// A checkpoint's state tensor named `<slot>/<param name>`.
fn state_name(slot: &str, param: &str) -> String {
    format!("{slot}/{param}")
}

impl StateStore {
    /// Zeros like each parameter `i` with `stepped(i)`, one per slot, on `home`: PyTorch's lazily created
    /// state starts at zero too (SGD's momentum buffer is tracked by `written`).
    pub fn allocate(
        slots: &'static [&'static str],
        params: &[(String, Tensor)],
        stepped: impl Fn(usize) -> bool,
        home: Home,
        host: &Host,
    ) -> Self {
        let params = tch::no_grad(|| {
            params
                .iter()
                .enumerate()
                .map(|(i, (_, p))| ParamState {
                    tensors: match (stepped(i), home) {
                        (true, Home::Device) => slots.iter().map(|_| p.zeros_like()).collect(),
                        (true, Home::Host) => slots.iter().map(|_| host.zeros_like(p)).collect(),
                        (false, _) => Vec::new(),
                    },
                    written: false,
                })
                .collect()
        });
        StateStore { slots, params, home }
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

    pub fn param_mut(&mut self, i: usize) -> &mut ParamState {
        &mut self.params[i]
    }

    /// The live state (shallow clones), named, in parameter then slot order.
    pub fn named(&self, params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(params.len() * self.slots.len());
        for ((name, _), st) in params.iter().zip(&self.params) {
            for (slot, t) in self.slots.iter().zip(&st.tensors) {
                out.push((state_name(slot, name), t.shallow_clone()));
            }
        }
        out
    }

    /// The names of parameter `param`'s state tensors, in slot order.
    pub fn names_of(&self, param: &str) -> Vec<String> {
        self.slots.iter().map(|slot| state_name(slot, param)).collect()
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
        let mut known = HashSet::with_capacity(params.len() * self.slots.len());
        let mut sources = Vec::with_capacity(params.len());
        for (i, (name, p)) in params.iter().enumerate() {
            let want = p.size();
            let mut row = Vec::with_capacity(self.slots.len());
            for full in self.names_of(name) {
                match given.get(full.as_str()) {
                    Some(src) => {
                        if src.size() != want {
                            shape_errors.push(format!("{full} has shape {:?}, the parameter {want:?}", src.size()));
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
