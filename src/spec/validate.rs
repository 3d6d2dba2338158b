//! Checks that serde's types cannot express. Each problem is (dotted key, what is wrong).
use std::path::Path;

use super::schema::*;

type Problems = Vec<(String, String)>;

fn at_least(p: &mut Problems, key: &str, v: i64, min: i64) {
    if v < min {
        p.push((key.into(), format!("must be at least {min}, got {v}")));
    }
}

fn positive(p: &mut Problems, key: &str, v: f64) {
    if !(v.is_finite() && v > 0.0) {
        p.push((key.into(), format!("must be a positive number, got {v}")));
    }
}

fn in_range(p: &mut Problems, key: &str, v: f64, lo: f64, hi: f64, shown: &str) {
    if !(v.is_finite() && v >= lo && v <= hi) {
        p.push((key.into(), format!("must be in {shown}, got {v}")));
    }
}

/// What a path key must name.
#[derive(Clone, Copy, PartialEq)]
enum Entry {
    File,
    Dir,
    Either,
}

fn file_exists(p: &mut Problems, key: &str, path: &Path, entry: Entry, what: &str) {
    if !path.exists() {
        p.push((
            key.into(),
            format!(
                "names {}, which does not exist (paths are relative to the current directory; {what})",
                path.display()
            ),
        ));
        return;
    }
    let is_dir = path.is_dir();
    if (entry == Entry::File && is_dir) || (entry == Entry::Dir && !is_dir) {
        p.push((
            key.into(),
            format!(
                "names {}, which is a {}; {what}",
                path.display(),
                if is_dir { "directory" } else { "file" }
            ),
        ));
    }
}

pub fn validate(s: &Spec) -> Problems {
    let mut p = Problems::new();
    job(&mut p, &s.job);
    model(&mut p, &s.model);
    data(&mut p, &s.data);
    train(&mut p, &s.train);
    if s.train.unfreeze_at_epoch.is_some() && s.model.options.contains_key("lora") {
        p.push((
            "train.unfreeze_at_epoch".into(),
            "would unfreeze the base that [model.lora] keeps frozen; remove it, or fine-tune without [model.lora]"
                .into(),
        ));
    }
    frozen_dtype(&mut p, s);
    memory(&mut p, &s.memory, &s.train, &s.model.preset);
    optimizer_impl(&mut p, s);
    cuda_graph(&mut p, s);
    checkpoint(&mut p, s);
    at_least(&mut p, "log.every_steps", s.log.every_steps, 0);
    p
}

fn job(p: &mut Problems, j: &Job) {
    if j.name.contains(['/', '\\']) || j.name == "." || j.name == ".." {
        p.push((
            "job.name".into(),
            format!(
                "must be a plain name (it names the run directory; without job.name, the spec file's name is used), got \"{}\"; set job.name",
                j.name
            ),
        ));
    }
    at_least(p, "job.threads", j.threads, 0);
    if j.threads > MAX_THREADS {
        p.push((
            "job.threads".into(),
            format!(
                "must be at most {MAX_THREADS}, got {}: libtorch starts that many threads; use the machine's cores, or 0 for libtorch's default",
                j.threads
            ),
        ));
    }
}

/// More than any machine memtrain runs on has cores; libtorch would start them all.
const MAX_THREADS: i64 = 1024;
/// An effective batch past this holds more samples than any data set a step could take, and
/// the products of batch sizes downstream would overflow.
const MAX_EFFECTIVE_BATCH: i64 = i32::MAX as i64;

fn model(p: &mut Problems, m: &Model) {
    if let Some(f) = &m.init_from {
        file_exists(
            p,
            "model.init_from",
            f,
            Entry::Either,
            "it must be a .safetensors file, a sharded checkpoint's .safetensors.index.json, or a Hugging Face model directory",
        );
    }
}

