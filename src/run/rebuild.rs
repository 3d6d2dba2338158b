//! A run's model as its training built it, for the commands that take a run up again from its
//! checkpoint (`eval`, `generate`, `export`): the same draw, the same dtype and the same frozen
//! storage, through the code training itself uses.
use anyhow::Result;
use tch::nn;

use crate::exit::UsageError;
use crate::model::{self, Built, Net};
use crate::spec::{FrozenDtype, Precision, Spec};

/// The model of `spec` as a run draws it before it reads any file: from the run's seed
/// (`job.seed`), and in bf16 under `train.precision = "bf16"`.
///
/// A LoRA run without `model.init_from` trains over this draw, and its checkpoints keep only
/// what trains (the adapters and extras). Drawing again recovers that base bit for bit: the model
/// is built on the CPU (the TorchScript preset, which draws nothing, aside), whose seeded
/// generator gives the same values whatever device the run was on, and nothing draws between
/// the seed and the model. That costs nothing on disk, where keeping the base would write the
/// whole frozen model into every checkpoint of an adapter run.
pub fn drawn_model(vs: &mut nn::VarStore, spec: &Spec) -> Result<Built> {
    tch::manual_seed(spec.job.seed);
    let built = model::build(&vs.root(), &spec.model)?;
    if spec.train.precision == Precision::Bf16 {
        vs.bfloat16();
    }
    Ok(built)
}

/// `train.frozen_dtype = "bf16"` on a model drawn again and given its checkpoint: the weights the
/// run kept in bf16 are kept so here too, picked as the run picked them (its frozen weights,
/// `train.freeze` and LoRA's base, through `store_frozen`). The bytes it saves.
pub fn frozen_as_trained(spec: &Spec, vs: &nn::VarStore, net: &dyn Net) -> Result<u64> {
    if spec.train.frozen_dtype != FrozenDtype::Bf16 {
        return Ok(0);
    }
    let train = model::with_frozen(&spec.train, model::lora_frozen(vs, &spec.model)?);
    let groups = crate::optim::Groups::resolve(&train, &model::param_infos(vs, net)).map_err(UsageError)?;
    Ok(super::finetune::store_frozen(&train, vs, net, &groups))
}
