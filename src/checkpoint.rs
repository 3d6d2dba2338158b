//! Checkpoints: written atomically (temporary directory, fsync, rename), kept by retention
//! (the last N plus the best), and read back for `--resume`.
//!
//! Layout: `checkpoints/step-000000120/{model.safetensors, optimizer.safetensors, state.json,
//! spec.toml}` and `checkpoints/best.json` naming the best one. A run whose base is frozen
//! (LoRA) keeps only the tensors that train in `model.safetensors`, and names its base in
//! `base.json`. Tensors are copied to the CPU one
//! at a time while the file is written, so saving never doubles device memory.
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::spec::schema::Monitor;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// Tensors by name, in the order they are written.
pub type NamedTensors = Vec<(String, Tensor)>;

/// Everything besides tensors that an exact resume needs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainState {
    /// 0-based epoch the run is in (equal to epochs done when `groups_done` is 0).
    pub epoch: i64,
    /// Optimizer steps already taken within `epoch`.
    pub groups_done: i64,
    pub global_step: i64,
    pub weight_steps: i64,
    /// The architecture step's own position (DARTS); its part owns it while the run goes on.
    #[serde(flatten)]
    pub arch: ArchState,
    pub micro_batch: i64,
    pub accumulation_steps: i64,
    /// The configured effective batch (samples per optimizer step) the run was started with.
    #[serde(default)]
    pub effective_batch: i64,
    pub clean_steps: i64,
    /// Validation's own micro-batch and its clean count (absent in checkpoints from before it
    /// had one: validation starts at the configured one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_micro_batch: Option<i64>,
    #[serde(default)]
    pub eval_clean: i64,
    /// Running sums of the epoch in progress, so a mid-epoch resume reports the same epoch loss.
    pub epoch_loss_sum: f64,
    pub epoch_correct: i64,
    pub epoch_seen: i64,
    /// A language model's counted target tokens: the epoch's so far, and the run's.
    #[serde(default)]
    pub epoch_tokens: u64,
    #[serde(default)]
    pub tokens_seen: u64,
    /// Read from a checkpoint written before tokens were counted: the two counts above are not
    /// in it, and the run derives them from the windows it has trained on.
    #[serde(skip)]
    pub tokens_uncounted: bool,
    /// The memory levers engaged at this point (`policy::levers`), by name.
    #[serde(default)]
    pub levers: Vec<String>,
    /// fp16-mixed: the loss scaler of the weight step.
    #[serde(default)]
    pub scaler: Option<crate::scaler::GradScaler>,
    /// The monitored metric at this checkpoint, when validation ran.
    pub monitored: Option<f64>,
    pub finished: bool,
    /// `train.unfreeze_at_epoch`: the optimizer step count at which the frozen parameters
    /// started training, once they have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unfrozen_at: Option<i64>,
}

/// `checkpoint.monitor` of a resolved spec.
pub fn monitor_in(spec: &toml::Table) -> Option<Monitor> {
    spec.get("checkpoint")?.get("monitor")?.clone().try_into().ok()
}

impl TrainState {
    /// The first field that no run could have written, as "micro_batch is 0 (at least 1)".
    fn out_of_range(&self) -> Option<String> {
        let at_least = [
            ("micro_batch", self.micro_batch, 1),
            ("accumulation_steps", self.accumulation_steps, 1),
            // 0: written before the field existed (`reconcile` takes it as unknown).
            ("effective_batch", self.effective_batch, 0),
            ("eval_micro_batch", self.eval_micro_batch.unwrap_or(1), 1),
            ("epoch", self.epoch, 0),
            ("groups_done", self.groups_done, 0),
            ("global_step", self.global_step, 0),
            ("weight_steps", self.weight_steps, 0),
            ("clean_steps", self.clean_steps, 0),
            ("epoch_correct", self.epoch_correct, 0),
            ("epoch_seen", self.epoch_seen, 0),
        ];
        at_least
            .iter()
            .find(|(_, v, min)| v < min)
            .map(|(name, v, min)| format!("{name} is {v} (at least {min})"))
    }
}

