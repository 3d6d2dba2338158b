//! `memtrain eval RUN_DIR`: a run's weights (its best checkpoint, or `--checkpoint`) on its
//! validation data, or on another image folder whose classes are matched to the run's by name
//! (`classes.json`), under the run's device and memory cap (its parameters streamed from host
//! memory block by block where the run streamed them): loss, accuracy, top-5 where the model has
//! more than 5 classes, and a per-class table, printed and written as JSON (`eval.json`). An OOM
//! halves the micro-batch and the pass goes on from the micro-batch that failed, as validation
//! does; at one sample it ends with exit 3. Bad input ends with exit 2 before anything is
//! written; the JSON is written whole at the end, or not at all.
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};

use crate::checkpoint::Store;
use crate::cli::EvalArgs;
use crate::data::classes::{self, ClassNames, DataClasses};
use crate::data::Dataset;
use crate::exit::{OomExit, UsageError};
use crate::host::Host;
use crate::model::{self, lm_loss, Built};
use crate::oom::{self, StepError};
use crate::plan::{Facts, Place, Placement, Request};
use crate::policy::levers::HostParams;
use crate::run::{streamed_forward, PrecisionStage, Streamer};
use crate::spec::{self, Spec};

/// What `eval` writes (`eval.json`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvalReport {
    /// The weights evaluated (a model.safetensors).
    pub checkpoint: PathBuf,
    /// The image folder evaluated on; None: the run's validation data.
    pub data: Option<PathBuf>,
    pub samples: i64,
    /// Mean cross-entropy.
    pub loss: f64,
    pub accuracy: f64,
    /// The share whose class is among the 5 largest logits; None with 5 classes or fewer.
    pub top5: Option<f64>,
    /// The micro-batch the pass ended at (halved from the spec's on an OOM).
    pub micro_batch: i64,
    /// Every class of the run, in index order (none for a language model).
    pub classes: Vec<ClassRow>,
    /// A language model's counted target tokens (`loss` and `accuracy` are then per token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<i64>,
    /// A language model's `exp(loss)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perplexity: Option<f64>,
}

/// One class's line of the table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ClassRow {
    pub index: i64,
    pub name: String,
    /// Samples of this class evaluated.
    pub count: i64,
    /// The share of them predicted right; None without samples.
    pub accuracy: Option<f64>,
}

pub fn eval(args: &EvalArgs) -> Result<()> {
    // Before anything is loaded, so the cap counts every CPU tensor byte.
    crate::shim::cpu_alloc_install().context("installing the counting CPU allocator")?;
    let run_dir = &args.run_dir;
    let resolved = resolved_spec(run_dir)?;
    let weights = crate::checkpoint::weights_file(run_dir, args.checkpoint.as_deref())?;
    if args.data.is_some() {
        image_run(&resolved)?;
    }
    let names = class_names(run_dir, args.data.is_some())?;
    let relabel = args.data.as_deref().map(|p| folder_map(p, &names)).transpose()?;
    let spec = load_spec(&resolved, args.data.as_deref())?;
    let place = place(&spec, run_dir)?;
    let model = Loaded::open(&spec, &weights, place)?;
    let built = &model.built;
    let names = match names {
        Some(n) => n,
        // A language model's report is its token mean, with no table by class.
        None if built.net.output_head().is_some() => ClassNames { classes: vec![] },
        // A run from before classes.json: its classes by index.
        None => ClassNames::of_run(&spec.data, built.num_classes)?,
    };
    let mut set = load_set(&spec, built)?;
    if let Some(map) = &relabel {
        set.relabel(map);
    }
    let micro_batch = spec.train.eval_batch_size.unwrap_or(spec.train.batch_size);
    let (sums, micro_batch) = pass(&model, &set, place, micro_batch)?;
    let report = sums.report(&weights, args.data.clone(), micro_batch, &names, built.num_classes);
    let out = args.json.clone().unwrap_or_else(|| run_dir.join("eval.json"));
    print(&report)?;
    crate::atomic::write_json(&out, &report).with_context(|| format!("writing {}", out.display()))?;
    crate::outln!("eval.json: {}", out.display())?;
    Ok(())
}

