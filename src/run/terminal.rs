//! The terminal's side of a run: the same events the `Recorder` writes, rendered as the lines a
//! user reads (the preflight, the epoch line, warnings), plus the notices that have no record of
//! their own (the progress bar, what an OOM's answer means for the shapes, a record that was
//! lost). The loop writes no text itself.
use crate::data::DataWait;
use crate::human::{human_bytes, human_duration};
use crate::memory::MemorySample;
use crate::oom::BatchShape;
use crate::progress::Progress;
use crate::records::{EpochEvent, EpochResult, EpochTokens, Event, GrowBackEvent, MicroBatchOf, PreflightEvent};

/// What the terminal shows beyond the records.
pub enum Notice {
    EpochStarts {
        epoch: i64,
        steps: u64,
        done: u64,
    },
    /// After every optimizer step: the progress bar's position and message.
    Stepped {
        done: u64,
        loss: Option<f64>,
        samples_per_s: f64,
        /// A language model's counted target tokens per second.
        tokens_per_s: Option<f64>,
        memory: u64,
    },
    /// The epoch's steps are over (or the run stops in them).
    EpochEnds,
    /// A lever answered a training OOM; `said` is the lever's own account of the change.
    OomAnswered {
        phase: String,
        epoch: i64,
        step: i64,
        device: String,
        reason: String,
        said: String,
    },
    /// The OOM was the static bill's: `check`'s cannot-fit warning, with what to set.
    CannotFit(String),
    /// `memory.on_oom` has nothing left to try: the run ends.
    OutOfOptions {
        phase: String,
        reason: String,
    },
    /// Validation's micro-batch halved; training's shape stays.
    EvalHalved {
        epoch: i64,
        device: String,
        reason: String,
        before: i64,
        after: i64,
        training: BatchShape,
    },
    /// Validation ran out of memory at one sample: this epoch's is skipped.
    EvalSkipped {
        reason: String,
    },
    /// A periodic checkpoint did not fit (the save's own account) and the run goes on.
    CheckpointSkipped {
        why: String,
        /// When the next one is due: "after 2 more epoch(s)".
        next: String,
    },
    /// Something that costs the run nothing else could not be had, and why.
    Lost(Lost, anyhow::Error),
}

/// What a run can lose without stopping.
pub enum Lost {
    /// A step record whose loss read failed.
    StepRecord,
    /// Every rank's peaks in the summary (data-parallel).
    RankPeaks,
    /// The allocator's history at the run's end (`memory.record_history`).
    EndSnapshot,
}

pub struct Terminal {
    progress: Progress,
    epochs: i64,
    /// Only the process that writes the records warns about the loss (data-parallel).
    leads: bool,
    /// The data-wait note names its keys once a run.
    wait_note: DataWait,
}

impl Terminal {
    pub fn new(progress: Progress, epochs: i64, leads: bool) -> Terminal {
        Terminal {
            progress,
            epochs,
            leads,
            wait_note: DataWait::default(),
        }
    }

    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    pub fn event(&mut self, e: &Event) {
        match e {
            Event::Preflight(p) => self.progress.println(&preflight_line(p)),
            Event::Epoch(e) => self.epoch(e),
            Event::GrowBack(g) => grow_back(g),
            Event::Prefetch(p) => tracing::warn!(
                "host memory low ({} available): the data loader keeps {} micro-batch(es) ahead instead of {}",
                human_bytes(p.available_bytes),
                p.prefetch,
                p.prefetch_before
            ),
            Event::Oom(o) => {
                for s in &o.skipped {
                    tracing::warn!("OOM policy: skipped {s}");
                }
            }
            _ => {}
        }
    }

    fn epoch(&mut self, e: &EpochEvent) {
        let r = &e.result;
        let note = self.wait_note.note(e.data_wait_seconds, r.seconds);
        self.progress.println(&(epoch_line(r, &e.memory, self.epochs) + &note));
        if !r.train_loss.is_finite() && self.leads {
            tracing::warn!(
                "epoch {}: the training loss is {}, so the weights no longer learn; lower train.lr, \
                 check the data and model.init_from for NaN or infinite values, or train in fp32",
                r.epoch,
                r.train_loss
            );
        }
        if let Some(g) = &e.genotype {
            let g = serde_json::to_string(g).unwrap_or_default();
            self.progress.println(&format!("  genotype: {g}"));
        }
    }

