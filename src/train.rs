//! The training loop: optimizer steps over groups of samples (the effective batch), split into
//! micro-batches, with the OOM policy applied at the step boundary.
//!
//! Invariant that makes OOM recovery exact: a group is a fixed list of sample indices, each
//! micro-batch's loss is its *sum* over samples divided by the group's size, so the accumulated
//! gradient is the group mean however the group is split. A failed group leaves no trace (its
//! tensors are dropped while unwinding, gradients are zeroed) and is retried whole.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use tch::{nn, Device, Kind, Reduction, Tensor};

use crate::checkpoint::{self, NamedTensors, Store, TrainState};
use crate::data::{self, Dataset, Splits};
use crate::exit::{Interrupted, OomExit};
use crate::memory::{self, CachePolicy, ClearReason, Place};
use crate::metrics::{write_json_atomic, Metrics};
use crate::model::{Net, ARCH_PREFIX};
use crate::oom::{self, BatchShape, Decision, Policy, StepError};
use crate::optim::{clip_grad_norm, LrSchedule, Optimizer};
use crate::progress::Progress;
use crate::report::{human_bytes, human_duration};
use crate::signals::StopFlag;
use crate::spec::{DartsOptions, Precision, Spec};

/// Counts for summary.json.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct OomCounts {
    pub events: u64,
    pub backoffs: u64,
    pub cpu_fallbacks: u64,
    pub grow_backs: u64,
}

/// Per-epoch results, for records and the summary.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct EpochResult {
    pub epoch: i64,
    pub train_loss: f64,
    pub train_acc: f64,
    pub val_loss: Option<f64>,
    pub val_acc: Option<f64>,
    pub seconds: f64,
    pub samples_per_s: f64,
}

pub struct Trainer {
    pub spec: Spec,
    pub spec_toml: String,
    pub run_dir: PathBuf,
    pub vs: nn::VarStore,
    pub net: Box<dyn Net>,
    pub device: Device,
    pub data: Splits,
    pub opt: Optimizer,
    pub arch_opt: Option<Optimizer>,
    pub sched: LrSchedule,
    pub shape: BatchShape,
    pub configured: BatchShape,
    pub policy: Policy,
    pub cache: CachePolicy,
    pub metrics: Metrics,
    pub progress: Progress,
    pub store: Store,
    pub state: TrainState,
    pub stop: StopFlag,
    pub ooms: OomCounts,
    pub oom_reported: bool,
    pub last: Option<EpochResult>,
    pub samples_trained: u64,
    pub train_seconds: f64,
    pub checkpoint_spikes: Vec<u64>,
    pub cap: Option<crate::run::Cap>,
    pub alloc_conf: Option<String>,
    pub t_start: Instant,
    pub peaks: crate::run::Peaks,
    /// Measure and report the first step of this session (memory.preflight).
    pub preflight_pending: bool,
    /// The architecture steps' current validation round and its order.
    pub val_order: Option<(i64, Vec<i64>)>,
}

/// How a run ended, for summary.json and the exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Completed,
    Interrupted,
    Oom,
}

struct GroupOut {
    loss_sum: f64,
    correct: i64,
}

impl Trainer {
    fn place(&self) -> Place {
        Place::of(self.device)
    }

    fn effective(&self) -> i64 {
        self.configured.effective()
    }

    fn to_input(&self, x: &Tensor) -> Tensor {
        let x = x.to_device(self.device);
        match self.spec.train.precision {
            Precision::Fp32 => x,
            Precision::Bf16 => x.to_kind(Kind::BFloat16),
        }
    }

    /// Sum-reduced cross-entropy and correct count of one micro-batch.
    fn forward_loss(&self, ds: &Dataset, idx: &[i64], train: bool) -> (Tensor, Tensor) {
        let (x, y) = ds.batch(&Tensor::from_slice(idx));
        let y = y.to_device(self.device);
        let logits = self.net.forward_t(&self.to_input(&x), train).to_kind(Kind::Float);
        let loss = logits.cross_entropy_loss::<Tensor>(&y, None, Reduction::Sum, -100, 0.0);
        let correct = logits.argmax(-1, false).eq_tensor(&y).sum(Kind::Int64);
        (loss, correct)
    }

