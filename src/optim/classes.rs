//! Parameter groups inside the optimizer. A class is a group's setting (learning-rate scale,
//! weight decay) and the step count its parameters started training at: 0, or the step at
//! which frozen parameters were unfrozen (`train.unfreeze_at_epoch`). A class steps as PyTorch
//! steps a param group: its learning rate is the scheduled one times its scale, and its Adam
//! bias corrections count its own steps, as a group added by `add_param_group` counts them.
use tch::Tensor;

use super::grads::GradBuffers;
use super::groups::{GroupReport, GroupSetting, Groups};
use super::rule::Step;
use super::shard::steps_param;
use super::Optimizer;

pub(super) struct Class {
    pub setting: GroupSetting,
    /// Optimizer steps taken before this class's first.
    pub start: i64,
}

impl Class {
    /// One class per group, all starting at step 0, and each parameter's class.
    pub fn of_groups(g: &Groups) -> (Vec<Class>, Vec<Option<usize>>) {
        let classes = g
            .settings
            .iter()
            .map(|s| Class {
                setting: s.clone(),
                start: 0,
            })
            .collect();
        (classes, g.of.clone())
    }
}

impl Optimizer {
    /// The step class `c` takes when the optimizer takes `base`.
    pub(super) fn class_step(&self, c: usize, base: Step) -> Step {
        let class = &self.classes[c];
        Step {
            number: base.number - class.start,
            lr: base.lr * class.setting.lr_scale,
        }
    }

    /// `live` split by class, each part in `live`'s order.
    pub(super) fn by_class(&self, live: &[(usize, Tensor)]) -> Vec<(usize, Vec<(usize, Tensor)>)> {
        let mut out: Vec<(usize, Vec<(usize, Tensor)>)> = Vec::new();
        for (i, g) in live {
            let c = self.class_of[*i].expect("a parameter with a gradient trains");
            let entry = (*i, g.shallow_clone());
            match out.iter_mut().find(|(k, _)| *k == c) {
                Some((_, v)) => v.push(entry),
                None => out.push((c, vec![entry])),
            }
        }
        out
    }

    /// Whether any parameter is frozen.
    pub fn has_frozen(&self) -> bool {
        self.class_of.iter().any(Option::is_none)
    }

    /// How many parameters train. It changes only when frozen ones start training, which changes
    /// what a step computes and updates: a captured step holds one such set.
    pub fn trained_count(&self) -> usize {
        self.class_of.iter().filter(|c| c.is_some()).count()
    }

    /// The frozen parameters start training, in the groups `all` (every parameter's, none
    /// frozen) gives them, as new classes that count their steps from `at` (the optimizer's
    /// step count when they start): they require gradients and get fresh state from now on.
    pub fn unfreeze(&mut self, all: &Groups, at: i64) {
        self.settle_now();
        for i in 0..self.params.len() {
            if self.class_of[i].is_some() {
                continue;
            }
            let setting = &all.settings[all.of[i].expect("every parameter trains in `all`")];
            let c = match self.classes.iter().position(|k| k.setting == *setting && k.start == at) {
                Some(c) => c,
                None => {
                    self.classes.push(Class {
                        setting: setting.clone(),
                        start: at,
                    });
                    self.rules.push(self.hyper.rule_with(setting.weight_decay));
                    self.multipliers.push(Default::default());
                    self.classes.len() - 1
                }
            };
            self.class_of[i] = Some(c);
            let p = self.params[i].1.shallow_clone();
            let _ = p.set_requires_grad(true);
            let slots = self.rules[c].layout(&p);
            let stepped = steps_param(self.shard.as_ref(), i);
            self.state.start(i, slots, &p, stepped, &self.host);
        }
        if self.host_grads.is_some() {
            self.host_grads = Some(GradBuffers::allocate(&self.host, &self.params, &self.class_of));
        }
        self.staged = None;
        self.masters.drop_all();
    }

    /// (gradient bytes of one step: every parameter that trains; bytes of the state this
    /// process holds). Reads sizes only: no need to settle a pending update.
    pub fn trained_bytes(&self) -> (u64, u64) {
        let grads = self
            .params
            .iter()
            .zip(&self.class_of)
            .filter(|(_, c)| c.is_some())
            .map(|((_, p), _)| crate::memory::tensor_bytes(p))
            .sum();
        let state = (0..self.params.len())
            .flat_map(|i| self.state.of(i))
            .map(crate::memory::tensor_bytes)
            .sum();
        (grads, state)
    }

    /// The step count at which frozen parameters were unfrozen, if they were.
    pub fn unfrozen_at(&self) -> Option<i64> {
        self.classes.iter().map(|c| c.start).filter(|s| *s > 0).max()
    }

    /// Each class with its parameters' count, and the frozen parameters' count.
    pub fn group_report(&self) -> (Vec<GroupReport>, u64) {
        let mut out: Vec<GroupReport> = self
            .classes
            .iter()
            .map(|c| GroupReport {
                name: c.setting.name.clone(),
                parameters: 0,
                tensors: 0,
                lr_scale: c.setting.lr_scale,
                weight_decay: c.setting.weight_decay,
                start_step: c.start,
            })
            .collect();
        let mut frozen = 0;
        for ((_, p), c) in self.params.iter().zip(&self.class_of) {
            match c {
                Some(c) => {
                    out[*c].parameters += p.numel() as u64;
                    out[*c].tensors += 1;
                }
                None => frozen += p.numel() as u64,
            }
        }
        (out, frozen)
    }
}