/// Where the architecture step (DARTS) stands: its steps, its place in the held-out stream and
/// its loss scaler.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ArchState {
    pub arch_steps: i64,
    /// Validation samples the architecture steps have consumed (their stream position).
    pub val_cursor: i64,
    /// fp16-mixed: the architecture step's loss scaler.
    #[serde(default)]
    pub arch_scaler: Option<crate::scaler::GradScaler>,
}

/// Whether a state holds the token counts: checkpoints from before they were counted do not.
#[derive(Deserialize)]
struct TokenCounts {
    #[serde(default)]
    tokens_seen: Option<u64>,
}

#[derive(Deserialize)]
struct LegacyFlags {
    #[serde(default)]
    on_cpu_fallback: bool,
    #[serde(default)]
    activation_checkpointing: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Best {
    step: String,
    value: f64,
    /// The metric `value` is of: a resume that monitors another one starts the best afresh
    /// rather than compare across metrics. Absent in a best.json written without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    monitor: Option<Monitor>,
}

fn dtype(k: Kind) -> Result<&'static str> {
    Ok(match k {
        Kind::Float => "F32",
        Kind::Double => "F64",
        Kind::Half => "F16",
        Kind::BFloat16 => "BF16",
        Kind::Int64 => "I64",
        Kind::Int => "I32",
        Kind::Int16 => "I16",
        Kind::Int8 => "I8",
        Kind::Uint8 => "U8",
        Kind::Bool => "BOOL",
        k => bail!("cannot save tensors of kind {k:?}"),
    })
}

/// Writes a safetensors file, copying one tensor at a time to the CPU.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, t) in tensors {
        let bytes = crate::memory::tensor_bytes(t);
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype(t.kind())?, "shape": t.size(), "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut h = serde_json::to_vec(&header)?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = BufWriter::new(File::create(path).with_context(|| format!("creating {}", path.display()))?);
    out.write_all(&(h.len() as u64).to_le_bytes())?;
    out.write_all(&h)?;
    // A fixed 4 MiB staging buffer: a checkpoint of a large model under a tight memory cap
    // must not need a second copy of its largest tensor.
    const CHUNK_BYTES: usize = 4 << 20;
    // Fallible, because under a CPU memory cap an infallible allocation would abort the process.
    let mut buf = Vec::new();
    buf.try_reserve_exact(CHUNK_BYTES)
        .map_err(|_| anyhow::anyhow!("no memory left for the checkpoint writer's 4 MiB buffer"))?;
    buf.resize(CHUNK_BYTES, 0);
    for (_, t) in tensors {
        let flat = t.detach().to_device(Device::Cpu).contiguous().view([-1]);
        let n = flat.numel();
        let elt = flat.kind().elt_size_in_bytes();
        let per_chunk = (CHUNK_BYTES / elt).max(1);
        let mut start = 0;
        while start < n {
            let len = per_chunk.min(n - start);
            let part = flat.narrow(0, start as i64, len as i64);
            part.copy_data_u8(&mut buf[..len * elt], len);
            out.write_all(&buf[..len * elt])?;
            start += len;
        }
    }
    let f = out.into_inner().map_err(|e| e.into_error())?;
    f.sync_all()?;
    Ok(())
}

pub fn read_safetensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    Tensor::read_safetensors(path).map_err(|e| {
        let text = e.to_string();
        anyhow::anyhow!("reading {}: {text}{}", path.display(), safetensors_hint(&text))
    })
}