    /// One optimizer step of the weights over `group` (sample indices of the training set).
    fn weight_group(&mut self, group: &[i64], lr: f64) -> Result<GroupOut, StepError> {
        let b = self.shape.micro_batch as usize;
        let n = group.len() as f64;
        oom::guarded(|| {
            self.opt.zero_grad();
            let mut loss_sum = Tensor::zeros([], (Kind::Float, self.device));
            let mut correct = Tensor::zeros([], (Kind::Int64, self.device));
            for chunk in group.chunks(b) {
                let (loss, c) = self.forward_loss(&self.data.train, chunk, true);
                (&loss / n).backward();
                loss_sum += loss.detach();
                correct += c;
            }
            if self.spec.train.grad_clip_norm > 0.0 {
                clip_grad_norm(self.opt.params(), self.spec.train.grad_clip_norm);
            }
            self.opt.step(lr);
            // One read per optimizer step; progress and records need the loss.
            GroupOut {
                loss_sum: loss_sum.double_value(&[]),
                correct: correct.int64_value(&[]),
            }
        })
    }

    /// First-order DARTS: one Adam step of α on a held-out micro-batch.
    fn arch_step(&mut self) -> Result<(), StepError> {
        let Some(_) = &self.arch_opt else { return Ok(()) };
        let nval = self.data.val.len();
        let b = self.shape.micro_batch.min(nval);
        let start = self.state.val_cursor;
        let idx: Vec<i64> = (0..b).map(|k| self.val_index(start + k)).collect();
        let lr = self
            .spec
            .model
            .darts
            .as_ref()
            .map_or(DartsOptions::default().arch_lr, |d| d.arch_lr);
        oom::guarded(|| {
            self.opt.zero_grad();
            let arch = self.arch_opt.as_mut().expect("checked above");
            arch.zero_grad();
            let (loss, _) = {
                let (x, y) = self.data.val.batch(&Tensor::from_slice(&idx));
                let y = y.to_device(self.device);
                let logits = self.net.forward_t(&self.to_input(&x), true).to_kind(Kind::Float);
                (logits.cross_entropy_for_logits(&y), ())
            };
            loss.backward();
            self.arch_opt.as_mut().expect("checked above").step(lr);
        })?;
        self.state.arch_steps += 1;
        self.state.val_cursor += b;
        Ok(())
    }

    /// The k-th validation sample of the endless, per-round shuffled stream the arch step reads.
    /// The permutation of each round is computed once and kept until the stream moves on.
    fn val_index(&mut self, k: i64) -> i64 {
        let n = self.data.val.len();
        let round = k / n;
        if self.val_order.as_ref().is_none_or(|(r, _)| *r != round) {
            self.val_order = Some((
                round,
                data::epoch_order(n, self.spec.job.seed.wrapping_add(7919), round),
            ));
        }
        let (_, order) = self.val_order.as_ref().expect("just filled");
        order[(k % n) as usize]
    }

    fn record(&mut self, kind: &str, fields: serde_json::Value) -> Result<()> {
        self.metrics.record(kind, fields)
    }