/// A run directory's resolved spec file (`config.resolved.toml`).
pub(crate) fn resolved_spec(run_dir: &Path) -> Result<PathBuf> {
    let resolved = run_dir.join("config.resolved.toml");
    if !resolved.is_file() {
        return Err(UsageError(format!(
            "{} is not a run directory: it has no config.resolved.toml (memtrain run writes it)",
            run_dir.display()
        ))
        .into());
    }
    Ok(resolved)
}

/// `--data` is an image folder: a language model's run (one on token data) is refused, before
/// a class list it never had is looked for.
fn image_run(resolved: &Path) -> Result<()> {
    let spec = load_spec(resolved, None)?;
    if spec.data.source.is_tokens() {
        return Err(UsageError(format!(
            "--data takes an image folder, and this run's model ({}) is a language model: leave --data out to score it on its validation data",
            spec.model.preset
        ))
        .into());
    }
    Ok(())
}

/// The run's `classes.json`; required to match another folder's classes by name.
fn class_names(run_dir: &Path, needed: bool) -> Result<Option<ClassNames>> {
    match ClassNames::read(run_dir) {
        Ok(n) => Ok(Some(n)),
        Err(_) if !needed && !run_dir.join(classes::CLASSES_FILE).exists() => Ok(None),
        Err(e) => Err(UsageError(format!(
            "{e:#}; --data matches the folder's classes to the run's by the names in {} (memtrain run writes it)",
            classes::CLASSES_FILE
        ))
        .into()),
    }
}

/// The model's index of each class directory of `folder`, in the folder's order; a class the
/// run does not have is an error naming it.
fn folder_map(folder: &Path, names: &Option<ClassNames>) -> Result<Vec<i64>> {
    let names = names.as_ref().expect("read when --data is given");
    let data = spec::Data {
        source: spec::DataSource::Imagefolder,
        path: Some(folder.to_path_buf()),
        ..spec::Data::default()
    };
    let found = match classes::probe(&data).map_err(|e| UsageError(format!("--data: {e:#}")))? {
        Some(DataClasses::Named(n)) => n,
        _ => vec![],
    };
    let unknown: Vec<&str> = found
        .iter()
        .filter(|c| names.index_of(c).is_none())
        .map(String::as_str)
        .collect();
    if !unknown.is_empty() {
        return Err(UsageError(format!(
            "--data {}: class {} not among the run's classes ({}: {}); rename or remove {}",
            folder.display(),
            unknown.join(", "),
            classes::CLASSES_FILE,
            names.classes.join(", "),
            if unknown.len() == 1 {
                "that directory"
            } else {
                "those directories"
            }
        ))
        .into());
    }
    Ok(found.iter().filter_map(|c| names.index_of(c)).collect())
}

/// The run's resolved spec; with `--data`, reading that image folder whole as validation data.
pub(crate) fn load_spec(resolved: &Path, data: Option<&Path>) -> Result<Spec> {
    let mut sets = vec![];
    if let Some(p) = data {
        let path = toml::Value::String(p.display().to_string()).to_string();
        sets.push("data.source=\"imagefolder\"".to_owned());
        sets.push(format!("data.path={path}"));
        sets.push(format!("data.val_path={path}"));
    }
    Ok(spec::load_args(resolved, &sets, &model::validate)?.spec)
}

/// The run's device and cap, set up as `run` sets them.
pub(crate) fn place(spec: &Spec, run_dir: &Path) -> Result<Place> {
    let request = Request {
        out: Some(run_dir.to_path_buf()),
        resume: None,
    };
    let facts = Facts::probe(spec, &request, None)?;
    let p = Placement::resolve(spec, &facts)?;
    for (k, v) in &p.env {
        // Edition 2021: safe. Set before CUDA starts and reads them.
        std::env::set_var(k, v);
    }
    if spec.job.threads > 0 {
        tch::set_num_threads(spec.job.threads as i32);
    }
    match (p.device, &p.cap) {
        (Place::Cpu, Some(cap)) => crate::shim::cpu_alloc_set_cap(Some(cap.bytes)),
        (Place::Cuda(i), Some(crate::memory::Cap { fraction: Some(f), .. })) => {
            if let Err(e) = crate::shim::cuda_set_memory_fraction(*f, i) {
                tracing::warn!("the cap on cuda:{i} rests on the allocator settings alone: {e:#}");
            }
        }
        _ => {}
    }
    Ok(p.device)
}

