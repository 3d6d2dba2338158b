//! Model presets. A preset is one file behind the `Preset` trait (its options and their checks,
//! how it is built, and any extra step it needs) plus one line in `PRESETS`.
//! Every preset is built into a `tch::nn::Path`, so all weights live in one VarStore and are
//! saved and loaded by name.
mod darts;
mod init;
mod layers;
pub mod llama;
pub mod lm_loss;
pub mod lora;
mod mlp;
mod preset;
mod resnet;
mod rounded;
mod torchscript;
mod vit;

use anyhow::Result;
use serde::de::DeserializeOwned;
use tch::{nn, Device};

use crate::data::classes::DataClasses;
use crate::spec::schema::{Data, Model};

pub use darts::{derive_genotype, Darts, DartsOptions};
pub use lm_loss::logits;
pub use lora::with_frozen;
pub use mlp::Mlp;
pub use preset::{block_vars, run_chain, Built, Chain, ExtraStep, Genotype, KvCache, Net, Preset, ARCH_PREFIX};
pub use vit::{Activation, VitOptions};

/// Values by role, as the static estimate counts them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    pub weights: u64,
    pub arch_weights: u64,
    pub buffers: u64,
    /// The value count of each trained (non-architecture) tensor, in VarStore order.
    pub weight_sizes: Vec<u64>,
    /// Weights `train.freeze` keeps from training (not in `weights`): no gradient, no state.
    pub frozen: u64,
    /// Of those, the values `train.frozen_dtype` can store in bf16 (`autocast_weight`).
    pub frozen_low: u64,
    /// Bytes that stay on the device while parameters stream (`Chain::resident`), in the dtype
    /// they are kept in.
    pub resident_bytes: u64,
    /// Of `weights`, the values of the resident variables that train: on the device with their
    /// gradient while parameters stream, updated on the host.
    pub resident_trained: u64,
    /// The model is a sequence of blocks (levers that work block by block apply).
    pub has_blocks: bool,
    /// Each variable belongs to one block, so parameters can stream block by block.
    pub blockwise: bool,
    /// The shape of one input sample.
    pub input_shape: Vec<i64>,
    /// A language model's vocabulary (its output projection's rows).
    pub vocab: Option<i64>,
}

/// The registry: one line per preset.
const PRESETS: &[&dyn AnyPreset] = &[
    &mlp::MlpPreset,
    &darts::DartsPreset,
    &resnet::ResNetPreset::<18>,
    &resnet::ResNetPreset::<34>,
    &resnet::ResNetPreset::<50>,
    &vit::VitPreset,
    &llama::LlamaPreset,
    &torchscript::TorchScriptPreset,
];

/// What the rest of memtrain sees of a preset: the typed trait above with its options parsed
/// from the spec.
trait AnyPreset: Sync {
    fn name(&self) -> &'static str;
    fn validate(&self, model: &Model) -> Vec<(String, String)>;
    fn resolved(&self, model: &Model) -> Option<toml::Value>;
    fn build(&self, root: &nn::Path, model: &Model) -> Result<Built>;
    fn extra_step(&self, model: &Model) -> Option<ExtraStep>;
}

impl<P: Preset> AnyPreset for P {
    fn name(&self) -> &'static str {
        P::NAME
    }

    fn validate(&self, model: &Model) -> Vec<(String, String)> {
        match options::<P::Options>(model, P::NAME) {
            Err(p) => vec![p],
            Ok(o) => P::check(&o)
                .into_iter()
                .map(|(k, m)| (format!("model.{}.{k}", P::NAME), m))
                .collect(),
        }
    }

    fn resolved(&self, model: &Model) -> Option<toml::Value> {
        let o = options::<P::Options>(model, P::NAME).ok()?;
        toml::Value::try_from(o).ok()
    }

    fn build(&self, root: &nn::Path, model: &Model) -> Result<Built> {
        let o = options::<P::Options>(model, P::NAME).map_err(|(k, m)| anyhow::anyhow!("{k} {m}"))?;
        P::build(root, &o)
    }

    fn extra_step(&self, model: &Model) -> Option<ExtraStep> {
        P::extra_step(&options::<P::Options>(model, P::NAME).ok()?)
    }
}