fn data(p: &mut Problems, d: &Data) {
    match d.source {
        DataSource::Synthetic => {
            if d.path.is_some() {
                p.push((
                    "data.path".into(),
                    "is set but data.source is \"synthetic\"; remove it or choose npz, safetensors or mnist".into(),
                ));
            }
            at_least(p, "data.samples", d.synthetic_samples(), 4);
            in_range(p, "data.noise", d.synthetic_noise(), 0.0, f64::MAX, "[0, ∞)");
        }
        src => match &d.path {
            None => p.push((
                "data.path".into(),
                format!("is required when data.source is \"{}\"", source_name(src)),
            )),
            Some(path) => file_exists(
                p,
                "data.path",
                path,
                match src {
                    DataSource::Mnist | DataSource::Cifar10 | DataSource::Imagefolder => Entry::Dir,
                    _ => Entry::File,
                },
                match src {
                    DataSource::Mnist => "it must be a directory with the MNIST IDX files",
                    DataSource::Cifar10 => "it must be a directory with CIFAR-10's binary batch files",
                    DataSource::Imagefolder => "it must be a directory with one directory of images per class",
                    DataSource::Tokens => {
                        "it must be a flat binary of token ids (uint16 or uint32) or a 1-D .npy array"
                    }
                    DataSource::Jsonl => "it must be a JSON-lines file, one object a line",
                    _ => "it must be a file with arrays x and y",
                },
            ),
        },
    }
    if let Some(v) = &d.val_path {
        if d.source == DataSource::Synthetic {
            p.push((
                "data.val_path".into(),
                "is only read for file sources (npz, safetensors, mnist, cifar10, imagefolder)".into(),
            ));
        } else {
            file_exists(
                p,
                "data.val_path",
                v,
                Entry::Either,
                "it must hold the validation data, in data.source's format",
            );
        }
    } else if !(d.val_fraction > 0.0 && d.val_fraction < 1.0) {
        p.push((
            "data.val_fraction".into(),
            format!(
                "must be in (0, 1) when data.val_path is not set, got {}",
                d.val_fraction
            ),
        ));
    }
    at_least(p, "data.image_size", d.image_size, 0);
    if d.image_size > 0 && d.source != DataSource::Imagefolder {
        p.push((
            "data.image_size".into(),
            "is only read for data.source = \"imagefolder\" (other sources keep their size)".into(),
        ));
    }
    if d.cache_dir.is_some() && !matches!(d.source, DataSource::Imagefolder | DataSource::Jsonl) {
        p.push((
            "data.cache_dir".into(),
            "is only read for data.source = \"imagefolder\" or \"jsonl\" (the cache of decoded images or token ids); remove it".into(),
        ));
    }
    tokens(p, d);
    if d.mean.len() != d.std.len() {
        p.push((
            "data.std".into(),
            format!(
                "has {} values but data.mean has {}; give one mean and one std per channel",
                d.std.len(),
                d.mean.len()
            ),
        ));
    }
    for (i, s) in d.std.iter().enumerate() {
        if !(s.is_finite() && *s > 0.0) {
            p.push((
                "data.std".into(),
                format!("entries must be positive, got {s} at position {i}"),
            ));
        }
    }
    named_normalization(p, d);
    augment(p, &d.augment);
    at_least(p, "data.prefetch", d.prefetch, 0);
    at_least(p, "data.workers", d.workers, 0);
}

/// `data.normalize` fills `mean` and `std` when resolved: other values beside it are a conflict.
fn named_normalization(p: &mut Problems, d: &Data) {
    if let Some(n) = d.normalize {
        let (mean, std) = n.constants();
        if d.mean != mean || d.std != std {
            p.push((
                "data.normalize".into(),
                "is set, and so are data.mean and data.std; give the name or the numbers, not both".into(),
            ));
        }
    }
}

/// A `[min, max]` pair: finite, increasing, and inside `lo..=hi` (`shown`).
fn pair_in(p: &mut Problems, key: &str, v: [f64; 2], lo: f64, hi: f64, shown: &str) {
    let ok = v.iter().all(|x| x.is_finite() && (lo..=hi).contains(x)) && v[0] <= v[1];
    if !ok {
        p.push((
            key.into(),
            format!(
                "must be [min, max] with {shown} and min <= max, got [{}, {}]",
                v[0], v[1]
            ),
        ));
    }
}

