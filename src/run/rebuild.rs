//! A run's model as its training built it, for the commands that take a run up again from its
//! checkpoint (`eval`, `generate`, `export`): the same draw, the same dtype and the same frozen
//! storage, through the code training itself uses.
use std::collections::HashSet;

use anyhow::Result;
use tch::{nn, Kind};

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
    // Which weights to round while drawing is read off the model's shapes before the seed, so
    // that nothing draws between the seed and the build.
    let draw = model::BaseDraw::of(&spec.model, &spec.train);
    let kept = match draw {
        model::BaseDraw::RoundedAsDrawn => Some(kept_in_bf16_by_name(spec)?),
        _ => None,
    };
    tch::manual_seed(spec.job.seed);
    let narrow = draw == model::BaseDraw::Bf16;
    if narrow {
        // An empty store: this sets the kind new variables are made in, and casts nothing.
        vs.set_kind(Kind::BFloat16);
    }
    let rounding = kept.map(model::RoundAsDrawn::enter);
    let built = model::build(&vs.root(), &spec.model)?;
    drop(rounding);
    if narrow {
        widen_all_but_the_frozen_base(spec, vs, built.net.as_ref())?;
    }
    if spec.train.precision == Precision::Bf16 {
        vs.bfloat16();
    }
    Ok(built)
}

/// The names of the weights `store_frozen` will keep in bf16, from the model's shapes alone.
fn kept_in_bf16_by_name(spec: &Spec) -> Result<HashSet<String>> {
    let (vs, built) = model::shaped(&spec.model)?;
    kept_names(spec, &vs, built.net.as_ref())
}

/// The names of the frozen weights `store_frozen` keeps in bf16.
fn kept_names(spec: &Spec, vs: &nn::VarStore, net: &dyn Net) -> Result<HashSet<String>> {
    let (_, groups) = frozen_groups(spec, vs, net)?;
    Ok(super::finetune::kept_in_bf16(vs, net, &groups)
        .into_iter()
        .map(|(name, _)| name)
        .collect())
}

/// Every variable back to fp32 but the frozen weights `store_frozen` keeps in bf16.
fn widen_all_but_the_frozen_base(spec: &Spec, vs: &nn::VarStore, net: &dyn Net) -> Result<()> {
    let kept = kept_names(spec, vs, net)?;
    tch::no_grad(|| {
        for (name, t) in vs.variables() {
            if !kept.contains(&name) && t.kind() == Kind::BFloat16 {
                t.shallow_clone().set_data(&t.to_kind(Kind::Float));
            }
        }
    });
    Ok(())
}

/// The run's `train` with LoRA's base frozen too, and its parameter groups: what decides which
/// weights are frozen, as training decides it.
fn frozen_groups(spec: &Spec, vs: &nn::VarStore, net: &dyn Net) -> Result<(crate::spec::Train, crate::optim::Groups)> {
    let train = model::with_frozen(&spec.train, model::lora_frozen(vs, &spec.model)?);
    let groups = crate::optim::Groups::resolve(&train, &model::param_infos(vs, net)).map_err(UsageError)?;
    Ok((train, groups))
}