/// Parses `[model.<name>]`; a problem comes back as (dotted key, message) so the spec loader
/// can place it at its `file:line:col`.
fn options<T: DeserializeOwned + Default>(model: &Model, name: &str) -> Result<T, (String, String)> {
    let Some(v) = model.options.get(name) else {
        return Ok(T::default());
    };
    if !v.is_table() {
        return Err((format!("model.{name}"), format!("must be a table of {name} options")));
    }
    serde_path_to_error::deserialize(v.clone()).map_err(|e| {
        let path = e.path().to_string();
        let msg = e.inner().to_string();
        let msg = msg.lines().next().unwrap_or_default().trim().to_owned();
        let mut key = format!("model.{name}");
        if path != "." {
            key = format!("{key}.{path}");
        }
        if msg.starts_with("unknown field `") {
            // The path already ends at the unknown key.
            let known = msg.split_once(", expected").map(|(_, k)| k).unwrap_or_default();
            let of = match name {
                lora::TABLE => "the [model.lora] table".to_owned(),
                _ => format!("the {name} preset"),
            };
            return (key, format!("is not an option of {of} (expected{known})"));
        }
        (key, format!("is invalid: {}", crate::spec::plain_types(&msg)))
    })
}

fn preset_named(name: &str) -> Option<&'static dyn AnyPreset> {
    PRESETS.iter().copied().find(|p| p.name() == name)
}

fn preset_of(model: &Model) -> Result<&'static dyn AnyPreset> {
    preset_named(&model.preset).ok_or_else(|| anyhow::anyhow!("unknown preset \"{}\"", model.preset))
}

pub fn names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.name()).collect()
}

/// Presets whose input shape follows the data when the spec leaves it out: square images
/// `[in_channels, image_size, image_size]`, and a decoder's token windows `[seq_len]`.
const IMAGE_PRESETS: &[&str] = &["llama", "resnet18", "resnet34", "resnet50", "vit"];

/// The data's own sample shape, and how to name the data in a message.
pub struct DataImages<'a> {
    /// `[C, H, W]` (C is 0 where the data takes the model's channels); any other shape is not
    /// an image the presets take, and leaves them as configured.
    pub sample: &'a [i64],
    pub source: String,
}

fn data_words(d: &Data) -> String {
    let source = toml::Value::try_from(d.source)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    match &d.path {
        Some(p) => format!("data.source = \"{source}\", {}", p.display()),
        None => format!("data.source = \"{source}\""),
    }
}

/// One key that follows the data: set to the data's `value` where the spec leaves it out; a
/// different value in the spec is the message returned (`seen`: what the data's images are).
fn follow(table: &mut toml::map::Map<String, toml::Value>, name: &str, value: i64, seen: &str) -> Option<String> {
    match table.get(name).and_then(toml::Value::as_integer) {
        None => {
            table.insert(name.into(), toml::Value::Integer(value));
            None
        }
        Some(s) if s != value => Some(format!(
            "is {s}, but the data's images {seen}; leave {name} out to follow the data, or set it to {value}"
        )),
        Some(_) => None,
    }
}

