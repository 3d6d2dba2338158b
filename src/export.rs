//! `memtrain export RUN_DIR --format torchvision|timm|huggingface OUT`: a run's weights, with
//! any LoRA adapters merged into the layers they adapt, under the names another library loads
//! (a llama run as a Hugging Face `LlamaForCausalLM` or `Qwen2ForCausalLM` directory).
//!
//! The model is built from the run's resolved spec on the CPU, its base read from
//! `model.init_from` where the checkpoint holds only what trained (and only if that file is
//! still the one the run trained over), or else drawn again from the run's seed as the run drew
//! it, and the checkpoint copied in. Everything is written into
//! a temporary directory beside OUT and renamed into place, so a failed export leaves nothing.
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use tch::{nn, Device, Tensor};

use crate::checkpoint::{self, BaseRef};
use crate::cli::{ExportArgs, ExportFormat};
use crate::exit::UsageError;
use crate::model::{self, lora};
use crate::run::Kept;
use crate::spec::schema::Spec;

pub fn export(args: &ExportArgs) -> Result<()> {
    if args.out.exists() {
        return Err(UsageError(format!(
            "{} already exists: export writes a new directory; choose another OUT or remove it",
            args.out.display()
        ))
        .into());
    }
    // What the format cannot hold is refused from the spec, before the model (and a base of
    // gigabytes) is read.
    held(&Trained::spec_of(&args.run_dir)?, args.format)?;
    let trained = Trained::read(&args.run_dir, args.checkpoint.as_deref())?;
    let merged = trained.merged()?;
    let (tensors, config) = match trained.spec.model.preset.as_str() {
        "vit" => vit_names(&trained.spec, merged, args.format)?,
        "llama" => llama_names(&trained.spec, merged)?,
        "mlp" => mlp_names(merged)?,
        _ => (merged.into_iter().collect(), None),
    };
    write_dir(&args.out, &tensors, config.as_ref())?;
    crate::outln!(
        "exported {} ({} tensors, {}) from {} to {}",
        args.format.name(),
        tensors.len(),
        match trained.adapted {
            true => "LoRA merged",
            false => "as trained",
        },
        trained.checkpoint.display(),
        args.out.display()
    )?;
    if trained.spec.model.preset == "vit" {
        let o = vit_options(&trained.spec)?;
        if o.projection_dim > 0 {
            crate::outln!(
                "the projection is folded into the head: head weight = heads.head.weight · projection.weight"
            )?;
        }
        if args.format == ExportFormat::Timm {
            // timm's file names no options: the model to load it into must be built with them.
            crate::outln!("load it into timm's {}", timm_vit_constructor(&o))?;
        }
    }
    Ok(())
}

/// The timm `VisionTransformer` call that holds a vit of options `o` (with `from functools
/// import partial` and `from torch import nn`).
fn timm_vit_constructor(o: &model::VitOptions) -> String {
    let act = match o.activation {
        model::Activation::Gelu => "gelu",
        model::Activation::QuickGelu => "quick_gelu",
    };
    let python_bool = |b: bool| if b { "True" } else { "False" };
    format!(
        "VisionTransformer(img_size={}, patch_size={}, in_chans={}, embed_dim={}, depth={}, num_heads={}, \
         mlp_ratio={}, num_classes={}, pre_norm={}, act_layer=\"{act}\", norm_layer=partial(nn.LayerNorm, eps={:e}))",
        o.image_size,
        o.patch_size,
        o.in_channels,
        o.hidden_dim,
        o.layers,
        o.heads,
        o.mlp_dim as f64 / o.hidden_dim as f64,
        o.num_classes,
        python_bool(o.pre_norm),
        o.layer_norm_eps
    )
}

/// A run's model as trained: its spec and every variable, base and checkpoint together.
pub struct Trained {
    pub spec: Spec,
    pub vs: nn::VarStore,
    pub built: model::Built,
    pub checkpoint: PathBuf,
    pub adapted: bool,
}