fn augment(p: &mut Problems, a: &Augment) {
    at_least(p, "data.augment.crop_padding", a.crop_padding, 0);
    if let Some(c) = &a.random_resized_crop {
        pair_in(
            p,
            "data.augment.random_resized_crop.scale",
            c.scale,
            f64::MIN_POSITIVE,
            1.0,
            "0 < min, max <= 1",
        );
        pair_in(
            p,
            "data.augment.random_resized_crop.ratio",
            c.ratio,
            f64::MIN_POSITIVE,
            f64::MAX,
            "0 < min",
        );
    }
    let Some(j) = &a.color_jitter else { return };
    for (name, v) in [
        ("brightness", j.brightness),
        ("contrast", j.contrast),
        ("saturation", j.saturation),
    ] {
        let key = format!("data.augment.color_jitter.{name}");
        match v {
            Some(Spread::By(x)) if !(x.is_finite() && x >= 0.0) => {
                p.push((key, format!("must be a number >= 0 or [min, max], got {x}")))
            }
            Some(Spread::Range(r)) => pair_in(p, &key, r, 0.0, f64::MAX, "0 <= min"),
            _ => {}
        }
    }
    let key = "data.augment.color_jitter.hue";
    match j.hue {
        Some(Spread::By(x)) => in_range(p, key, x, 0.0, 0.5, "[0, 0.5]"),
        Some(Spread::Range(r)) => pair_in(p, key, r, -0.5, 0.5, "-0.5 <= min, max <= 0.5"),
        None => {}
    }
}

/// The keys of token sources: each read by its source alone, and what a source needs set.
fn tokens(p: &mut Problems, d: &Data) {
    let jsonl = d.source == DataSource::Jsonl;
    let only = [
        (
            "data.seq_len",
            d.seq_len.is_some(),
            d.source.is_tokens(),
            "\"tokens\" or \"jsonl\"",
        ),
        (
            "data.token_dtype",
            d.token_dtype.is_some(),
            d.source == DataSource::Tokens,
            "\"tokens\"",
        ),
        ("data.tokenizer", d.tokenizer.is_some(), jsonl, "\"jsonl\""),
        ("data.text_field", d.text_field.is_some(), jsonl, "\"jsonl\""),
        ("data.prompt_field", d.prompt_field.is_some(), jsonl, "\"jsonl\""),
        (
            "data.completion_field",
            d.completion_field.is_some(),
            jsonl,
            "\"jsonl\"",
        ),
        ("data.eos_id", d.eos_id.is_some(), jsonl, "\"jsonl\""),
    ];
    for (key, set, read, by) in only {
        if set && !read {
            p.push((key.into(), format!("is only read for data.source = {by}; remove it")));
        }
    }
    if !d.source.is_tokens() {
        return;
    }
    match d.seq_len {
        None => p.push((
            "data.seq_len".into(),
            format!(
                "is required when data.source is \"{}\": the tokens a sample holds (the model's context length)",
                source_name(d.source)
            ),
        )),
        Some(n) => at_least(p, "data.seq_len", n, 1),
    }
    if !jsonl {
        return;
    }
    match &d.tokenizer {
        None => p.push((
            "data.tokenizer".into(),
            "is required when data.source is \"jsonl\": a Hugging Face tokenizer.json".into(),
        )),
        Some(t) => file_exists(p, "data.tokenizer", t, Entry::File, "it must be a tokenizer.json"),
    }
    let pair = d.prompt_field.is_some() || d.completion_field.is_some();
    if d.text_field.is_some() == pair || d.prompt_field.is_some() != d.completion_field.is_some() {
        p.push((
            "data.text_field".into(),
            "data.source = \"jsonl\" reads either plain text (set data.text_field) or prompt/completion pairs (set data.prompt_field and data.completion_field), not both".into(),
        ));
    }
    if let Some(e) = d.eos_id {
        at_least(p, "data.eos_id", e, 0);
    }
}

fn source_name(s: DataSource) -> &'static str {
    match s {
        DataSource::Synthetic => "synthetic",
        DataSource::Npz => "npz",
        DataSource::Safetensors => "safetensors",
        DataSource::Mnist => "mnist",
        DataSource::Cifar10 => "cifar10",
        DataSource::Imagefolder => "imagefolder",
        DataSource::Tokens => "tokens",
        DataSource::Jsonl => "jsonl",
    }
}