/// An image preset's `image_size` and `in_channels` from the data where the spec leaves them
/// out; one the spec sets that the data contradicts is a problem naming both sizes. A ViT also
/// needs patches that tile the data's images.
pub fn follow_data(preset: &str, m: &mut Model, data: &DataImages) -> Vec<(String, String)> {
    if let (&[tokens], "llama") = (data.sample, preset) {
        return follow_window(m, tokens, &data.source);
    }
    let &[c, h, w] = data.sample else {
        return vec![];
    };
    let key = |k: &str| format!("model.{preset}.{k}");
    let table = match m
        .options
        .entry(preset.to_owned())
        .or_insert_with(|| toml::Value::Table(Default::default()))
    {
        toml::Value::Table(t) => t,
        _ => return vec![],
    };
    let mut problems = vec![];
    if h != w {
        if !table.contains_key("image_size") {
            problems.push((
                key("image_size"),
                format!(
                    "cannot follow the data: its images are {h}×{w} ({}), and {preset} takes square images; make them square",
                    data.source
                ),
            ));
        }
        return problems;
    }
    let size = follow(table, "image_size", h, &format!("are {h}×{h} ({})", data.source));
    problems.extend(size.map(|m| (key("image_size"), m)));
    if c > 0 {
        let channels = follow(table, "in_channels", c, &format!("have {c} channels ({})", data.source));
        problems.extend(channels.map(|m| (key("in_channels"), m)));
    }
    if preset == "vit" && problems.is_empty() {
        let patch = table
            .get("patch_size")
            .and_then(toml::Value::as_integer)
            .unwrap_or(vit::VitOptions::default().patch_size);
        if patch >= 1 && h % patch != 0 {
            let divisors: Vec<String> = (2..h).filter(|d| h % d == 0).map(|d| d.to_string()).collect();
            problems.push((
                key("patch_size"),
                format!(
                    "is {patch}, which does not tile the data's {h}×{h} images ({}; image_size follows the data); a ViT needs image_size % patch_size == 0: set patch_size to a divisor of {h}{}",
                    data.source,
                    match divisors.is_empty() {
                        true => String::new(),
                        false => format!(" ({})", divisors.join(", ")),
                    }
                ),
            ));
        }
    }
    problems
}

/// A decoder's `seq_len` from the token data's windows (`data.seq_len`).
fn follow_window(m: &mut Model, tokens: i64, source: &str) -> Vec<(String, String)> {
    let toml::Value::Table(table) = m
        .options
        .entry("llama".to_owned())
        .or_insert_with(|| toml::Value::Table(Default::default()))
    else {
        return vec![];
    };
    match table.get("seq_len").and_then(toml::Value::as_integer) {
        None => {
            table.insert("seq_len".into(), toml::Value::Integer(tokens));
            vec![]
        }
        Some(s) if s != tokens => vec![(
            "model.llama.seq_len".into(),
            format!("is {s}, but the data's windows are {tokens} tokens ({source}, data.seq_len); leave seq_len out to follow the data, or set both alike"),
        )],
        Some(_) => vec![],
    }
}

/// Presets whose head follows the data's classes where the spec leaves `num_classes` out; a
/// TorchScript module's output width is its own.
const CLASS_PRESETS: &[&str] = &["mlp", "darts", "resnet18", "resnet34", "resnet50", "vit"];

/// A classifier's `num_classes` from the data's classes where the spec leaves it out; one the
/// spec sets below the data's classes is a problem (its labels would not fit the head).
pub fn follow_classes(preset: &str, m: &mut Model, classes: &DataClasses, source: &str) -> Vec<(String, String)> {
    let key = format!("model.{preset}.num_classes");
    let toml::Value::Table(table) = m
        .options
        .entry(preset.to_owned())
        .or_insert_with(|| toml::Value::Table(Default::default()))
    else {
        return vec![];
    };
    let n = classes.count();
    match table.get("num_classes").map(toml::Value::as_integer) {
        // Not an integer: the preset's own check says so.
        Some(None) => vec![],
        None if n < 2 => vec![(
            key,
            format!(
                "cannot follow the data: it has {} ({source}), and a classifier needs at least 2; give the data more classes, or set num_classes",
                classes.describe()
            ),
        )],
        None => {
            table.insert("num_classes".into(), toml::Value::Integer(n));
            vec![]
        }
        Some(Some(k)) if k < n => vec![(
            key,
            format!(
                "is {k}, but the data has {} ({source}); set it to {n}, or leave it out to follow the data",
                classes.describe()
            ),
        )],
        Some(Some(_)) => vec![],
    }
}