    /// Applies `memory.on_oom` to one OOM. Ok: retry the failed work; Err: the run ends.
    fn handle_oom(&mut self, err: StepError, phase: &str, batch_shape: Vec<i64>) -> Result<()> {
        let (kind, message) = match err {
            StepError::Oom { kind, message } => (kind, message),
            StepError::Other(m) => {
                return Err(anyhow::anyhow!("{phase} failed: {m}"));
            }
        };
        self.ooms.events += 1;
        // Zero whatever partial gradients the failed step left before anything else.
        self.opt.zero_grad();
        if let Some(a) = &mut self.arch_opt {
            a.zero_grad();
        }
        self.cache.clear(self.place(), ClearReason::Oom);
        if !self.oom_reported {
            self.oom_reported = true;
            if let Err(e) = crate::run::write_oom_report(self, phase, &batch_shape, &message) {
                tracing::warn!("could not write the OOM report: {e:#}");
            }
        }
        let mut skipped = vec![];
        let decision = self.policy.decide(self.shape, self.device == Device::Cpu, &mut skipped);
        for s in &skipped {
            tracing::warn!("OOM policy: skipped {s}");
        }
        let before = self.shape;
        self.record(
            "oom",
            json!({
                "epoch": self.state.epoch + 1, "step": self.state.global_step, "phase": phase, "kind": kind,
                "error": message, "batch_shape": batch_shape, "device": self.device_name(),
                "micro_batch_before": before.micro_batch, "accumulation_before": before.accumulation_steps,
                "decision": decision, "skipped": skipped,
            }),
        )?;
        match decision {
            Decision::Backoff { to } => {
                self.ooms.backoffs += 1;
                self.shape = to;
                self.state.clean_steps = 0;
                tracing::warn!(
                    "out of memory in {phase} at epoch {} step {} ({}); backing off: micro-batch {} -> {}, accumulation {} -> {} (effective batch stays {})",
                    self.state.epoch + 1,
                    self.state.global_step,
                    first_line(&message),
                    before.micro_batch,
                    to.micro_batch,
                    before.accumulation_steps,
                    to.accumulation_steps,
                    self.effective()
                );
                Ok(())
            }
            Decision::MoveToCpu => {
                self.ooms.cpu_fallbacks += 1;
                tracing::warn!(
                    "out of memory on {} in {phase} ({}); MOVING THE RUN TO THE CPU as memory.on_oom says. It continues, slower.",
                    self.device_name(),
                    first_line(&message)
                );
                self.move_to(Device::Cpu);
                self.state.on_cpu_fallback = true;
                Ok(())
            }
            Decision::Fail => {
                tracing::error!(
                    "out of memory in {phase} ({}); memory.on_oom has nothing left to try",
                    first_line(&message)
                );
                // The run ends here: lift a CPU cap so the last good state can be written.
                crate::sysmem::lift_data_limit();
                let saved = self.save_checkpoint("oom").map(|(p, _)| p.display().to_string());
                let note = match &saved {
                    Ok(p) => format!("last good state saved to {p}; resume with --resume after adding \"backoff\" to memory.on_oom, or with a smaller train.batch_size"),
                    Err(e) => format!("no checkpoint could be written: {e:#}"),
                };
                self.write_summary(Status::Oom)?;
                Err(OomExit(format!("out of memory in {phase}: {}; {note}", first_line(&message))).into())
            }
        }
    }

    pub fn device_name(&self) -> String {
        match self.device {
            Device::Cuda(i) => format!("cuda:{i}"),
            _ => "cpu".into(),
        }
    }

    fn move_to(&mut self, device: Device) {
        self.vs.set_device(device);
        self.opt.to_device(device);
        if let Some(a) = &mut self.arch_opt {
            a.to_device(device);
        }
        self.device = device;
        let _ = crate::shim::empty_cache();
    }