/// The safetensors reader names its failures by their Rust variants (`HeaderTooLarge`,
/// `MetadataIncompleteBuffer`, `IoError(Os { code: 21, .. })`); this says what they mean.
pub fn safetensors_hint(error: &str) -> &'static str {
    let says = |names: &[&str]| names.iter().any(|n| error.contains(n));
    if says(&["HeaderTooLarge", "HeaderTooSmall", "InvalidHeader"]) {
        " (not a safetensors file: its header does not read)"
    } else if says(&["MetadataIncompleteBuffer", "TensorInvalidInfo", "InvalidOffset"]) {
        " (the file is cut short or damaged: its tensors do not fit the bytes it holds)"
    } else if says(&["code: 21", "Is a directory"]) {
        " (a directory, not a file)"
    } else if says(&["code: 2,", "NotFound"]) {
        " (no such file)"
    } else {
        ""
    }
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    Ok(())
}

/// What to write into one checkpoint.
pub struct Contents<'a> {
    pub model: Vec<(String, Tensor)>,
    pub optimizer: Vec<(String, Tensor)>,
    pub state: &'a TrainState,
    pub spec_toml: &'a str,
    /// The frozen base the model's tensors go with, when they are not the whole model.
    pub base: Option<&'a BaseRef>,
}

/// The file a frozen base was read from, by path and content: a checkpoint that holds only
/// adapters is resumed or exported with the same base or not at all.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BaseRef {
    pub path: PathBuf,
    pub bytes: u64,
    /// CRC-32C of the bytes (of every file, in name order, for a directory).
    pub crc32c: u32,
}

impl BaseRef {
    /// Reads `path` (a file, or a directory's files) once to name its content.
    pub fn of(path: &Path) -> Result<BaseRef> {
        let mut files = vec![];
        if path.is_dir() {
            for e in fs::read_dir(path).with_context(|| format!("reading {}", path.display()))? {
                let p = e?.path();
                if p.is_file() {
                    files.push(p);
                }
            }
            files.sort();
        } else {
            files.push(path.to_owned());
        }
        let (mut crc, mut bytes) = (0u32, 0u64);
        let mut buf = vec![0u8; 8 << 20];
        for f in files {
            let mut file = File::open(&f).with_context(|| format!("reading {}", f.display()))?;
            loop {
                let n = std::io::Read::read(&mut file, &mut buf).with_context(|| format!("reading {}", f.display()))?;
                if n == 0 {
                    break;
                }
                crc = crc32c::crc32c_append(crc, &buf[..n]);
                bytes += n as u64;
            }
        }
        let path = fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
        Ok(BaseRef {
            path,
            bytes,
            crc32c: crc,
        })
    }

    /// Refuses adapters (`then`: the base their checkpoint names) over another base (`now`: what
    /// `model.init_from` reads now), saying both and `fix`.
    pub fn must_match(then: Option<&BaseRef>, now: Option<&BaseRef>, checkpoint: &Path, fix: &str) -> Result<()> {
        if then == now {
            return Ok(());
        }
        let said = |b: Option<&BaseRef>| b.map_or("no file (a seeded base)".to_owned(), |b| b.to_string());
        Err(crate::exit::UsageError(format!(
            "the checkpoint {} holds adapters trained over the base {}, but model.init_from now reads {}: {fix}",
            checkpoint.display(),
            said(then),
            said(now)
        ))
        .into())
    }

    /// The base a checkpoint names, if it names one.
    pub fn in_checkpoint(dir: &Path) -> Result<Option<BaseRef>> {
        let file = dir.join(BASE_FILE);
        match fs::read(&file) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", file.display())),
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .with_context(|| format!("reading {}", file.display())),
        }
    }
}

impl std::fmt::Display for BaseRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({} bytes, CRC-32C {:08x})",
            self.path.display(),
            self.bytes,
            self.crc32c
        )
    }
}

/// The file in a checkpoint that names its frozen base.
pub const BASE_FILE: &str = "base.json";

pub struct Store {
    dir: PathBuf,
    keep_last: usize,
    keep_best: bool,
    monitor: Monitor,
}