/// What `run` and `check` say when the model has more classes than the data: the extra
/// outputs of the head train only as classes no sample has.
pub fn class_notice(m: &Model, classes: &DataClasses, data: &Data) -> Option<String> {
    if !CLASS_PRESETS.contains(&m.preset.as_str()) {
        return None;
    }
    let k = m.options.get(&m.preset)?.get("num_classes")?.as_integer()?;
    let n = classes.count();
    (k > n).then(|| {
        format!(
            "model.{}.num_classes is {k}, but the data has {} ({}): {} of the head's outputs belong to no sample; leave num_classes out to follow the data",
            m.preset,
            classes.describe(),
            data_words(data),
            k - n
        )
    })
}

/// The preset checks of a spec, and its options table completed with the defaults (so the
/// resolved spec that `check` prints and runs record shows every option).
pub fn validate(m: &mut Model, data: &Data) -> Vec<(String, String)> {
    let Some(p) = preset_named(&m.preset) else {
        return vec![(
            "model.preset".into(),
            format!(
                "is \"{}\", which is not a preset; choose one of: {}",
                m.preset,
                names().join(", ")
            ),
        )];
    };
    let mut problems = vec![];
    for key in m.options.keys() {
        if key == p.name() || key == lora::TABLE {
            continue;
        }
        let msg = if preset_named(key).is_some() {
            format!(
                "is set but model.preset is \"{}\"; remove [model.{key}] or set preset = \"{key}\"",
                p.name()
            )
        } else {
            format!(
                "is not a key of [model] (expected preset, init_from, init_format, init_skip or [model.{}])",
                p.name()
            )
        };
        problems.push((format!("model.{key}"), msg));
    }
    if !problems.is_empty() {
        return problems;
    }
    if IMAGE_PRESETS.contains(&p.name()) {
        // A data set that cannot be read is reported where it is loaded, with its own message.
        if let Ok(Some(sample)) = crate::data::sample_shape(data) {
            let from = DataImages {
                sample: &sample,
                source: data_words(data),
            };
            let follow = follow_data(p.name(), m, &from);
            if !follow.is_empty() {
                return follow;
            }
        }
    }
    if CLASS_PRESETS.contains(&p.name()) {
        // As above: a data set that cannot be read is reported where it is loaded.
        if let Ok(Some(classes)) = crate::data::classes::probe(data) {
            let follow = follow_classes(p.name(), m, &classes, &data_words(data));
            if !follow.is_empty() {
                return follow;
            }
        }
    }
    let follow = init::follow_checkpoint(m);
    if !follow.is_empty() {
        return follow;
    }
    problems.extend(p.validate(m));
    problems.extend(validate_lora(m));
    if problems.is_empty() {
        if let Some(v) = p.resolved(m) {
            m.options.insert(p.name().into(), v);
        }
    }
    problems
}

/// `[model.lora]`'s checks, and its table completed with the defaults.
fn validate_lora(m: &mut Model) -> Vec<(String, String)> {
    if !m.options.contains_key(lora::TABLE) {
        return vec![];
    }
    match options::<lora::LoraOptions>(m, lora::TABLE) {
        Err(p) => vec![p],
        Ok(o) => {
            let problems: Vec<(String, String)> = o
                .check()
                .into_iter()
                .map(|(k, msg)| (format!("model.{}.{k}", lora::TABLE), msg))
                .collect();
            if let (true, Ok(v)) = (problems.is_empty(), toml::Value::try_from(&o)) {
                m.options.insert(lora::TABLE.into(), v);
            }
            problems
        }
    }
}