fn train(p: &mut Problems, t: &Train) {
    at_least(p, "train.epochs", t.epochs, 1);
    at_least(p, "train.batch_size", t.batch_size, 1);
    at_least(p, "train.accumulation_steps", t.accumulation_steps, 1);
    let effective = t.batch_size.checked_mul(t.accumulation_steps);
    if t.batch_size >= 1 && t.accumulation_steps >= 1 && effective.is_none_or(|e| e > MAX_EFFECTIVE_BATCH) {
        p.push((
            "train.accumulation_steps".into(),
            format!(
                "train.batch_size × train.accumulation_steps (the effective batch) must be at most {MAX_EFFECTIVE_BATCH}, got {} × {}",
                t.batch_size, t.accumulation_steps
            ),
        ));
    }
    if let Some(b) = t.eval_batch_size {
        at_least(p, "train.eval_batch_size", b, 1);
    }
    positive(p, "train.lr", t.lr);
    in_range(p, "train.momentum", t.momentum, 0.0, 0.999_999, "[0, 1)");
    if t.nesterov && !(t.optimizer == OptimizerKind::Sgd && t.momentum > 0.0) {
        p.push((
            "train.nesterov".into(),
            "needs optimizer = \"sgd\" and momentum > 0".into(),
        ));
    }
    in_range(p, "train.weight_decay", t.weight_decay, 0.0, f64::MAX, "[0, ∞)");
    for (i, b) in t.betas.iter().enumerate() {
        if !(*b >= 0.0 && *b < 1.0) {
            p.push((
                "train.betas".into(),
                format!("must both be in [0, 1), got {b} at position {i}"),
            ));
        }
    }
    positive(p, "train.eps", t.eps);
    optimizer_state_bits(p, t);
    in_range(
        p,
        "train.grad_clip_norm",
        t.grad_clip_norm,
        0.0,
        f64::MAX,
        "[0, ∞) (0 turns clipping off)",
    );
    at_least(p, "train.warmup_steps", t.warmup_steps, 0);
    at_least(p, "train.lr_step_epochs", t.lr_step_epochs, 1);
    in_range(p, "train.lr_gamma", t.lr_gamma, f64::MIN_POSITIVE, 1.0, "(0, 1]");
    // Against an invalid lr the bound means nothing; lr's own error says what to fix.
    if t.lr.is_finite() && t.lr > 0.0 {
        in_range(p, "train.min_lr", t.min_lr, 0.0, t.lr, "[0, train.lr]");
    }
    finetune(p, t);
}

/// Freezing and parameter groups: what can be checked without the model's names (the build
/// checks that every pattern matches a parameter).
fn finetune(p: &mut Problems, t: &Train) {
    let blank = |v: &[String]| v.iter().any(|s| s.trim().is_empty());
    if blank(&t.freeze) {
        p.push(("train.freeze".into(), "has an empty pattern".into()));
    }
    if let Some(e) = t.unfreeze_at_epoch {
        if t.freeze.is_empty() {
            p.push((
                "train.unfreeze_at_epoch".into(),
                "needs train.freeze: there is nothing frozen to unfreeze".into(),
            ));
        }
        if e < 2 || e > t.epochs {
            p.push((
                "train.unfreeze_at_epoch".into(),
                format!(
                    "must be an epoch after the first and at most train.epochs ({}), got {e}",
                    t.epochs
                ),
            ));
        }
    }
    for (i, g) in t.param_groups.iter().enumerate() {
        let key = |k: &str| format!("train.param_groups[{i}].{k}");
        if g.patterns.is_empty() || blank(&g.patterns) {
            p.push((key("match"), "must list at least one non-empty name pattern".into()));
        }
        positive(p, &key("lr_scale"), g.lr_scale);
        if let Some(wd) = g.weight_decay {
            in_range(p, &key("weight_decay"), wd, 0.0, f64::MAX, "[0, ∞)");
        }
    }
    if let Some(d) = t.layer_decay {
        in_range(p, "train.layer_decay", d, f64::MIN_POSITIVE, 1.0, "(0, 1]");
    }
}

/// `train.frozen_dtype = "bf16"`: only where bf16-mixed autocast reads the frozen weights in bf16
/// anyway, and only over weights that stay frozen.
fn frozen_dtype(p: &mut Problems, s: &Spec) {
    if s.train.frozen_dtype != FrozenDtype::Bf16 {
        return;
    }
    let key = "train.frozen_dtype";
    let t = &s.train;
    let why = match t.precision {
        Precision::Bf16Mixed => None,
        Precision::Bf16 => Some("has nothing to do under train.precision = \"bf16\", where every weight is bf16 already: remove it".to_owned()),
        other => Some(format!(
            "keeps frozen weights in bf16 for bf16-mixed autocast, which reads them in bf16; under train.precision = \"{}\" it would change what the run computes: set train.precision = \"bf16-mixed\" or train.frozen_dtype = \"fp32\"",
            other.name()
        )),
    };
    let frozen = !t.freeze.is_empty() || s.model.options.contains_key("lora");
    let why = why.or_else(|| {
        (!frozen).then(|| {
            "has no frozen weights to keep: freeze some (train.freeze or [model.lora]) or remove it".to_owned()
        })
    });
    let why = why.or_else(|| {
        t.unfreeze_at_epoch.map(|_| {
            "cannot go with train.unfreeze_at_epoch: the unfrozen weights would go on training from their bf16 copies; keep train.frozen_dtype = \"fp32\"".to_owned()
        })
    });
    if let Some(why) = why {
        p.push((key.into(), why));
    }
}