impl Trained {
    /// The model of `run_dir` at `checkpoint` (default: the best, else the newest).
    pub fn read(run_dir: &Path, checkpoint: Option<&Path>) -> Result<Trained> {
        let spec = Trained::spec_of(run_dir)?;
        // A checkpoint directory or its model.safetensors, as eval and generate take them.
        let ck = crate::checkpoint::weights_file(run_dir, checkpoint)?;
        // Drawn as the run drew it: a LoRA run without model.init_from trained over that draw.
        let mut vs = nn::VarStore::new(Device::Cpu);
        let built = tch::no_grad(|| crate::run::drawn_model(&mut vs, &spec))?;
        let adapted = weights_into(&vs, &built.head, &spec, &ck)?;
        let low = spec.train.precision == crate::spec::Precision::Bf16
            || spec.train.frozen_dtype == crate::spec::FrozenDtype::Bf16;
        if low {
            // Written in fp32 as ever: the values the run trained (a bf16 base widens exactly),
            // with the adapters merged in fp32, not rounded into a bf16 weight.
            vs.float();
        }
        Ok(Trained {
            spec,
            vs,
            built,
            checkpoint: ck,
            adapted,
        })
    }

    /// The run's resolved spec.
    pub fn spec_of(run_dir: &Path) -> Result<Spec> {
        let spec_file = run_dir.join("config.resolved.toml");
        if !spec_file.is_file() {
            return Err(UsageError(format!(
                "{} is not a run directory (it has no config.resolved.toml): give the directory `memtrain run` wrote",
                run_dir.display()
            ))
            .into());
        }
        Ok(crate::spec::load_args(&spec_file, &[], &model::validate)?.spec)
    }

    /// Every variable by name, with each adapter merged into its layer (`W += B A · scale`, for
    /// a convolution over its kernel) and the adapters themselves left out.
    pub fn merged(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut vars: BTreeMap<String, Tensor> = self
            .vs
            .variables()
            .into_iter()
            .map(|(n, t)| (n, t.detach().copy()))
            .collect();
        let Some(o) = model::lora_options(&self.spec.model)? else {
            return Ok(vars);
        };
        let a_suffix = format!(".{}", lora::ADAPTER_VARS[0]);
        let layers: Vec<String> = vars
            .keys()
            .filter_map(|n| n.strip_suffix(&a_suffix))
            .map(str::to_owned)
            .collect();
        for layer in layers {
            let a = vars
                .remove(&format!("{layer}.{}", lora::ADAPTER_VARS[0]))
                .expect("listed");
            let b = vars
                .remove(&format!("{layer}.{}", lora::ADAPTER_VARS[1]))
                .with_context(|| format!("{layer} has lora_A but no lora_B"))?;
            let delta = lora::delta_weight(&a, &b, o.scale());
            let (target, rows) = merged_into(&layer);
            let w = vars
                .get_mut(&target)
                .with_context(|| format!("the adapted layer {layer} has no weight {target}"))?;
            let d = delta.size()[0];
            let _ = w.narrow(0, rows * d, d).g_add_(&delta.to_kind(w.kind()));
        }
        Ok(vars)
    }
}

/// A checkpoint's weights (its `model.safetensors`) into the model built from its run's spec:
/// where the checkpoint keeps
/// only what trained over a frozen base (LoRA), the base first, from `model.init_from`, which must
/// still be the file it names. True when the model has adapters.
pub fn weights_into(vs: &nn::VarStore, head: &[String], spec: &Spec, file: &Path) -> Result<bool> {
    let kept = crate::checkpoint::read_safetensors(file)?;
    let ck = file.parent().unwrap_or(Path::new("."));
    let recorded = BaseRef::in_checkpoint(ck)?;
    let adapted = model::lora_options(&spec.model)?.is_some();
    if let Some(path) = &spec.model.init_from {
        if let Some(then) = &recorded {
            let now = BaseRef::of(path).with_context(|| format!("model.init_from {}", path.display()))?;
            let fix = format!("put the base it was trained on back at {}", then.path.display());
            BaseRef::must_match(Some(then), Some(&now), ck, &fix)?;
        }
        if recorded.is_some() || adapted {
            base_under_checkpoint(vs, head, &spec.model, path)?;
        }
    }
    // A checkpoint over a frozen base holds what trains: the adapters and the extras, and the
    // BatchNorm running statistics, which follow the batches where BatchNorm trains.
    let rule = match (recorded.is_some() || adapted, model::lora_options(&spec.model)?) {
        (true, Some(o)) => Kept::Trained {
            names: vs
                .variables()
                .into_keys()
                .filter(|n| o.trains(n))
                .chain(model::buffers(vs).into_iter().map(|(n, _)| n))
                .collect(),
            base: None,
        },
        _ => Kept::Whole,
    };
    crate::run::copy_into(vs, &kept, &format!("the checkpoint {}", file.display()), &rule)?;
    Ok(adapted)
}

