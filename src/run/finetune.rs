//! Frozen parameters and parameter groups in a run: the groups resolved over the built model,
//! the BatchNorm option handed to it, and the unfreezing at the start of its epoch.
use anyhow::Result;
use tch::{nn, Kind};

use super::parts::{Trained, Unfreeze};
use crate::exit::UsageError;
use crate::model::{self, Net};
use crate::optim::{GroupReport, Groups};
use crate::records::{GroupLine, TrainingSummary};
use crate::spec::schema::{FrozenDtype, Train};

/// The weights' groups under `t` (frozen ones without one), and the unfreezing it asks for.
/// Err: a pattern that matches no weight, a freeze of everything, a layer decay without blocks,
/// or an unfreezing in a data-parallel run.
pub fn groups(t: &Train, vs: &nn::VarStore, net: &dyn Net, parallel: bool) -> Result<(Groups, Option<Unfreeze>)> {
    let infos = model::param_infos(vs, net);
    let groups = Groups::resolve(t, &infos).map_err(UsageError)?;
    net.keep_frozen_norm_stats(t.freeze_batchnorm_stats);
    if !t.freeze.is_empty() || !t.param_groups.is_empty() || t.no_decay || t.layer_decay.is_some() {
        for l in summary_of(&groups, &infos).lines() {
            tracing::info!("{l}");
        }
    }
    let Some(epoch) = t.unfreeze_at_epoch else {
        return Ok((groups, None));
    };
    if parallel {
        return Err(UsageError(
            "train.unfreeze_at_epoch cannot run data-parallel (the ranks' gradient reducer is made for the parameters that train at the start); train in one process, or freeze for the whole run".into(),
        )
        .into());
    }
    let all = Groups::unfrozen(t, &infos).map_err(UsageError)?;
    Ok((groups, Some(Unfreeze { epoch: epoch - 1, all })))
}

/// `train.frozen_dtype = "bf16"`: the frozen weights autocast casts to bf16 for every use
/// (`model::autocast_weight`) are stored so, in place (the network holds the same tensors). The
/// bytes it saves, which go to the log.
pub fn store_frozen(t: &Train, vs: &nn::VarStore, net: &dyn Net, groups: &Groups) -> u64 {
    if t.frozen_dtype != FrozenDtype::Bf16 {
        return 0;
    }
    let mut saved = 0;
    let mixed = t.precision == crate::spec::Precision::Bf16Mixed;
    tch::no_grad(|| {
        for (_, t) in kept_in_bf16(vs, net, groups) {
            if t.kind() == Kind::BFloat16 {
                // Drawn in bf16 already (a base read from model.init_from): the fp32 it spares.
                if mixed {
                    saved += (t.numel() * 2) as u64;
                }
                continue;
            }
            saved += (t.numel() * (t.kind().elt_size_in_bytes() - 2)) as u64;
            let low = t.to_kind(Kind::BFloat16);
            t.shallow_clone().set_data(&low);
        }
    });
    tracing::info!(
        "train.frozen_dtype = \"bf16\": the frozen linear and convolution weights are kept in bf16 ({} saved)",
        crate::human::human_bytes(saved)
    );
    saved
}

/// The frozen weights autocast casts to bf16 for every use (`model::autocast_weight`): those
/// `train.frozen_dtype = "bf16"` keeps in bf16, by name.
pub fn kept_in_bf16(vs: &nn::VarStore, net: &dyn Net, groups: &Groups) -> Vec<(String, tch::Tensor)> {
    let mut vars = vs.variables();
    model::param_infos(vs, net)
        .into_iter()
        .zip(&groups.of)
        .filter(|(_, at)| at.is_none())
        .filter_map(|(p, _)| vars.remove_entry(&p.name))
        .filter(|(name, t)| model::autocast_weight(name, t))
        .collect()
}

impl Trained {
    /// At the start of epoch `epoch` (0-based): the frozen parameters start training if this is
    /// the epoch `train.unfreeze_at_epoch` names and they have not already.
    pub fn unfreeze_if_due(&mut self, epoch: i64) {
        let Some(u) = &self.unfreeze else { return };
        if epoch < u.epoch || !self.opt.has_frozen() {
            return;
        }
        let (_, frozen) = self.opt.group_report();
        let at = self.opt.steps_taken();
        self.opt.unfreeze(&u.all, at);
        tracing::info!(
            "epoch {}: {} frozen parameters start training (train.unfreeze_at_epoch), with fresh optimizer state from step {}",
            epoch + 1,
            crate::human::human_count(frozen),
            at + 1
        );
    }

    /// A checkpoint's unfreezing, before its optimizer state is loaded: the parameters it had
    /// unfrozen at optimizer step `at` train again, counting their steps from there.
    pub fn unfreeze_from_checkpoint(&mut self, at: Option<i64>) -> Result<()> {
        let Some(at) = at else { return Ok(()) };
        let Some(u) = &self.unfreeze else {
            return Err(UsageError(
                "the checkpoint's run had unfrozen its frozen parameters (train.unfreeze_at_epoch), and this spec does not unfreeze: resume with the spec the checkpoint was written with (its spec.toml)".into(),
            )
            .into());
        };
        self.opt.unfreeze(&u.all.clone(), at);
        Ok(())
    }

    /// The groups, the frozen parameters and what training costs, for summary.json.
    pub fn training_summary(&self) -> TrainingSummary {
        let (groups, frozen) = self.opt.group_report();
        let (gradient_bytes, optimizer_state_bytes) = self.opt.trained_bytes();
        TrainingSummary {
            trainable_parameters: groups.iter().map(|g| g.parameters).sum(),
            frozen_parameters: frozen,
            gradient_bytes,
            optimizer_state_bytes,
            groups: groups.into_iter().map(line).collect(),
        }
    }
}

/// The groups as they start, before an optimizer holds them.
fn summary_of(g: &Groups, infos: &[crate::optim::ParamInfo]) -> TrainingSummary {
    let mut groups: Vec<GroupLine> = g
        .settings
        .iter()
        .map(|s| GroupLine {
            name: s.name.clone(),
            parameters: 0,
            tensors: 0,
            lr_scale: s.lr_scale,
            weight_decay: s.weight_decay,
            start_step: 0,
        })
        .collect();
    let mut frozen = 0;
    for (p, at) in infos.iter().zip(&g.of) {
        match at {
            Some(i) => {
                groups[*i].parameters += p.numel;
                groups[*i].tensors += 1;
            }
            None => frozen += p.numel,
        }
    }
    TrainingSummary {
        trainable_parameters: groups.iter().map(|l| l.parameters).sum(),
        frozen_parameters: frozen,
        groups,
        ..Default::default()
    }
}

fn line(g: GroupReport) -> GroupLine {
    GroupLine {
        name: g.name,
        parameters: g.parameters,
        tensors: g.tensors,
        lr_scale: g.lr_scale,
        weight_decay: g.weight_decay,
        start_step: g.start_step,
    }
}