fn optimizer_name(o: OptimizerKind) -> String {
    format!("{o:?}").to_lowercase()
}

/// 32, or 8 with Adam/AdamW on fp32 master weights.
fn optimizer_state_bits(p: &mut Problems, t: &Train) {
    let key = "train.optimizer_state_bits";
    let problem = match t.optimizer_state_bits {
        32 => None,
        8 if !matches!(t.optimizer, OptimizerKind::Adam | OptimizerKind::Adamw) => Some(format!(
            "8-bit state is for optimizer = \"adam\" or \"adamw\", not \"{}\": set train.optimizer = \"adamw\" or train.optimizer_state_bits = 32",
            optimizer_name(t.optimizer)
        )),
        8 if t.precision == Precision::Bf16 => Some(
            "8-bit state needs fp32 master weights, which precision = \"bf16\" does not keep: use precision = \"bf16-mixed\" (or fp32), or train.optimizer_state_bits = 32".into(),
        ),
        8 => None,
        b => Some(format!("must be 32 or 8 (8-bit Adam/AdamW moments), got {b}")),
    };
    if let Some(why) = problem {
        p.push((key.into(), why));
    }
}

/// An explicit foreach or fused request the run could not honour. An OOM decision never makes
/// one impossible: "offload" moves the state to the host before the gradients, and every
/// implementation updates state on the host.
fn optimizer_impl(p: &mut Problems, s: &Spec) {
    let asked = s.train.optimizer_impl;
    let key = "train.optimizer_impl";
    if let Some(why) = crate::optim::refusal(asked, placement(&s.train, &s.memory)) {
        p.push((key.into(), why));
    }
}

/// "on" promises a captured step: a setting that rules capture out is the spec's mistake.
fn cuda_graph(p: &mut Problems, s: &Spec) {
    if s.train.cuda_graph != CudaGraph::On {
        return;
    }
    if let Some(why) = graph_declines(s) {
        p.push((
            "train.cuda_graph".into(),
            format!("\"on\" cannot capture this run's step: {why}; set train.cuda_graph = \"auto\" to run such steps eager, or change that setting"),
        ));
    }
}

/// Where the spec places the optimizer's state and gradients from the start (streamed
/// parameters bring both to the host).
pub fn placement(t: &Train, m: &Memory) -> crate::optim::Placement {
    crate::optim::Placement {
        state_bits: t.optimizer_state_bits,
        state_on_host: m.optimizer_state.is_host() || m.parameters.is_host(),
        grads_on_host: m.gradients.is_host() || m.parameters.is_host(),
    }
}

/// The presets whose every variable belongs to one block, so their parameters can stream
/// (`memory.parameters = "host"`); DARTS's architecture weights are used by every cell.
const STREAMS: &[&str] = &["vit", "resnet18", "resnet34", "resnet50", "llama"];

/// Whether `memory.parameters = "host"` is open to this preset.
pub fn streams(preset: &str) -> bool {
    STREAMS.contains(&preset)
}