/// `model.init_from` read as the base a checkpoint goes over: what the plan creates (adapters,
/// a head) comes from the checkpoint next, so its "created" would mislead; the line says what
/// was read.
fn base_under_checkpoint(vs: &nn::VarStore, head: &[String], model: &crate::spec::Model, path: &Path) -> Result<()> {
    let loaded = crate::run::read_init_from(vs, head, model, path)?;
    tracing::info!(
        "model.init_from {}: {} tensors of the base read; the checkpoint's weights go over them",
        path.display(),
        loaded.plan.kept.len()
    );
    Ok(())
}

/// The weight an adapter merges into, and which `d`-row slice of it: the packed in-projection's
/// query, key and value parts are its slices 0, 1 and 2.
fn merged_into(layer: &str) -> (String, i64) {
    for (i, part) in ["in_proj_q", "in_proj_k", "in_proj_v"].iter().enumerate() {
        if let Some(owner) = layer.strip_suffix(part) {
            return (format!("{owner}in_proj_weight"), i as i64);
        }
    }
    (format!("{layer}.weight"), 0)
}

/// The tensors under the format's names, and its `config.json` where it has one.
type Exported = (Vec<(String, Tensor)>, Option<serde_json::Value>);

fn vit_options(spec: &Spec) -> Result<model::VitOptions> {
    let v = spec
        .model
        .options
        .get("vit")
        .cloned()
        .unwrap_or(toml::Value::Table(Default::default()));
    Ok(v.try_into()?)
}

/// Whether `format` holds the run's model: a preset it has no class for, or a vit option its
/// class does not compute, is refused.
fn held(spec: &Spec, format: ExportFormat) -> Result<()> {
    use ExportFormat::{Huggingface, Torchvision};
    let preset = spec.model.preset.as_str();
    let why = match (preset, format) {
        ("vit", f) => vit_unheld(&vit_options(spec)?, f),
        ("resnet18" | "resnet34" | "resnet50", Huggingface) => Some(format!(
            "transformers' ResNet is built differently from torchvision's {preset}; export it as torchvision or timm"
        )),
        // torchvision's names, which timm's ResNets share.
        ("resnet18" | "resnet34" | "resnet50", _) => None,
        ("mlp", Torchvision) | ("llama", Huggingface) => None,
        ("mlp", _) => {
            Some("it has no multilayer perceptron of this shape; export it as torchvision (torchvision.ops.MLP)".into())
        }
        ("llama", _) => Some("it holds image models, not language models; export it as huggingface".into()),
        (other, f) => {
            return Err(UsageError(format!(
                "the {other} preset has no counterpart in {}: export takes vit, resnet, mlp and llama runs",
                f.name()
            ))
            .into())
        }
    };
    match why {
        Some(why) => Err(cannot_hold(format, &why)),
        None => Ok(()),
    }
}

/// A format that has no place for part of the model.
fn cannot_hold(format: ExportFormat, what: &str) -> anyhow::Error {
    // A reason that names the format to use says it once.
    let instead = match what.contains("export it as") {
        true => "",
        false => "; export it as another format",
    };
    UsageError(format!(
        "{} cannot hold this model: {what}{instead} (docs/commands.md#memtrain-export lists what each holds)",
        format.name()
    ))
    .into()
}

/// The vit preset's variables under torchvision's (its own), timm's or Hugging Face's names.
/// What a format's class lacks but computes the same way is written in its form: a projection
/// is folded into the head, a missing patch bias is a zero bias, and under timm's `pre_norm`
/// (which has no patch bias) the patch bias is folded into the patches' position embeddings.
fn vit_names(spec: &Spec, mut vars: BTreeMap<String, Tensor>, format: ExportFormat) -> Result<Exported> {
    let o = vit_options(spec)?;
    fold_projection(&mut vars)?;
    patch_bias_as_held(&mut vars, &o, format)?;
    let out = match format {
        ExportFormat::Torchvision => vars.into_iter().collect(),
        ExportFormat::Timm => vars.into_iter().map(|(n, t)| (timm_vit_name(&n), t)).collect(),
        ExportFormat::Huggingface => {
            let mut out = vec![];
            for i in 0..o.layers {
                let m = format!("encoder.layers.encoder_layer_{i}.self_attention.in_proj_");
                let h = format!("vit.encoder.layer.{i}.attention.attention.");
                for n in ["weight", "bias"] {
                    let packed = vars.remove(&format!("{m}{n}")).context("a ViT block without in_proj")?;
                    for (part, t) in ["query", "key", "value"].iter().zip(packed.chunk(3, 0)) {
                        out.push((format!("{h}{part}.{n}"), t.contiguous()));
                    }
                }
            }
            out.extend(vars.into_iter().map(|(n, t)| (hf_vit_name(&n), t)));
            return Ok((out, Some(hf_vit_config(&o))));
        }
    };
    Ok((out, None))
}