/// The spec's `[model.lora]`, when it has one.
pub fn lora_options(model: &Model) -> Result<Option<lora::LoraOptions>> {
    if !model.options.contains_key(lora::TABLE) {
        return Ok(None);
    }
    options(model, lora::TABLE)
        .map(Some)
        .map_err(|(k, m)| anyhow::anyhow!("{k} {m}"))
}

/// With `[model.lora]`, the parameters that do not train (the base), by name.
pub fn lora_frozen(vs: &nn::VarStore, model: &Model) -> Result<Vec<String>> {
    let Some(o) = lora_options(model)? else {
        return Ok(vec![]);
    };
    Ok(parameters(vs)
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| !o.trains(n))
        .collect())
}

/// With `[model.lora]`, everything but the adapters and the extras stops training: its
/// variables no longer require a gradient.
pub fn freeze_base(vs: &nn::VarStore, model: &Model) -> Result<()> {
    let Some(o) = lora_options(model)? else {
        return Ok(());
    };
    for (name, t) in vs.variables() {
        if t.requires_grad() && !o.trains(&name) {
            let _ = t.shallow_clone().set_requires_grad(false);
        }
    }
    Ok(())
}

/// The preset's network, with `[model.lora]`'s adapters when the spec has them: they are made
/// after the base, so the base's initial weights are the same either way.
pub fn build(root: &nn::Path, model: &Model) -> Result<Built> {
    let mut built = preset_of(model)?.build(root, model)?;
    // What a preset did not round layer by layer (the embedding, a head), before the adapters.
    rounded::round_built(root);
    if let Some(o) = lora_options(model)? {
        let made = built.net.adapt(root, &o);
        if made.is_empty() {
            let (offered, kind) = (built.net.adaptable(), built.net.adaptable_kind());
            return Err(lora::no_target_among(&o, &model.preset, &offered, kind).into());
        }
        // A base checkpoint has no adapters: each is made fresh where it lacks them.
        for layer in &made {
            built.head.extend(["lora_A", "lora_B"].map(|a| format!("{layer}.{a}")));
        }
    }
    Ok(built)
}

pub fn extra_step(model: &Model) -> Option<ExtraStep> {
    preset_of(model).ok()?.extra_step(model)
}

/// Whether every variable of the model belongs to one block of its chain (parameters can
/// stream block by block).
pub fn blockwise(net: &dyn Net, vs: &nn::VarStore) -> bool {
    net.chain().is_some_and(|c| block_vars(c, vs).is_ok())
}

/// The VarStore's parameters (variables made trainable, frozen ones included: a frozen
/// parameter does not require a gradient but is no buffer), by name in name order.
pub fn parameters(vs: &nn::VarStore) -> Vec<(String, tch::Tensor)> {
    split_variables(vs).0
}

/// The VarStore's buffers (BatchNorm's running statistics: variables that never train), by
/// name in name order.
pub fn buffers(vs: &nn::VarStore) -> Vec<(String, tch::Tensor)> {
    split_variables(vs).1
}

/// Variables by name.
type Named = Vec<(String, tch::Tensor)>;

/// (parameters, buffers). A variable is a parameter when the VarStore lists it as trainable,
/// whatever its `requires_grad` (freezing turns that off); the list holds the same tensors,
/// so they are told apart by their storage.
fn split_variables(vs: &nn::VarStore) -> (Named, Named) {
    let trainable: std::collections::HashSet<usize> =
        vs.trainable_variables().iter().map(|t| t.data_ptr() as usize).collect();
    let mut vars: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars.into_iter().partition(|(_, t)| match t.numel() {
        // No storage to tell by: an empty tensor is what requires_grad says.
        0 => t.requires_grad(),
        _ => trainable.contains(&(t.data_ptr() as usize)),
    })
}