pub struct Loaded {
    pub dir: PathBuf,
    pub model: Vec<(String, Tensor)>,
    pub optimizer: Vec<(String, Tensor)>,
    pub state: TrainState,
}

impl Store {
    pub fn new(run_dir: &Path, keep_last: usize, keep_best: bool, monitor: Monitor) -> Self {
        Store {
            dir: run_dir.join("checkpoints"),
            keep_last: keep_last.max(1),
            keep_best,
            monitor,
        }
    }

    /// Writes a checkpoint atomically and applies retention. Returns its directory and size.
    pub fn save(&self, c: &Contents) -> Result<(PathBuf, u64)> {
        fs::create_dir_all(&self.dir).with_context(|| format!("creating {}", self.dir.display()))?;
        let name = format!("step-{:09}", c.state.global_step);
        let tmp = self.dir.join(format!(".tmp-{name}"));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        // A save that fails half-way (out of memory, a full disk) leaves no half-written
        // directory behind; the checkpoints already written are untouched either way.
        let partial = Partial(&tmp);
        write_safetensors(&tmp.join("model.safetensors"), &c.model)?;
        crate::fault::abort_save_at(c.state.global_step);
        write_safetensors(&tmp.join("optimizer.safetensors"), &c.optimizer)?;
        write_file(&tmp.join("state.json"), &serde_json::to_vec_pretty(c.state)?)?;
        write_file(&tmp.join("spec.toml"), c.spec_toml.as_bytes())?;
        if let Some(b) = c.base {
            write_file(&tmp.join(BASE_FILE), &serde_json::to_vec_pretty(b)?)?;
        }
        sync_dir(&tmp);
        let fin = self.dir.join(&name);
        if fin.exists() {
            fs::remove_dir_all(&fin)?;
        }
        fs::rename(&tmp, &fin).with_context(|| format!("renaming {} to {}", tmp.display(), fin.display()))?;
        std::mem::forget(partial);
        sync_dir(&self.dir);
        let size = fs::read_dir(&fin)?
            .filter_map(|e| e.ok()?.metadata().ok())
            .map(|m| m.len())
            .sum();
        if let Some(v) = c.state.monitored {
            self.update_best(&name, v)?;
        }
        self.retain()?;
        Ok((fin, size))
    }

    /// The metric a checkpoint's run monitored, from its spec.toml: for a best.json written
    /// without its own.
    fn monitor_of(&self, step: &str) -> Option<Monitor> {
        monitor_in(&Store::spec_of(&self.dir.join(step))?)
    }

    /// The checkpoint `checkpoints/best.json` of a run directory names, where it is there.
    pub fn best_in(run_dir: &Path) -> Option<PathBuf> {
        let best: Best = serde_json::from_slice(&fs::read(run_dir.join("checkpoints/best.json")).ok()?).ok()?;
        Some(run_dir.join("checkpoints").join(best.step)).filter(|d| d.is_dir())
    }

    /// A checkpoint's resolved spec (its spec.toml), where it reads.
    pub fn spec_of(dir: &Path) -> Option<toml::Table> {
        fs::read_to_string(dir.join("spec.toml")).ok()?.parse().ok()
    }

    fn best(&self) -> Option<Best> {
        serde_json::from_slice(&fs::read(self.dir.join("best.json")).ok()?).ok()
    }

    fn update_best(&self, name: &str, value: f64) -> Result<()> {
        // A NaN compares false both ways: it would keep a first place it never earned.
        if !self.keep_best || value.is_nan() {
            return Ok(());
        }
        let better = match self.best() {
            None => true,
            Some(b) if !self.dir.join(&b.step).exists() => true,
            Some(b)
                if b.monitor
                    .or_else(|| self.monitor_of(&b.step))
                    .is_some_and(|m| m != self.monitor) =>
            {
                true
            }
            Some(b) => match self.monitor.maximize() {
                true => value > b.value,
                false => value < b.value,
            },
        };
        if better {
            crate::atomic::write_json(
                &self.dir.join("best.json"),
                &Best {
                    step: name.into(),
                    value,
                    monitor: Some(self.monitor),
                },
            )?;
        }
        Ok(())
    }