/// The model of the spec with the weights of `file`, on `place`, as the run had it: its base
/// drawn from the run's seed where no file holds it (`run::drawn_model`), in the run's dtype, its
/// frozen weights stored as the run stored them (`train.frozen_dtype`). Built and read on the
/// CPU first: an OOM there (under a CPU run's cap) ends with exit 3, as one on the device does.
pub(crate) fn build_model(spec: &Spec, file: &Path, place: Place) -> Result<(nn::VarStore, Built)> {
    let device = place.tch();
    let built_on = match spec.model.preset == "torchscript" {
        true => device,
        false => Device::Cpu,
    };
    let mut vs = nn::VarStore::new(built_on);
    let loaded = oom::guarded(|| -> Result<Built> {
        let built =
            tch::no_grad(|| crate::run::drawn_model(&mut vs, spec)).map_err(|e| UsageError(format!("{e:#}")))?;
        crate::export::weights_into(&vs, &built.head, spec, file).map_err(|e| {
            UsageError(format!(
                "{e:#}\n  (the weights are not of the run's model, {}: evaluate them with the run that made them)",
                spec.model.preset
            ))
        })?;
        crate::run::frozen_as_trained(spec, &vs, built.net.as_ref())?;
        Ok(built)
    });
    let built = loaded.map_err(|e| unplaced(e, built_on))??;
    to_device(&mut vs, place)?;
    Ok((vs, built))
}

/// The run's model with its weights where the run kept them: all on the device, or (the run
/// streamed its parameters) at rest in host memory, each block brought to the device for its
/// turn in every forward, under the run's cap as training's validation brought it.
pub(crate) struct Loaded {
    _vs: nn::VarStore,
    pub(crate) built: Built,
    pub(crate) stream: Option<Streamer>,
    /// The run's precision: inputs in the model's dtype and a mixed run's forward under
    /// autocast, as the run computed them.
    pub(crate) precision: PrecisionStage,
}

impl Loaded {
    pub(crate) fn open(spec: &Spec, file: &Path, place: Place) -> Result<Loaded> {
        let precision = PrecisionStage {
            precision: spec.train.precision,
        };
        let whole = |(vs, built): (nn::VarStore, Built)| Loaded {
            _vs: vs,
            built,
            stream: None,
            precision,
        };
        if !streams(spec, file) {
            return build_model(spec, file, place).map(whole);
        }
        // At rest on the host, apart from the device's count and never against its cap.
        let (mut vs, built) = {
            let _host = crate::shim::HostScope::enter();
            build_model(spec, file, Place::Cpu)?
        };
        // Nothing trains here; a resident weight that trains could not stay on the device.
        vs.freeze();
        let stream = match built.net.chain() {
            Some(chain) => Streamer::new(&vs, chain, Host::new(place.tch())),
            None => Err("the model is not a sequence of blocks".into()),
        };
        match stream {
            Ok(s) => Ok(Loaded {
                _vs: vs,
                built,
                stream: Some(s),
                precision,
            }),
            Err(why) => {
                tracing::warn!("parameters cannot stream: {why}; the whole model goes to the device");
                drop((vs, built));
                // Built again outside the host's scope: on the CPU the cap then counts it, as
                // it counts a model that never streamed.
                build_model(spec, file, place).map(whole)
            }
        }
    }

    /// The model's output for `x` (on the device), without a graph: block by block where the
    /// parameters stream.
    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        let device = x.device();
        let autocast = || self.precision.autocast(device);
        streamed_forward(self.built.net.as_ref(), self.stream.as_ref(), x, false, &autocast)
    }
}

/// Whether the run streamed its parameters from the host: by its spec, or because its memory
/// policy engaged the lever before the checkpoint was written.
fn streams(spec: &Spec, file: &Path) -> bool {
    spec.memory.parameters.is_host()
        || file
            .parent()
            .and_then(|ck| Store::load_state(ck).ok())
            .is_some_and(|state| state.levers.iter().any(|l| l == HostParams::ABOUT.name))
}

/// The whole model onto `place`'s device; an OOM there ends with exit 3.
pub(crate) fn to_device(vs: &mut nn::VarStore, place: Place) -> Result<()> {
    let device = place.tch();
    oom::guarded(|| vs.set_device(device)).map_err(|e| unplaced(e, device))
}