/// Why `format`'s ViT class cannot compute this model's forward, if it cannot. timm's
/// `VisionTransformer` computes every vit the preset builds (`pre_norm`, `act_layer`,
/// `norm_layer`), so it is the one named instead.
fn vit_unheld(o: &model::VitOptions, format: ExportFormat) -> Option<String> {
    let quick = o.activation == model::Activation::QuickGelu;
    match format {
        ExportFormat::Torchvision if o.pre_norm => Some(
            "torchvision's VisionTransformer has no LayerNorm before the first block (pre_norm); export it as timm"
                .into(),
        ),
        ExportFormat::Torchvision if quick => Some(
            "torchvision's VisionTransformer computes the exact GELU, not quick_gelu; export it as timm or huggingface"
                .into(),
        ),
        ExportFormat::Torchvision if o.layer_norm_eps != 1e-6 => {
            Some("torchvision's ViT fixes layer_norm_eps at 1e-6".into())
        }
        ExportFormat::Huggingface if o.pre_norm => Some(
            "no transformers image classifier has a LayerNorm before the first block (pre_norm) with a head on \
             the class token (CLIPForImageClassification's head reads the mean of the patch tokens, without the \
             final LayerNorm); export it as timm"
                .into(),
        ),
        _ => None,
    }
}

/// A projection (`projection_dim`) folded into the head: no format's ViT classifier has a
/// linear layer between the class token and the head, and `head(projection(x))` is the one
/// linear map `x · (H P)ᵀ + b`, computed here in double precision.
fn fold_projection(vars: &mut BTreeMap<String, Tensor>) -> Result<()> {
    let Some(p) = vars.remove("projection.weight") else {
        return Ok(());
    };
    let h = vars
        .get_mut("heads.head.weight")
        .context("a ViT with a projection but no heads.head")?;
    let kind = h.kind();
    *h = h
        .to_kind(tch::Kind::Double)
        .matmul(&p.to_kind(tch::Kind::Double))
        .to_kind(kind);
    Ok(())
}

/// The patch embedding's bias in the form `format` holds: torchvision's, Hugging Face's and
/// plain timm's have one (zero where the model has none); timm's under `pre_norm` has none, so
/// a bias, added to every patch token, joins the patch tokens' position embeddings.
fn patch_bias_as_held(vars: &mut BTreeMap<String, Tensor>, o: &model::VitOptions, format: ExportFormat) -> Result<()> {
    let biasless = format == ExportFormat::Timm && o.pre_norm;
    match (o.patch_bias, biasless) {
        (true, true) => {
            let b = vars
                .remove("conv_proj.bias")
                .context("patch_bias without conv_proj.bias")?;
            let pos = vars
                .get_mut("encoder.pos_embedding")
                .context("a ViT without encoder.pos_embedding")?;
            let tokens = pos.size()[1];
            let _ = pos.narrow(1, 1, tokens - 1).g_add_(&b);
        }
        (false, false) => {
            let w = vars.get("conv_proj.weight").context("a ViT without conv_proj.weight")?;
            let zero = Tensor::zeros([w.size()[0]], (w.kind(), w.device()));
            vars.insert("conv_proj.bias".into(), zero);
        }
        _ => {}
    }
    Ok(())
}

fn timm_vit_name(n: &str) -> String {
    if let Some(rest) = n.strip_prefix("encoder.layers.encoder_layer_") {
        let (i, part) = rest.split_once('.').unwrap_or((rest, ""));
        let part = part
            .replace("self_attention.in_proj_weight", "attn.qkv.weight")
            .replace("self_attention.in_proj_bias", "attn.qkv.bias")
            .replace("self_attention.out_proj", "attn.proj")
            .replace("ln_1", "norm1")
            .replace("ln_2", "norm2")
            .replace("mlp.0", "mlp.fc1")
            .replace("mlp.3", "mlp.fc2");
        return format!("blocks.{i}.{part}");
    }
    match n {
        "class_token" => "cls_token".into(),
        "encoder.pos_embedding" => "pos_embed".into(),
        _ => n
            .replace("ln_pre", "norm_pre")
            .replace("conv_proj", "patch_embed.proj")
            .replace("encoder.ln", "norm")
            .replace("heads.head", "head"),
    }
}