    /// Finished checkpoint directories, oldest first.
    pub fn list(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_dir()
                    && p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("step-"))
            })
            .collect();
        v.sort();
        v
    }

    /// Keeps the newest `keep_last` checkpoints and, with `keep_best`, the best. Without it (a
    /// resume that turned it off) an earlier session's best goes like any other, and so does
    /// its best.json once it names nothing.
    fn retain(&self) -> Result<()> {
        let all = self.list();
        let best = self.best().map(|b| self.dir.join(b.step));
        let kept = best.as_ref().filter(|_| self.keep_best);
        let cut = all.len().saturating_sub(self.keep_last);
        for old in &all[..cut] {
            if Some(old) != kept {
                fs::remove_dir_all(old).with_context(|| format!("removing old checkpoint {}", old.display()))?;
            }
        }
        if best.is_some_and(|b| !b.exists()) && !self.keep_best {
            fs::remove_file(self.dir.join("best.json")).context("removing best.json, whose checkpoint is gone")?;
        }
        // Leftovers of a save that was killed half-way.
        for e in fs::read_dir(&self.dir)?.flatten() {
            if e.file_name().to_string_lossy().starts_with(".tmp-") {
                let _ = fs::remove_dir_all(e.path());
            }
        }
        Ok(())
    }

    pub fn latest(&self) -> Option<PathBuf> {
        self.list().pop()
    }

    /// The newest finished checkpoint of a run directory.
    pub fn latest_in(run_dir: &Path) -> Option<PathBuf> {
        Store::new(run_dir, 1, false, Monitor::ValLoss).latest()
    }

    /// A checkpoint's state alone (small; read while planning, before any tensor is loaded).
    pub fn load_state(dir: &Path) -> Result<TrainState> {
        let bytes =
            fs::read(dir.join("state.json")).with_context(|| format!("reading {}/state.json", dir.display()))?;
        let parse = || format!("parsing {}/state.json", dir.display());
        let mut state: TrainState = serde_json::from_slice(&bytes).with_context(parse)?;
        // Checkpoints written before levers had names kept two of them as flags.
        let flags: LegacyFlags = serde_json::from_slice(&bytes).with_context(parse)?;
        for (on, name) in [
            (flags.on_cpu_fallback, "cpu"),
            (flags.activation_checkpointing, "recompute"),
        ] {
            if on && !state.levers.iter().any(|l| l == name) {
                state.levers.push(name.to_owned());
            }
        }
        let counted: TokenCounts = serde_json::from_slice(&bytes).with_context(parse)?;
        state.tokens_uncounted = counted.tokens_seen.is_none();
        if let Some(bad) = state.out_of_range() {
            return Err(crate::exit::UsageError(format!(
                "{}/state.json: {bad}, which no run writes: the file was edited or damaged; \
                 remove this checkpoint directory to resume from the one before it",
                dir.display()
            ))
            .into());
        }
        Ok(state)
    }

    /// `state_home`: where the run keeps its optimizer state. State bound for the host is read
    /// there, so the cap never holds it even for a moment (a CPU run counts it apart).
    pub fn load(dir: &Path, state_home: crate::host::Home) -> Result<Loaded> {
        let state = Store::load_state(dir)?;
        // Saves are atomic, so a file that does not read was damaged after: the one before is whole.
        let damaged = |e: anyhow::Error| -> anyhow::Error {
            crate::exit::UsageError(format!(
                "{e:#}; this checkpoint is damaged: remove {} to resume from the one before it",
                dir.display()
            ))
            .into()
        };
        Ok(Loaded {
            dir: dir.to_owned(),
            model: read_safetensors(&dir.join("model.safetensors")).map_err(damaged)?,
            optimizer: {
                let _host = state_home.is_host().then(crate::shim::HostScope::enter);
                read_safetensors(&dir.join("optimizer.safetensors")).map_err(damaged)?
            },
            state,
        })
    }
}