fn unplaced(e: StepError, device: Device) -> anyhow::Error {
    match e {
        StepError::Oom { message, .. } => anyhow::Error::from(OomExit(format!(
            "the model does not fit on {device:?} under the run's cap: {message}"
        ))),
        other => anyhow::anyhow!("placing the model on {device:?}: {other:?}"),
    }
}

/// The set to evaluate: the run's validation set (or the `--data` folder, read as one).
fn load_set(spec: &Spec, built: &Built) -> Result<Dataset> {
    let splits = crate::data::load(&spec.data, &built.input_shape, built.num_classes, spec.job.seed).map_err(|e| {
        let text = format!("{e:#}");
        match oom::classify(&text) {
            Some(_) => anyhow::Error::from(OomExit(format!("eval: loading the data: {text}"))),
            None => UsageError(text).into(),
        }
    })?;
    Ok(splits.val)
}

/// What a pass adds up, per class in the model's order.
#[derive(Debug, Default)]
struct Sums {
    loss: f64,
    samples: i64,
    correct: i64,
    top5: i64,
    count: Vec<i64>,
    right: Vec<i64>,
    /// A language model's counted target tokens; None for a classifier.
    tokens: Option<i64>,
}

/// A language model's micro-batch: its next-token loss sum, counted targets and correct ones.
struct TokenChunk {
    loss: f64,
    tokens: i64,
    correct: i64,
    samples: i64,
}

/// One micro-batch's per-sample results, on the host.
struct Chunk {
    labels: Vec<i64>,
    losses: Vec<f64>,
    /// The k largest logits' classes, k per sample, largest first.
    top: Vec<i64>,
    k: usize,
    language: Option<TokenChunk>,
}

/// The set at `micro_batch`, halved on an OOM and continued from the micro-batch that failed.
fn pass(model: &Loaded, set: &Dataset, place: Place, micro_batch: i64) -> Result<(Sums, i64)> {
    let n = set.len();
    let classes = model.built.num_classes;
    let mut sums = Sums {
        count: vec![0; classes as usize],
        right: vec![0; classes as usize],
        ..Sums::default()
    };
    let (mut b, mut next) = (micro_batch.max(1), 0i64);
    while next < n {
        let idx: Vec<i64> = (next..(next + b).min(n)).collect();
        let attempt = oom::guarded_counting(
            || crate::memory::oom_count(place),
            || tch::no_grad(|| chunk(model, set, &idx, place.tch())),
        );
        match attempt {
            Ok(c) => {
                sums.add(&c);
                next += idx.len() as i64;
            }
            Err(StepError::Oom { message, .. }) if b > 1 => {
                let after = b / 2;
                tracing::warn!(
                    "eval: out of memory at a micro-batch of {b} ({}); going on at {after}",
                    crate::shim::first_line(&message)
                );
                b = after;
                let _ = crate::shim::empty_cache();
            }
            Err(StepError::Oom { message, .. }) => {
                return Err(OomExit(format!(
                    "eval: out of memory at a micro-batch of 1 on {:?}: {}; raise memory.limit (or memory.fraction) or evaluate on a larger device",
                    place.tch(),
                    crate::shim::first_line(&message)
                ))
                .into())
            }
            Err(StepError::Other(m) | StepError::PeerLost(m) | StepError::OomInCollective(m)) => {
                anyhow::bail!("eval failed: {m}")
            }
        }
    }
    Ok((sums, b))
}

fn chunk(model: &Loaded, set: &Dataset, idx: &[i64], device: Device) -> Chunk {
    let (net, precision, classes) = (model.built.net.as_ref(), model.precision, model.built.num_classes);
    // The test hook that puts an OOM in validation (MEMTRAIN_FAULT_OOM_IN=validation) puts one
    // here: evaluation is a validation pass.
    let _squeeze = crate::fault::squeeze_in(crate::fault::Phase::Validation, None);
    let (x, y) = set.batch(&Tensor::from_slice(idx));
    let y = y.to_device(device);
    let out = model.forward(&precision.input(&x, device));
    if let Some(w) = net.output_head() {
        let compute = precision.precision.autocast();
        let t = lm_loss::next_token_loss(&out, &w, &y, compute, lm_loss::chunk_tokens(w.size()[0]));
        return Chunk {
            labels: vec![],
            losses: vec![],
            top: vec![],
            k: 0,
            language: Some(TokenChunk {
                loss: t.loss.double_value(&[]),
                tokens: t.tokens.int64_value(&[]),
                correct: t.correct.int64_value(&[]),
                samples: idx.len() as i64,
            }),
        };
    }
    let logits = out.to_kind(Kind::Float);
    let losses = logits.cross_entropy_loss::<Tensor>(&y, None, tch::Reduction::None, -100, 0.0);
    let k = classes.min(5);
    let (_, top) = logits.topk(k, -1, true, true);
    Chunk {
        labels: Vec::<i64>::try_from(y.to_device(Device::Cpu)).expect("int64 labels"),
        losses: Vec::<f64>::try_from(losses.to_kind(Kind::Double).to_device(Device::Cpu)).expect("losses"),
        top: Vec::<i64>::try_from(top.flatten(0, -1).to_device(Device::Cpu)).expect("classes"),
        k: k as usize,
        language: None,
    }
}