    pub fn notice(&mut self, n: Notice) {
        match n {
            Notice::EpochStarts { epoch, steps, done } => self.progress.start_epoch(epoch, self.epochs, steps, done),
            Notice::Stepped {
                done,
                loss,
                samples_per_s,
                tokens_per_s,
                memory,
            } => self.progress.step(done, || {
                let text = loss.map_or("-".into(), |l| format!("{l:.4}"));
                match tokens_per_s {
                    Some(t) => {
                        let ppl = loss.map_or("-".into(), |l| format!("{:.2}", l.exp()));
                        format!("loss {text} ppl {ppl}  {t:.0} tokens/s  mem {}", human_bytes(memory))
                    }
                    None => format!("loss {text}  {samples_per_s:.1} samples/s  mem {}", human_bytes(memory)),
                }
            }),
            Notice::EpochEnds => self.progress.finish_epoch(),
            Notice::OomAnswered {
                phase,
                epoch,
                step,
                device,
                reason,
                said,
            } => tracing::warn!("out of memory in {phase} at epoch {epoch} step {step} on {device} ({reason}); {said}"),
            Notice::CannotFit(w) => tracing::warn!("{w}"),
            Notice::OutOfOptions { phase, reason } => {
                tracing::error!("out of memory in {phase} ({reason}); memory.on_oom has nothing left to try")
            }
            Notice::EvalHalved {
                epoch,
                device,
                reason,
                before,
                after,
                training,
            } => tracing::warn!(
                "out of memory in validation at epoch {epoch} on {device} ({reason}); validation's micro-batch {before} -> {after} (train.eval_batch_size); training's stays {} x {}",
                training.micro_batch,
                training.accumulation_steps
            ),
            Notice::EvalSkipped { reason } => tracing::warn!(
                "out of memory in validation at one sample per micro-batch ({reason}); this epoch's validation is skipped, training goes on unchanged"
            ),
            Notice::CheckpointSkipped { why, next } => tracing::warn!(
                "{why}; skipped this checkpoint, training goes on (the next one is due {next})"
            ),
            Notice::Lost(what, e) => match what {
                Lost::StepRecord => tracing::warn!("a step record is lost: {e:#}"),
                Lost::RankPeaks => tracing::warn!("the summary lists no per-rank peaks: {e:#}"),
                Lost::EndSnapshot => tracing::warn!("no allocator snapshot at the run's end: {e:#}"),
            },
        }
    }
}

fn grow_back(g: &GrowBackEvent) {
    match g.micro_batch_of {
        MicroBatchOf::Training => tracing::info!(
            "clean steps since the last OOM: growing the micro-batch back {} -> {}",
            g.micro_batch_before,
            g.micro_batch
        ),
        MicroBatchOf::Validation => tracing::info!(
            "clean validation micro-batches since the last OOM: validation's micro-batch grows back {} -> {}",
            g.micro_batch_before,
            g.micro_batch
        ),
    }
}

/// The preflight's line: what the session's first step used against the cap.
fn preflight_line(e: &PreflightEvent) -> String {
    let head = match (e.headroom_bytes, e.cap_bytes) {
        (Some(h), Some(c)) if h >= 0 => {
            format!("{} headroom under the {} cap", human_bytes(h as u64), human_bytes(c))
        }
        (Some(h), Some(c)) => format!("{} over the {} cap", human_bytes((-h) as u64), human_bytes(c)),
        _ => "no cap set".into(),
    };
    let outside = e.beyond_cap_bytes.map_or(String::new(), |b| {
        format!(
            "; the CUDA context and libraries hold {} more, outside the cap: the card must hold the cap plus that",
            human_bytes(b)
        )
    });
    format!(
        "Preflight: the first step at micro-batch {} used {} ({}); {head}{outside}",
        e.micro_batch,
        human_bytes(e.peak_bytes),
        e.measure
    )
}

/// A language model's validation figures, as its epoch lines and its end line give them.
fn lm_val(r: &EpochResult, t: &EpochTokens) -> Option<String> {
    match (r.val_loss, t.val_perplexity) {
        (Some(l), Some(p)) => Some(format!("val loss {l:.4} ppl {p:.2}")),
        _ => None,
    }
}

/// The run's last line: the last epoch's figures (a language model's perplexities, not a token
/// accuracy) and where the summary is.
pub(super) fn done_line(r: &EpochResult, summary: &std::path::Path) -> String {
    let (train, val) = match &r.language {
        Some(t) => (
            format!(" ppl {:.2}", t.train_perplexity),
            lm_val(r, t).map(|v| format!(", {v}")).unwrap_or_default(),
        ),
        None => (
            String::new(),
            r.val_acc
                .map(|a| format!(", val acc {:.1}%", a * 100.0))
                .unwrap_or_default(),
        ),
    };
    format!(
        "done: {} epochs, final train loss {:.4}{train}{val}; summary in {}",
        r.epoch,
        r.train_loss,
        summary.display()
    )
}

fn epoch_line(r: &EpochResult, m: &MemorySample, epochs: i64) -> String {
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
        (Some(a), None, Some(pa), _) => format!(
            "CPU tensors {} allocated (epoch peak {}){}; RSS {}",
            human_bytes(a),
            human_bytes(pa),
            m.peak_host_bytes
                .map(|h| format!(
                    ", host {} (peak {})",
                    human_bytes(m.host_bytes.unwrap_or(0)),
                    human_bytes(h)
                ))
                .unwrap_or_default(),
            human_bytes(m.rss_bytes)
        ),
        _ => format!(
            "RSS {} (epoch peak {})",
            human_bytes(m.rss_bytes),
            human_bytes(m.peak_rss_bytes)
        ),
    };
    if let Some(t) = &r.language {
        let val = lm_val(r, t).map(|v| format!("  {v}")).unwrap_or_default();
        return format!(
            "epoch {}/{}  train loss {:.4} ppl {:.2}{val}  {}  {:.0} tokens/s  | {mem}",
            r.epoch,
            epochs,
            r.train_loss,
            t.train_perplexity,
            human_duration(r.seconds),
            t.tokens_per_s
        );
    }
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