fn memory(p: &mut Problems, m: &Memory, t: &Train, preset: &str) {
    if let Some(l) = m.limit {
        if l.0 == 0 {
            p.push(("memory.limit".into(), "must be more than 0 bytes, e.g. \"4GiB\"".into()));
        }
        if m.fraction.is_some() {
            p.push((
                "memory.fraction".into(),
                "cannot be set together with memory.limit; keep one".into(),
            ));
        }
    }
    if let Some(f) = m.fraction {
        if !(f > 0.0 && f <= 1.0) {
            p.push(("memory.fraction".into(), format!("must be in (0, 1], got {f}")));
        }
    }
    at_least(p, "memory.sync_every", m.sync_every, 0);
    at_least(p, "memory.grow_back_after", m.grow_back_after, 0);
    at_least(p, "memory.min_batch_size", m.min_batch_size, 1);
    if m.min_batch_size > t.batch_size && t.batch_size >= 1 {
        p.push((
            "memory.min_batch_size".into(),
            format!(
                "must not exceed train.batch_size ({}), got {}",
                t.batch_size, m.min_batch_size
            ),
        ));
    }
    if m.on_oom.is_empty() {
        p.push((
            "memory.on_oom".into(),
            "must list at least one of \"recompute\", \"offload\", \"backoff\", \"cpu\", \"fail\"".into(),
        ));
    }
    for (i, a) in m.on_oom.iter().enumerate() {
        if m.on_oom[..i].contains(a) {
            p.push(("memory.on_oom".into(), format!("lists {a:?} twice").to_lowercase()));
        }
        if *a == OomAction::Fail && i + 1 < m.on_oom.len() {
            p.push((
                "memory.on_oom".into(),
                "has entries after \"fail\", which would never run; put \"fail\" last".into(),
            ));
        }
    }
    if m.parameters.is_host() && !STREAMS.contains(&preset) {
        p.push((
            "memory.parameters".into(),
            format!(
                "\"host\" streams the parameters block by block, which the {preset} preset cannot (presets {}); keep \"device\" and move the optimizer state, gradients and activations instead (memory.optimizer_state / gradients / activations = \"host\")",
                STREAMS.join(", ")
            ),
        ));
    }
    let a = &m.allocator;
    if let Some(v) = a.max_split_size_mb {
        if v <= 20 {
            p.push((
                "memory.allocator.max_split_size_mb".into(),
                format!("must be more than 20 (PyTorch's minimum), got {v}"),
            ));
        }
    }
    if let Some(v) = a.garbage_collection_threshold {
        if !(v > 0.0 && v < 1.0) {
            p.push((
                "memory.allocator.garbage_collection_threshold".into(),
                format!("must be in (0, 1), got {v}"),
            ));
        }
    }
    if let Some(v) = a.roundup_power2_divisions {
        if !(1..=64).contains(&v) || (v & (v - 1)) != 0 {
            p.push((
                "memory.allocator.roundup_power2_divisions".into(),
                format!("must be a power of 2 from 1 to 64, got {v}"),
            ));
        }
    }
}

fn checkpoint(p: &mut Problems, s: &Spec) {
    let c = &s.checkpoint;
    at_least(p, "checkpoint.every_epochs", c.every_epochs, 0);
    at_least(p, "checkpoint.every_steps", c.every_steps, 0);
    in_range(p, "checkpoint.every_minutes", c.every_minutes, 0.0, f64::MAX, "[0, ∞)");
    at_least(p, "checkpoint.keep_last", c.keep_last, 1);
}

/// Why no step of `s` can be captured as one graph, on any device; None when it can. Each
/// reason names the setting, because a captured step may neither wait for the host nor move
/// memory between host and device in the middle.
pub fn graph_declines(s: &Spec) -> Option<String> {
    graph_declines_of(&s.train, &s.memory)
}

/// [`graph_declines`] from the spec's `[train]` and `[memory]` tables alone.
pub fn graph_declines_of(t: &Train, m: &Memory) -> Option<String> {
    let host = [
        (
            m.parameters.is_host(),
            "memory.parameters = \"host\" streams blocks in and out during the step",
        ),
        (
            m.optimizer_state.is_host(),
            "memory.optimizer_state = \"host\" runs the update on the host",
        ),
        (
            m.gradients.is_host(),
            "memory.gradients = \"host\" moves gradients to the host during backward",
        ),
        (
            m.activations.is_host(),
            "memory.activations = \"host\" moves activations to the host during the step",
        ),
    ];
    if let Some((_, why)) = host.iter().find(|(on, _)| *on) {
        return Some((*why).to_owned());
    }
    if t.activation_checkpointing {
        return Some(
            "train.activation_checkpointing restores the generator's state from the host for each recomputed block"
                .into(),
        );
    }
    if t.precision == Precision::Fp16Mixed {
        return Some("fp16-mixed decides on the host whether to skip a step whose gradients are not finite".into());
    }
    if t.optimizer_state_bits == 8 {
        return Some(
            "train.optimizer_state_bits = 8 updates one parameter at a time, with no fused kernel to capture".into(),
        );
    }
    match t.optimizer_impl {
        OptimizerImpl::Single | OptimizerImpl::Foreach => Some(format!(
            "train.optimizer_impl = \"{}\" takes the learning rate from the host; a captured step needs \"fused\" (or \"auto\"), which reads it on the device",
            t.optimizer_impl.name()
        )),
        OptimizerImpl::Fused | OptimizerImpl::Auto => None,
    }
}