impl Sums {
    fn add(&mut self, c: &Chunk) {
        if let Some(t) = &c.language {
            self.loss += t.loss;
            self.samples += t.samples;
            self.correct += t.correct;
            *self.tokens.get_or_insert(0) += t.tokens;
            return;
        }
        for (i, &label) in c.labels.iter().enumerate() {
            let top = &c.top[i * c.k..(i + 1) * c.k];
            let right = top.first() == Some(&label);
            self.loss += c.losses[i];
            self.samples += 1;
            self.correct += right as i64;
            self.top5 += top.contains(&label) as i64;
            if let Some(n) = self.count.get_mut(label as usize) {
                *n += 1;
                self.right[label as usize] += right as i64;
            }
        }
    }

    fn report(
        &self,
        weights: &Path,
        data: Option<PathBuf>,
        micro_batch: i64,
        names: &ClassNames,
        classes: i64,
    ) -> EvalReport {
        let share = |a: i64, n: i64| (n > 0).then(|| a as f64 / n as f64);
        if let Some(tokens) = self.tokens {
            let loss = self.loss / tokens.max(1) as f64;
            return EvalReport {
                checkpoint: weights.to_path_buf(),
                data,
                samples: self.samples,
                loss,
                accuracy: share(self.correct, tokens).unwrap_or(0.0),
                top5: None,
                micro_batch,
                classes: vec![],
                tokens: Some(tokens),
                perplexity: Some(loss.exp()),
            };
        }
        EvalReport {
            checkpoint: weights.to_path_buf(),
            data,
            samples: self.samples,
            loss: self.loss / self.samples.max(1) as f64,
            accuracy: share(self.correct, self.samples).unwrap_or(0.0),
            top5: (classes > 5).then(|| share(self.top5, self.samples).unwrap_or(0.0)),
            micro_batch,
            classes: (0..classes as usize)
                .map(|i| ClassRow {
                    index: i as i64,
                    name: names.classes.get(i).cloned().unwrap_or_else(|| i.to_string()),
                    count: self.count[i],
                    accuracy: share(self.right[i], self.count[i]),
                })
                .collect(),
            tokens: None,
            perplexity: None,
        }
    }
}

fn print(r: &EvalReport) -> Result<()> {
    let on = match &r.data {
        Some(p) => p.display().to_string(),
        None => "the run's validation data".to_owned(),
    };
    crate::outln!("eval {} on {on}: {} samples", r.checkpoint.display(), r.samples)?;
    if let (Some(tokens), Some(ppl)) = (r.tokens, r.perplexity) {
        return crate::outln!(
            "{tokens} tokens  loss {:.4}  perplexity {ppl:.2}  token accuracy {:.2}%",
            r.loss,
            100.0 * r.accuracy
        );
    }
    let top5 = r.top5.map(|t| format!("  top-5 {:.2}%", 100.0 * t)).unwrap_or_default();
    crate::outln!("loss {:.4}  accuracy {:.2}%{top5}", r.loss, 100.0 * r.accuracy)?;
    let width = r.classes.iter().map(|c| c.name.len()).max().unwrap_or(5).max(5);
    crate::outln!("{:<width$}  {:>7}  {:>8}", "class", "samples", "accuracy")?;
    for c in &r.classes {
        let acc = c.accuracy.map_or("-".to_owned(), |a| format!("{:.2}%", 100.0 * a));
        crate::outln!("{:<width$}  {:>7}  {:>8}", c.name, c.count, acc)?;
    }
    Ok(())
}