    /// Runs `f` until it succeeds or the OOM policy gives up.
    fn with_policy<T>(
        &mut self,
        phase: &str,
        mut f: impl FnMut(&mut Self) -> Result<T, StepError>,
        shape_of: impl Fn(&Self) -> Vec<i64>,
    ) -> Result<T> {
        loop {
            match f(self) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    let shape = shape_of(self);
                    self.handle_oom(e, phase, shape)?
                }
            }
        }
    }

    fn input_shape(&self, b: i64) -> Vec<i64> {
        let mut s = vec![b];
        s.extend(self.data.train.x.size().into_iter().skip(1));
        s
    }

    /// Reports the preflight: the first optimizer step of this session, measured. It is a real
    /// step (not a rehearsal), so it costs nothing and an OOM in it meets the policy at once.
    fn report_preflight(&mut self, peak: u64) -> Result<()> {
        let cap = self.cap.as_ref().map(|c| c.bytes);
        // On the CPU the cap limits growth above the process's baseline, so compare growth.
        let used = match (self.device, &self.cap) {
            (Device::Cpu, Some(c)) => peak.saturating_sub(c.baseline_rss_bytes.unwrap_or(0)),
            _ => peak,
        };
        let what = match (self.device, &self.cap) {
            (Device::Cpu, Some(_)) => "RSS growth above the baseline",
            (Device::Cpu, None) => "peak RSS",
            _ => "peak allocated",
        };
        let headroom = cap.map(|c| c as i64 - used as i64);
        let head = match headroom {
            Some(h) if h >= 0 => format!(
                "{} headroom under the {} cap",
                human_bytes(h as u64),
                human_bytes(cap.unwrap_or(0))
            ),
            Some(h) => format!(
                "{} over the {} cap",
                human_bytes((-h) as u64),
                human_bytes(cap.unwrap_or(0))
            ),
            None => "no cap set".into(),
        };
        self.progress.println(&format!(
            "Preflight: the first step at micro-batch {} used {} ({what}); {head}",
            self.shape.micro_batch,
            human_bytes(used)
        ));
        self.record(
            "preflight",
            json!({"micro_batch": self.shape.micro_batch, "accumulation_steps": self.shape.accumulation_steps,
                   "peak_bytes": used, "measure": what, "cap_bytes": cap, "headroom_bytes": headroom,
                   "device": self.device_name()}),
        )
    }

    fn validate(&mut self) -> Result<Option<(f64, f64)>> {
        let n = self.data.val.len();
        if n == 0 {
            return Ok(None);
        }
        let (loss, correct) = self.with_policy(
            "validation",
            |t| {
                let b = t.shape.micro_batch as usize;
                oom::guarded(|| {
                    tch::no_grad(|| {
                        let mut loss = 0.0;
                        let mut correct = 0i64;
                        let idx: Vec<i64> = (0..n).collect();
                        for chunk in idx.chunks(b) {
                            let (l, c) = t.forward_loss(&t.data.val, chunk, false);
                            loss += l.double_value(&[]);
                            correct += c.int64_value(&[]);
                        }
                        (loss, correct)
                    })
                })
            },
            |t| t.input_shape(t.shape.micro_batch),
        )?;
        Ok(Some((loss / n as f64, correct as f64 / n as f64)))
    }

    fn checkpoint_contents(&self) -> (NamedTensors, NamedTensors) {
        let mut model: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        model.sort_by(|a, b| a.0.cmp(&b.0));
        let mut optim: Vec<(String, Tensor)> = self
            .opt
            .state_tensors()
            .into_iter()
            .map(|(n, t)| (format!("weight/{n}"), t))
            .collect();
        if let Some(a) = &self.arch_opt {
            optim.extend(a.state_tensors().into_iter().map(|(n, t)| (format!("arch/{n}"), t)));
        }
        (model, optim)
    }

    /// Saves, records the memory spike of the save, and clears the cache if configured.
    pub fn save_checkpoint(&mut self, why: &str) -> Result<(PathBuf, u64)> {
        let t0 = Instant::now();
        let before = memory::sample(self.place());
        memory::reset_peaks(self.place());
        self.state.weight_steps = self.opt.steps_taken();
        self.state.micro_batch = self.shape.micro_batch;
        self.state.accumulation_steps = self.shape.accumulation_steps;
        let (model, optim) = self.checkpoint_contents();
        let saved = self.store.save(&checkpoint::Contents {
            model,
            optimizer: optim,
            state: &self.state,
            spec_toml: &self.spec_toml,
        });
        let peak = memory::window_peak(self.place());
        let base = match self.place() {
            Place::Cpu => before.rss_bytes,
            Place::Cuda(_) => before.allocated_bytes.unwrap_or(0),
        };
        let spike = peak.saturating_sub(base);
        let (path, size) = saved?;
        self.checkpoint_spikes.push(spike);
        if self.spec.memory.clear_after_checkpoint {
            self.cache.clear(self.place(), ClearReason::Checkpoint);
        }
        self.record(
            "checkpoint",
            json!({"reason": why, "path": path, "bytes": size, "seconds": t0.elapsed().as_secs_f64(),
                   "spike_bytes": spike, "epochs_completed": self.state.epoch, "step": self.state.global_step}),
        )?;
        Ok((path, size))
    }

    fn maybe_grow_back(&mut self) -> Result<()> {
        let after = self.spec.memory.grow_back_after;
        if after <= 0 || self.shape.micro_batch >= self.configured.micro_batch || self.state.clean_steps < after {
            return Ok(());
        }
        let before = self.shape;
        let micro = (before.micro_batch * 2).min(self.configured.micro_batch);
        self.shape = BatchShape {
            micro_batch: micro,
            accumulation_steps: (self.effective() + micro - 1) / micro,
        };
        self.state.clean_steps = 0;
        self.ooms.grow_backs += 1;
        tracing::info!(
            "{} clean steps: growing the micro-batch back {} -> {}",
            after,
            before.micro_batch,
            micro
        );
        self.record(
            "grow_back",
            json!({"step": self.state.global_step, "micro_batch_before": before.micro_batch, "micro_batch": micro}),
        )
    }

    pub fn train(&mut self) -> Result<Status> {
        let epochs = self.spec.train.epochs;
        let n = self.data.train.len();
        let e = self.effective();
        let steps_per_epoch = (n + e - 1) / e;
        while self.state.epoch < epochs {
            let epoch = self.state.epoch;
            let order = data::epoch_order(n, self.spec.job.seed, epoch);
            let groups: Vec<&[i64]> = order.chunks(e as usize).collect();
            memory::reset_peaks(self.place());
            let t0 = Instant::now();
            let mut seen_this_session = 0u64;
            self.progress
                .start_epoch(epoch, epochs, steps_per_epoch as u64, self.state.groups_done as u64);
            for group in &groups[self.state.groups_done as usize..] {
                let group = group.to_vec();
                let measure = self.preflight_pending;
                if measure {
                    memory::reset_peaks(self.place());
                }
                if self.arch_opt.is_some() {
                    self.with_policy(
                        "architecture step",
                        |t| t.arch_step(),
                        |t| t.input_shape(t.shape.micro_batch),
                    )?;
                }
                let lr = self.sched.lr_at(self.opt.steps_taken());
                let out = self.with_policy(
                    "training step",
                    |t| {
                        if measure {
                            memory::reset_peaks(t.place());
                        }
                        t.weight_group(&group, lr)
                    },
                    |t| t.input_shape(t.shape.micro_batch),
                )?;
                if measure {
                    self.preflight_pending = false;
                    let peak = memory::window_peak(self.place());
                    self.report_preflight(peak)?;
                }
                self.state.groups_done += 1;
                self.state.global_step += 1;
                self.state.clean_steps += 1;
                self.state.epoch_loss_sum += out.loss_sum;
                self.state.epoch_correct += out.correct;
                self.state.epoch_seen += group.len() as i64;
                seen_this_session += group.len() as u64;
                self.cache.after_step(self.place(), self.state.global_step as u64);
                self.maybe_grow_back()?;
                let loss = out.loss_sum / group.len() as f64;
                let rate = seen_this_session as f64 / t0.elapsed().as_secs_f64().max(1e-9);
                let every = self.spec.log.every_steps;
                if every > 0 && self.state.global_step % every == 0 {
                    let mem = memory::sample(self.place());
                    self.record(
                        "step",
                        json!({"epoch": epoch + 1, "step": self.state.global_step, "loss": loss, "lr": lr,
                               "micro_batch": self.shape.micro_batch, "samples_per_s": rate, "memory": mem}),
                    )?;
                }
                let place = self.place();
                self.progress.step(self.state.groups_done as u64, || {
                    let m = memory::sample(place);
                    let mem = m.allocated_bytes.unwrap_or(m.rss_bytes);
                    format!("loss {loss:.4}  {rate:.1} samples/s  mem {}", human_bytes(mem))
                });
                if self.stop.requested() {
                    self.progress.finish_epoch();
                    let (p, _) = self.save_checkpoint("interrupted")?;
                    self.write_summary(Status::Interrupted)?;
                    return Err(Interrupted(format!(
                        "interrupted at epoch {} step {}; checkpoint saved to {}; continue with --resume",
                        epoch + 1,
                        self.state.global_step,
                        p.display()
                    ))
                    .into());
                }
            }
            self.progress.finish_epoch();
            let seconds = t0.elapsed().as_secs_f64();
            self.samples_trained += seen_this_session;
            self.train_seconds += seconds;
            let val = self.validate()?;
            let mem = memory::sample(self.place());
            self.note_peaks();
            let seen = self.state.epoch_seen.max(1) as f64;
            let result = EpochResult {
                epoch: epoch + 1,
                train_loss: self.state.epoch_loss_sum / seen,
                train_acc: self.state.epoch_correct as f64 / seen,
                val_loss: val.map(|v| v.0),
                val_acc: val.map(|v| v.1),
                seconds,
                samples_per_s: seen_this_session as f64 / seconds.max(1e-9),
            };
            let genotype = self.net.genotype();
            if let Some(g) = &genotype {
                write_json_atomic(
                    &self.run_dir.join("genotype.json"),
                    &json!({"epoch": epoch + 1, "genotype": g}),
                )?;
            }
            self.record(
                "epoch",
                json!({"epoch": epoch + 1, "train_loss": result.train_loss, "train_acc": result.train_acc,
                       "val_loss": result.val_loss, "val_acc": result.val_acc, "seconds": seconds,
                       "samples_per_s": result.samples_per_s, "lr": self.sched.lr_at(self.opt.steps_taken()),
                       "micro_batch": self.shape.micro_batch, "accumulation_steps": self.shape.accumulation_steps,
                       "device": self.device_name(), "memory": mem, "cache": self.cache, "genotype": genotype}),
            )?;
            self.progress.println(&epoch_line(&result, &mem, epochs));
            if let Some(g) = &genotype {
                self.progress
                    .println(&format!("  genotype: {}", serde_json::to_string(g)?));
            }
            self.state.monitored = match self.spec.checkpoint.monitor {
                crate::spec::Monitor::ValLoss => result.val_loss,
                crate::spec::Monitor::ValAcc => result.val_acc,
                crate::spec::Monitor::TrainLoss => Some(result.train_loss),
            };
            self.last = Some(result);
            self.state.epoch += 1;
            self.state.groups_done = 0;
            self.state.epoch_loss_sum = 0.0;
            self.state.epoch_correct = 0;
            self.state.epoch_seen = 0;
            let every = self.spec.checkpoint.every_epochs;
            let last_epoch = self.state.epoch == epochs;
            self.state.finished = last_epoch;
            if last_epoch || (every > 0 && self.state.epoch % every == 0) {
                self.save_checkpoint("epoch").context("saving a checkpoint")?;
            }
            if self.spec.memory.clear_on_epoch_end {
                self.cache.clear(self.place(), ClearReason::EpochEnd);
            }
        }
        self.write_summary(Status::Completed)?;
        Ok(Status::Completed)
    }

    pub fn write_summary(&mut self, status: Status) -> Result<()> {
        crate::run::write_summary(self, status)
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

fn epoch_line(r: &EpochResult, m: &memory::MemorySample, epochs: i64) -> String {
    let val = match (r.val_loss, r.val_acc) {
        (Some(l), Some(a)) => format!("  val loss {l:.4} acc {:.1}%", a * 100.0),
        _ => String::new(),
    };
    let mem = match (
        m.allocated_bytes,
        m.reserved_bytes,
        m.peak_allocated_bytes,
        m.peak_reserved_bytes,
    ) {
        (Some(a), Some(r), Some(pa), Some(pr)) => format!(
            "GPU {} allocated / {} reserved (peak {} / {}); RSS {}",
            human_bytes(a),
            human_bytes(r),
            human_bytes(pa),
            human_bytes(pr),
            human_bytes(m.rss_bytes)
        ),
        _ => format!(
            "RSS {} (epoch peak {})",
            human_bytes(m.rss_bytes),
            human_bytes(m.peak_rss_bytes)
        ),
    };
    format!(
        "epoch {}/{}  train loss {:.4} acc {:.1}%{val}  {}  {:.1} samples/s  | {mem}",
        r.epoch,
        epochs,
        r.train_loss,
        r.train_acc * 100.0,
        human_duration(r.seconds),
        r.samples_per_s
    )
}

/// Weight-optimizer parameters: every trainable variable that is not an architecture weight,
/// in name order so optimizer state lines up across runs.
pub fn split_params(vs: &nn::VarStore) -> (NamedTensors, NamedTensors) {
    let mut all: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all.into_iter().partition(|(n, _)| !n.starts_with(ARCH_PREFIX))
}