fn hf_vit_name(n: &str) -> String {
    if let Some(rest) = n.strip_prefix("encoder.layers.encoder_layer_") {
        let (i, part) = rest.split_once('.').unwrap_or((rest, ""));
        let part = part
            .replace("self_attention.out_proj", "attention.output.dense")
            .replace("ln_1", "layernorm_before")
            .replace("ln_2", "layernorm_after")
            .replace("mlp.0", "intermediate.dense")
            .replace("mlp.3", "output.dense");
        return format!("vit.encoder.layer.{i}.{part}");
    }
    match n {
        "class_token" => "vit.embeddings.cls_token".into(),
        "encoder.pos_embedding" => "vit.embeddings.position_embeddings".into(),
        _ => n
            .replace("conv_proj", "vit.embeddings.patch_embeddings.projection")
            .replace("encoder.ln", "vit.layernorm")
            .replace("heads.head", "classifier"),
    }
}

/// Hugging Face's `ViTConfig` for `ViTForImageClassification` at the preset's sizes.
fn hf_vit_config(o: &model::VitOptions) -> serde_json::Value {
    let labels: serde_json::Map<String, serde_json::Value> = (0..o.num_classes)
        .map(|i| (i.to_string(), format!("LABEL_{i}").into()))
        .collect();
    let ids: serde_json::Map<String, serde_json::Value> =
        (0..o.num_classes).map(|i| (format!("LABEL_{i}"), i.into())).collect();
    serde_json::json!({
        "architectures": ["ViTForImageClassification"],
        "model_type": "vit",
        "hidden_size": o.hidden_dim,
        "num_hidden_layers": o.layers,
        "num_attention_heads": o.heads,
        "intermediate_size": o.mlp_dim,
        "hidden_act": match o.activation {
            model::Activation::Gelu => "gelu",
            model::Activation::QuickGelu => "quick_gelu",
        },
        "hidden_dropout_prob": o.dropout,
        "attention_probs_dropout_prob": o.attention_dropout,
        "layer_norm_eps": o.layer_norm_eps,
        "image_size": o.image_size,
        "patch_size": o.patch_size,
        "num_channels": o.in_channels,
        "qkv_bias": true,
        "id2label": labels,
        "label2id": ids,
    })
}

/// The mlp preset as torchvision's `torchvision.ops.MLP(inputs, hidden + [num_classes])`, a
/// `Sequential` of Linear, ReLU and Dropout in which linear layer `i` is module `3 i`.
fn mlp_names(vars: BTreeMap<String, Tensor>) -> Result<Exported> {
    let renamed = |name: &str| -> Option<String> {
        let (layer, part) = name.strip_prefix("fc")?.split_once('.')?;
        Some(format!("{}.{part}", 3 * layer.parse::<usize>().ok()?))
    };
    vars.into_iter()
        .map(|(n, t)| match renamed(&n) {
            Some(m) => Ok((m, t)),
            None => anyhow::bail!("the mlp preset has no variable {n}"),
        })
        .collect::<Result<Vec<_>>>()
        .map(|v| (v, None))
}

/// The llama preset's names are Hugging Face's: `LlamaForCausalLM` (or `Qwen2ForCausalLM`) with
/// its `config.json`. A tied model's file holds the embedding alone, as `save_pretrained` writes.
fn llama_names(spec: &Spec, vars: BTreeMap<String, Tensor>) -> Result<Exported> {
    let options = spec.model.options.get("llama").cloned();
    let o: model::llama::LlamaOptions = options.unwrap_or(toml::Value::Table(Default::default())).try_into()?;
    Ok((vars.into_iter().collect(), Some(model::llama::hf_config(&o))))
}

/// `model.safetensors` (and `config.json`) in a new directory, all or nothing.
fn write_dir(out: &Path, tensors: &[(String, Tensor)], config: Option<&serde_json::Value>) -> Result<()> {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = out.with_file_name(format!(".{name}.partial"));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let written = (|| -> Result<()> {
        checkpoint::write_safetensors(&tmp.join("model.safetensors"), tensors)?;
        if let Some(c) = config {
            fs::write(tmp.join("config.json"), serde_json::to_vec_pretty(c)?)?;
        }
        fs::rename(&tmp, out).with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))
    })();
    if written.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    written
}
