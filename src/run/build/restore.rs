//! A resumed run's model, optimizer state and generators, read back from its checkpoint; and
//! what the checkpoints keep of the model.

use anyhow::{Context, Result};
use tch::{nn, Device};

use super::{copy_into, dir_bytes, setup_try, Factory, CHANGE_RESUME};
use crate::checkpoint::{BaseRef, NamedTensors, Store};
use crate::fault::{self, Phase};
use crate::human::human_bytes;
use crate::model;
use crate::run::parts::{ArchStep, Kept, Trained};
use crate::shim;

impl Factory<'_> {
    /// What the checkpoints keep of the model: with a frozen base (LoRA), only what trains and
    /// the buffers (BatchNorm's running statistics, which follow the batches where BatchNorm
    /// trains), and the base's file by path and content.
    pub(super) fn kept(&self, vs: &nn::VarStore) -> Result<Kept> {
        let spec = &self.plan.spec;
        if model::lora_options(&spec.model)?.is_none() {
            return Ok(Kept::Whole);
        }
        let names = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .map(|(n, _)| n)
            .chain(model::buffers(vs).into_iter().map(|(n, _)| n))
            .collect();
        let base = match &spec.model.init_from {
            Some(p) => Some(BaseRef::of(p).with_context(|| format!("model.init_from {}", p.display()))?),
            None => None,
        };
        Ok(Kept::Trained { names, base })
    }

    /// A resumed run's model, optimizer state and generators, from its checkpoint. Some: the
    /// lever that moved the optimizer state to the host for the checkpoint to fit.
    pub(super) fn restore(
        &self,
        model: &mut Trained,
        arch: Option<&mut ArchStep>,
        device: Device,
    ) -> Result<Option<&str>> {
        let Some(r) = &self.plan.resume else { return Ok(None) };
        let _squeeze = fault::squeeze_in(Phase::Resume, r.state.global_step);
        let what = format!("{} from {}", Phase::Resume.label(), r.checkpoint.display());
        let size = human_bytes(dir_bytes(&r.checkpoint));
        let needs = || Some(format!("the checkpoint is {size} on disk"));
        let read = |home| setup_try(&what, &needs, &CHANGE_RESUME, || Store::load(&r.checkpoint, home));
        let (ck, moved) = crate::run::resume::read(&mut model.opt, self.plan.offload_on_oom, read)?;
        // A checkpoint of adapters resumes only over the base it was trained on.
        let then = BaseRef::in_checkpoint(&r.checkpoint)?;
        let fix = "resume with the base it was trained on (model.init_from), or start a new run";
        BaseRef::must_match(then.as_ref(), model.kept.base(), &r.checkpoint, fix)?;
        let copy = || copy_into(&model.vs, &ck.model, "checkpoint model", &model.kept);
        setup_try(&what, &needs, &CHANGE_RESUME, copy)?;
        let pick = |prefix: &str| -> NamedTensors {
            ck.optimizer
                .iter()
                .filter_map(|(n, t)| n.strip_prefix(prefix).map(|s| (s.to_owned(), t.shallow_clone())))
                .collect()
        };
        model.unfreeze_from_checkpoint(ck.state.unfrozen_at)?;
        setup_try(&what, &|| None, &CHANGE_RESUME, || {
            model.opt.load_state(&pick("weight/"), ck.state.weight_steps)
        })?;
        for (name, t) in pick("rng/") {
            // A checkpoint from a CUDA run resumed on the CPU keeps only the CPU stream.
            let d = match name.as_str() {
                "cpu" => Device::Cpu,
                _ if device != Device::Cpu => device,
                _ => continue,
            };
            let bytes = Vec::<u8>::try_from(&t).context("reading a generator state from the checkpoint")?;
            shim::set_rng_state(d, &bytes).context("restoring the generator state")?;
        }
        if let Some(a) = arch {
            a.opt.load_state(&pick("arch/"), ck.state.arch.arch_steps)?;
        }
        tracing::info!(
            "resuming from {} (epoch {}, step {}, micro-batch {})",
            r.checkpoint.display(),
            r.state.epoch + 1,
            r.state.global_step,
            r.state.micro_batch
        );
        Ok(moved)
    }
}