/// `train.frozen_dtype = "bf16"` on a model drawn again and given its checkpoint: the weights the
/// run kept in bf16 are kept so here too, picked as the run picked them (its frozen weights,
/// `train.freeze` and LoRA's base, through `store_frozen`). The bytes it saves.
pub fn frozen_as_trained(spec: &Spec, vs: &nn::VarStore, net: &dyn Net) -> Result<u64> {
    if spec.train.frozen_dtype != FrozenDtype::Bf16 {
        return Ok(0);
    }
    let (train, groups) = frozen_groups(spec, vs, net)?;
    Ok(super::finetune::store_frozen(&train, vs, net, &groups))
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind};

    use super::*;

    /// An mlp (8 → 16 → 4) with adapters on fc0, under `seed` and `train`'s extra keys.
    fn spec(seed: u64, train: &str) -> Spec {
        let text = format!(
            "[job]\nseed = {seed}\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 8\nhidden = [16]\nnum_classes = 4\n\
             [model.lora]\nrank = 2\ntargets = [\"fc0\"]\n[train]\n{train}"
        );
        toml::from_str(&text).unwrap()
    }

    fn drawn(spec: &Spec) -> (nn::VarStore, Built) {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let built = drawn_model(&mut vs, spec).unwrap();
        (vs, built)
    }

    #[test]
    fn the_same_seed_draws_the_same_base_and_another_seed_another() {
        let w = |seed| drawn(&spec(seed, "")).0.variables()["fc0.weight"].copy();
        // Whatever was drawn before, the seed alone decides. Tests in parallel threads may draw
        // from the one generator between the seed and the build: a few tries before failing.
        let same = (0..5).any(|_| {
            let a = w(3);
            let _ = tch::Tensor::randn([100], (Kind::Float, Device::Cpu));
            a.equal(&w(3))
        });
        assert!(same, "seed 3 twice draws two bases");
        assert!(!w(3).equal(&w(4)), "seeds 3 and 4");
    }

    #[test]
    fn a_bf16_frozen_dtype_keeps_the_base_in_bf16_and_the_adapters_in_fp32() {
        let s = spec(3, "precision = \"bf16-mixed\"\nfrozen_dtype = \"bf16\"\n");
        let (vs, built) = drawn(&s);
        let saved = frozen_as_trained(&s, &vs, built.net.as_ref()).unwrap();
        let vars = vs.variables();
        assert_eq!(vars["fc0.weight"].kind(), Kind::BFloat16);
        assert_eq!(vars["fc0.lora_A.weight"].kind(), Kind::Float);
        assert!(saved >= 2 * 16 * 8, "{saved}");
        let (vs, built) = drawn(&spec(3, ""));
        assert_eq!(frozen_as_trained(&spec(3, ""), &vs, built.net.as_ref()).unwrap(), 0);
        assert_eq!(vs.variables()["fc0.weight"].kind(), Kind::Float);
    }

    /// A random base kept in bf16 is rounded layer by layer as it is drawn: every variable holds
    /// what an fp32 draw of the same seed holds once `store_frozen` has rounded it, in its kind.
    #[test]
    fn a_random_base_rounded_as_drawn_holds_what_the_fp32_draw_rounded_holds() {
        let llama = "[job]\nseed = 7\n[model]\npreset = \"llama\"\n[model.llama]\nvocab_size = 32\nhidden_size = 16\n\
             intermediate_size = 24\nnum_hidden_layers = 2\nnum_attention_heads = 2\nnum_key_value_heads = 1\n\
             max_position_embeddings = 64\ntie_word_embeddings = false\n[model.lora]\nrank = 2\ntargets = [\"q\", \"v\"]\n\
             [train]\nprecision = \"bf16-mixed\"\n";
        let llama: Spec = toml::from_str(llama).unwrap();
        let mlp = spec(7, "precision = \"bf16-mixed\"\n");
        for base in [llama, mlp] {
            let mut narrow = base.clone();
            narrow.train.frozen_dtype = FrozenDtype::Bf16;
            assert_eq!(
                model::BaseDraw::of(&narrow.model, &narrow.train),
                model::BaseDraw::RoundedAsDrawn
            );
            // Tests in parallel threads may draw from the one generator between a seed and its
            // build: a few tries before failing.
            let same = (0..5).any(|_| rounded_as_drawn_equals_rounded_once(&base, &narrow));
            assert!(
                same,
                "{}: the rounded draw differs from the fp32 draw rounded",
                base.model.preset
            );
        }
    }

    /// Whether `narrow` (`base` with a bf16 frozen dtype) draws, rounding as it goes, what `base`
    /// draws in fp32 and `store_frozen` rounds once built: values and kinds.
    fn rounded_as_drawn_equals_rounded_once(base: &Spec, narrow: &Spec) -> bool {
        let (vs, built) = drawn(narrow);
        let drawn_kinds: Vec<(String, Kind)> = vs.variables().into_iter().map(|(n, t)| (n, t.kind())).collect();
        frozen_as_trained(narrow, &vs, built.net.as_ref()).unwrap();
        let (wide, wide_built) = drawn(base);
        let (train, groups) = frozen_groups(narrow, &wide, wide_built.net.as_ref()).unwrap();
        super::super::finetune::store_frozen(&train, &wide, wide_built.net.as_ref(), &groups);
        let (a, b) = (vs.variables(), wide.variables());
        assert_eq!(a.len(), b.len());
        let low = drawn_kinds.iter().filter(|(_, k)| *k == Kind::BFloat16).count();
        assert!(low >= 2, "{low} weights rounded as drawn");
        drawn_kinds.iter().all(|(name, kind)| {
            assert_eq!(*kind, b[name].kind(), "{name}: drawn in the kind it is kept in");
            a[name].equal(&b[name])
        })
    }

    /// A base read from `model.init_from` under a bf16 frozen dtype is drawn in bf16 (half the
    /// host memory) and holds, once read, the bits an fp32 draw rounded by `store_frozen` holds;
    /// what trains and the 1-D frozen tensors are fp32.
    #[test]
    fn a_base_read_from_a_file_is_drawn_in_bf16_and_reads_what_an_fp32_draw_keeps() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("base.safetensors");
        let (wide, _) = drawn(&spec(5, ""));
        let base: Vec<(String, tch::Tensor)> = wide
            .variables()
            .into_iter()
            .filter(|(n, _)| !n.contains("lora"))
            .map(|(n, t)| (n, t.detach().g_mul_scalar(1.0 + 1e-3)))
            .collect();
        crate::checkpoint::write_safetensors(&file, &base).unwrap();
        let read = |train: &str| {
            let mut s = spec(3, train);
            s.model.init_from = Some(file.clone());
            let (vs, built) = drawn(&s);
            let kinds: Vec<(String, Kind)> = ["fc0.weight", "fc0.bias", "fc0.lora_A.weight"]
                .iter()
                .map(|n| (n.to_string(), vs.variables()[*n].kind()))
                .collect();
            super::super::build::init_from(&vs, &built.head, &s.model, &file).unwrap();
            frozen_as_trained(&s, &vs, built.net.as_ref()).unwrap();
            (vs, kinds)
        };
        let (narrow, kinds) = read("precision = \"bf16-mixed\"\nfrozen_dtype = \"bf16\"\n");
        assert_eq!(
            kinds,
            [
                ("fc0.weight".to_string(), Kind::BFloat16),
                ("fc0.bias".to_string(), Kind::Float),
                ("fc0.lora_A.weight".to_string(), Kind::Float)
            ]
        );
        let (fp32, _) = read("precision = \"bf16-mixed\"\n");
        let (a, b) = (narrow.variables(), fp32.variables());
        assert!(a["fc0.weight"].equal(&b["fc0.weight"].to_kind(Kind::BFloat16)));
        assert!(a["fc1.bias"].equal(&b["fc1.bias"]));
    }
}