/// A save's temporary directory, removed unless the save got as far as renaming it.
struct Partial<'a>(&'a Path);

impl Drop for Partial<'_> {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(self.0);
    }
}

/// `--checkpoint` (a model.safetensors, or a checkpoint directory holding one), else the
/// run's best checkpoint, else its newest.
pub fn weights_file(run_dir: &Path, given: Option<&Path>) -> Result<PathBuf> {
    let (file, what) = match given {
        Some(p) if p.is_dir() => (p.join("model.safetensors"), "--checkpoint"),
        Some(p) => (p.to_path_buf(), "--checkpoint"),
        None => match Store::best_in(run_dir).or_else(|| Store::latest_in(run_dir)) {
            Some(d) => (d.join("model.safetensors"), "the run's checkpoint"),
            None => {
                return Err(crate::exit::UsageError(format!(
                    "{} has no checkpoint yet (looked in {}/checkpoints); name one with --checkpoint",
                    run_dir.display(),
                    run_dir.display()
                ))
                .into())
            }
        },
    };
    if !file.is_file() {
        return Err(crate::exit::UsageError(format!("{what} {}: no such file", file.display())).into());
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-weight checkpoint at `step` whose monitored value is `loss`.
    fn save(store: &Store, step: i64, loss: f64) {
        store
            .save(&Contents {
                model: vec![("w".to_string(), Tensor::from_slice(&[1f32]))],
                optimizer: vec![],
                state: &state(step, Some(loss)),
                spec_toml: "",
                base: None,
            })
            .unwrap();
    }

    fn names(store: &Store) -> Vec<String> {
        store
            .list()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    fn state(step: i64, monitored: Option<f64>) -> TrainState {
        TrainState {
            epoch: step,
            groups_done: 0,
            global_step: step,
            weight_steps: step,
            arch: ArchState::default(),
            micro_batch: 4,
            accumulation_steps: 1,
            effective_batch: 4,
            clean_steps: 0,
            eval_micro_batch: None,
            eval_clean: 0,
            epoch_loss_sum: 0.0,
            epoch_correct: 0,
            epoch_seen: 0,
            epoch_tokens: 0,
            tokens_seen: 0,
            tokens_uncounted: false,
            levers: vec![],
            scaler: None,
            monitored,
            finished: false,
            unfrozen_at: None,
        }
    }

    #[test]
    fn safetensors_round_trip_of_mixed_kinds() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.safetensors");
        let a = Tensor::from_slice(&[1.5f32, -2.0, 3.25]).reshape([3, 1]);
        let b = Tensor::from_slice(&[7i64, 8]);
        write_safetensors(&p, &[("a".into(), a.shallow_clone()), ("b".into(), b.shallow_clone())]).unwrap();
        let back = read_safetensors(&p).unwrap();
        let get = |n: &str| back.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
        assert!(get("a").equal(&a));
        assert!(get("b").equal(&b));
    }

    #[test]
    fn retention_keeps_last_n_and_the_best() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path(), 2, true, Monitor::ValLoss);
        for (step, loss) in [(1, 0.5), (2, 0.1), (3, 0.4), (4, 0.3)] {
            save(&store, step, loss);
        }
        assert_eq!(names(&store), ["step-000000002", "step-000000003", "step-000000004"]);
        assert_eq!(
            Store::load(&store.latest().unwrap(), crate::host::Home::Device)
                .unwrap()
                .state
                .global_step,
            4
        );
        // Resumed to monitor accuracy: the loss's best (0.1) is not compared with 0.2's accuracy.
        let by_acc = Store::new(dir.path(), 2, true, Monitor::ValAcc);
        by_acc.update_best("step-000000004", 0.2).unwrap();
        let best = by_acc.best().unwrap();
        assert_eq!(
            (best.step.as_str(), best.value, best.monitor),
            ("step-000000004", 0.2, Some(Monitor::ValAcc))
        );
        // A best.json without its metric takes it from its checkpoint's spec.toml ...
        let legacy = r#"{"step": "step-000000003", "value": 0.3}"#;
        fs::write(dir.path().join("checkpoints/best.json"), legacy).unwrap();
        by_acc.update_best("step-000000004", 0.2).unwrap();
        assert_eq!(
            by_acc.best().unwrap().step,
            "step-000000003",
            "no spec.toml says: compared as before"
        );
        fs::write(
            dir.path().join("checkpoints/step-000000003/spec.toml"),
            "[checkpoint]\nmonitor = \"val_loss\"\n",
        )
        .unwrap();
        fs::write(dir.path().join("checkpoints/best.json"), legacy).unwrap();
        by_acc.update_best("step-000000004", 0.2).unwrap();
        assert_eq!(
            by_acc.best().unwrap().step,
            "step-000000004",
            "a loss is not an accuracy"
        );
    }

    #[test]
    fn without_keep_best_an_earlier_best_goes_like_any_other() {
        let dir = tempfile::tempdir().unwrap();
        let first = Store::new(dir.path(), 1, true, Monitor::ValLoss);
        save(&first, 1, 0.1);
        save(&first, 2, 0.5);
        assert_eq!(first.list().len(), 2, "the best is kept beside the last");
        let resumed = Store::new(dir.path(), 1, false, Monitor::ValLoss);
        save(&resumed, 3, 0.4);
        assert_eq!(names(&resumed), ["step-000000003"]);
        assert!(
            !dir.path().join("checkpoints/best.json").exists(),
            "it named a removed checkpoint"
        );
    }

    #[test]
    fn levers_are_saved_by_name_and_old_flags_are_read_as_names() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = state(1, None);
        s.levers = vec!["recompute".into()];
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["levers"], serde_json::json!(["recompute"]));
        assert!(json.get("on_cpu_fallback").is_none());
        // A checkpoint from before levers had names.
        let mut old = json.as_object().unwrap().clone();
        old.remove("levers");
        old.insert("on_cpu_fallback".into(), true.into());
        old.insert("activation_checkpointing".into(), true.into());
        fs::write(dir.path().join("state.json"), serde_json::to_vec(&old).unwrap()).unwrap();
        assert_eq!(Store::load_state(dir.path()).unwrap().levers, ["cpu", "recompute"]);
    }

    #[test]
    fn a_state_no_run_writes_is_refused_saying_which_field() {
        let dir = tempfile::tempdir().unwrap();
        for (field, value, says) in [
            ("micro_batch", 0, "micro_batch is 0 (at least 1)"),
            ("accumulation_steps", -5, "accumulation_steps is -5 (at least 1)"),
            ("epoch", -1, "epoch is -1 (at least 0)"),
            ("effective_batch", -1, "effective_batch is -1 (at least 0)"),
        ] {
            let mut json = serde_json::to_value(state(1, None)).unwrap();
            json[field] = value.into();
            fs::write(dir.path().join("state.json"), serde_json::to_vec(&json).unwrap()).unwrap();
            let e = Store::load_state(dir.path()).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
            assert!(e.downcast_ref::<crate::exit::UsageError>().is_some(), "exit 2: {e}");
        }
        // A checkpoint from before effective_batch was saved reads it as 0, and resumes.
        let mut json = serde_json::to_value(state(1, None)).unwrap();
        json.as_object_mut().unwrap().remove("effective_batch");
        fs::write(dir.path().join("state.json"), serde_json::to_vec(&json).unwrap()).unwrap();
        assert_eq!(Store::load_state(dir.path()).unwrap().effective_batch, 0);
    }
}