/// The weights (parameters other than architecture weights) in name order, as parameter
/// groups see them: with their block of the model's chain.
pub fn param_infos(vs: &nn::VarStore, net: &dyn Net) -> Vec<crate::optim::ParamInfo> {
    parameters(vs)
        .into_iter()
        .filter(|(n, _)| !n.starts_with(ARCH_PREFIX))
        .map(|(name, t)| crate::optim::ParamInfo {
            layer: net.chain().and_then(|c| c.layer_of(&name)),
            ndim: t.dim(),
            numel: t.numel() as u64,
            name,
        })
        .collect()
}

/// A linear layer's or convolution's weight (a `weight` of two or more dimensions): what autocast
/// casts for its matrix multiply or convolution, so keeping it in the autocast dtype computes the
/// same. Norms, biases, embeddings added to activations are used as they are stored. A packed
/// attention in-projection (`in_proj_weight`, as torchvision's ViT and PyTorch's
/// `MultiheadAttention` name it) is the query, key and value linears' weight. A token
/// embedding's weight is looked up, not multiplied: its rows start the residual stream in the
/// weight's own dtype (and a tied output projection reads it too), so it is no such weight.
pub fn autocast_weight(name: &str, t: &tch::Tensor) -> bool {
    (name.ends_with(".weight") || name.ends_with("in_proj_weight"))
        && t.dim() >= 2
        && !name.ends_with("embed_tokens.weight")
}

/// Static counts for `memtrain check`: a CPU build's variables by role, with the weights that
/// `train` freezes for the whole run apart (a run that unfreezes them later needs room for them
/// by then, so they count as trained). Err: a `train` pattern that matches no weight.
pub fn counts(model: &Model, train: &crate::spec::schema::Train) -> Result<Counts> {
    let (vs, built) = shaped(model)?;
    counts_of(vs, built, model, train)
}

/// How a model's frozen base is drawn, given that `train.frozen_dtype = "bf16"` (under
/// bf16-mixed) keeps it in bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BaseDraw {
    /// In fp32, as every variable: no base is kept in bf16 (or a TorchScript module brings its
    /// own values).
    Fp32,
    /// In bf16: `model.init_from` overwrites the draw, rounded to bf16 as the fp32 draw would
    /// have been, so drawing it in fp32 first would only cost host memory (32 GB for an 8B
    /// model, where its bf16 base is 16). What trains, and what the file lacks, is widened to
    /// fp32 before the file is read.
    Bf16,
    /// In fp32 and rounded as it is built ([`rounded`]), since no file overwrites it: the same
    /// values as rounding it once built, layer by layer where the preset rounds each layer.
    RoundedAsDrawn,
}

impl BaseDraw {
    pub fn of(model: &Model, train: &crate::spec::schema::Train) -> BaseDraw {
        let kept = model.preset != "torchscript"
            && train.frozen_dtype == crate::spec::FrozenDtype::Bf16
            && train.precision == crate::spec::Precision::Bf16Mixed;
        match (kept, model.init_from.is_some()) {
            (false, _) => BaseDraw::Fp32,
            (true, true) => BaseDraw::Bf16,
            (true, false) => BaseDraw::RoundedAsDrawn,
        }
    }

    /// Whether the host never holds the whole frozen base in fp32 while `preset` is built: read
    /// into bf16, or rounded by a preset that rounds each layer as it draws it (llama, vit;
    /// the others are drawn whole first).
    pub fn built_in_bf16(self, preset: &str) -> bool {
        match self {
            BaseDraw::Fp32 => false,
            BaseDraw::Bf16 => true,
            BaseDraw::RoundedAsDrawn => matches!(preset, "llama" | "vit"),
        }
    }
}

pub use rounded::RoundAsDrawn;

/// The spec's model with its variables' shapes and nothing in them: counting, and `check`'s
/// load plan, need no values, and a Llama-8B shape would otherwise fill 32 GB of host memory
/// with its fp32 initialisation first. A TorchScript module comes with its values from its
/// file, so it is built as it is.
pub(crate) fn shaped(model: &Model) -> Result<(nn::VarStore, Built)> {
    let vs = nn::VarStore::new(Device::Cpu);
    let _shapes = match model.preset.as_str() {
        "torchscript" => None,
        _ => Some(crate::shim::ShapeScope::enter()?),
    };
    let built = tch::no_grad(|| build(&vs.root(), model))?;
    Ok((vs, built))
}

fn counts_of(vs: nn::VarStore, built: Built, model: &Model, train: &crate::spec::schema::Train) -> Result<Counts> {
    freeze_base(&vs, model)?;
    let mut c = Counts {
        has_blocks: built.net.chain().is_some(),
        blockwise: blockwise(built.net.as_ref(), &vs),
        input_shape: built.input_shape.clone(),
        vocab: built.net.output_head().map(|w| w.size()[0]),
        ..Counts::default()
    };
    let infos = param_infos(&vs, built.net.as_ref());
    let train = &with_frozen(train, lora_frozen(&vs, model)?);
    let groups = crate::optim::Groups::resolve(train, &infos).map_err(crate::exit::UsageError)?;
    let frozen: std::collections::HashSet<&str> = match train.unfreeze_at_epoch {
        Some(_) => Default::default(),
        None => infos
            .iter()
            .zip(&groups.of)
            .filter(|(_, g)| g.is_none())
            .map(|(p, _)| p.name.as_str())
            .collect(),
    };
    let resident_names: std::collections::HashSet<String> = match built.net.chain() {
        Some(ch) => vs
            .variables()
            .into_keys()
            .filter(|n| ch.block_of(n).is_none() && ch.resident(n))
            .collect(),
        None => Default::default(),
    };
    let resident = |n: &str| resident_names.contains(n);
    drop(built);
    for (name, t) in vs.variables() {
        let n = t.numel() as u64;
        if name.starts_with(ARCH_PREFIX) {
            c.arch_weights += n;
        } else if frozen.contains(name.as_str()) {
            c.frozen += n;
            let low = autocast_weight(&name, &t);
            if low {
                c.frozen_low += n;
            }
            if resident(&name) {
                let bf16 = (low && train.frozen_dtype == crate::spec::FrozenDtype::Bf16)
                    || train.precision == crate::spec::Precision::Bf16;
                c.resident_bytes += n * if bf16 { 2 } else { 4 };
            }
        } else if t.requires_grad() {
            c.weights += n;
            c.weight_sizes.push(n);
            if resident(&name) {
                c.resident_trained += n;
            }
        } else {
            c.buffers += n;
        }
    }
    Ok(c)
}

/// The load plan of `model.init_from` for the model the spec builds (on the CPU, for its
/// variables' names and shapes), from the checkpoint's header: what `check` shows. A checkpoint
/// the model cannot take is the problem `run` would refuse it with, at `model.init_from`.
pub fn init_plan(m: &Model) -> Result<Option<crate::weights::LoadPlan>, (String, String)> {
    let Some(path) = &m.init_from else {
        return Ok(None);
    };
    let ck = crate::weights::Checkpoint::headers(path).map_err(|e| init::at_init_from(&format!("{e:#}")))?;
    // A model that cannot be built (LoRA targets that match no layer) is no fault of the
    // checkpoint: the estimate reports it in its own words, as for a spec without init_from.
    let Ok((vars, head)) = variables(m) else {
        return Ok(None);
    };
    crate::weights::plan_for(&ck, &vars, &head, m)
        .map(Some)
        .map_err(|e| init::at_init_from(&e.0))
}

/// The spec's model's variables (names and shapes) and its head.
fn variables(m: &Model) -> Result<(Vec<crate::weights::Shaped>, Vec<String>)> {
    let (vs, built) = shaped(m)?;
    Ok((crate::weights::shapes(&vs.variables()), built.head.clone()))
}

#[cfg(test)]
mod tests;
