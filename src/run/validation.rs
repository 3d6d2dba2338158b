//! Validation: the pass at validation's own micro-batch, with its own OOM answer (only that
//! micro-batch halves, and the pass goes on from the micro-batch that failed) and, data-parallel,
//! the ranks' agreement on it.
use anyhow::{Context, Result};

use super::forward::stage;
use super::oom_answer::{first_line, OomMet};
use super::tally::{Tally, Totals};
use super::terminal::Notice;
use super::trainer::Trainer;
use crate::fault::Phase;
use crate::memory::{self, ClearReason};
use crate::oom::{self, BatchShape, OomKind, StepError};
use crate::parallel::{Local, Outcome};
use crate::records::{Event, GrowBackEvent, MicroBatchOf};

/// Where a validation pass stands: the next sample, the sums of the micro-batches run so far,
/// and whether it has met no OOM (only a clean pass counts towards growing back).
struct EvalPass {
    next: usize,
    tally: Tally,
    clean: bool,
}

impl Trainer {
    /// The validation pass, at validation's own micro-batch. An OOM here halves only that
    /// micro-batch and the pass goes on from the micro-batch that failed (a validation
    /// micro-batch changes nothing but the sums, which it adds only once it has run); training's
    /// shape, accumulation and levers stay as they are. At one sample the epoch's validation is
    /// skipped with a warning.
    pub(super) fn validate(&mut self) -> Result<Option<(f64, f64)>> {
        self.model.opt.settle()?;
        let n = self.data.val.len();
        if n == 0 {
            return Ok(None);
        }
        self.eval_grow_back()?;
        let mut pass = EvalPass {
            next: 0,
            // A language model's figures are per counted token, counted where the loss is.
            tally: match self.model.net.output_head() {
                Some(_) => Tally::counting(self.device()),
                None => Tally::new(self.device(), 0.0, 0),
            },
            clean: true,
        };
        loop {
            let attempt = self.eval_from(&mut pass);
            let Some((kind, message)) = self.agree_on_eval(attempt)? else {
                break;
            };
            pass.clean = false;
            if !self.eval_oom(kind, message)? {
                return Ok(None);
            }
        }
        let b = self.recovery.eval_micro_batch();
        self.recovery.on_eval_pass(pass.clean, (n + b - 1) / b);
        let r = pass.tally.read().context("reading the validation sums")?;
        // A language model's figures are per counted target token.
        let n = match self.model.net.output_head() {
            Some(_) => r.epoch_count.max(1.0),
            None => n as f64,
        };
        Ok(Some((r.epoch_loss_sum / n, r.epoch_correct as f64 / n)))
    }

    /// Validation from `pass.next` to the end at the micro-batch in force. Summed on the device
    /// in f64, in order (what adding each value read on the host gave), and read once at the
    /// end of the pass.
    fn eval_from(&self, pass: &mut EvalPass) -> Result<(), StepError> {
        let n = self.data.val.len();
        let b = self.recovery.eval_micro_batch() as usize;
        let place = self.place();
        let idx: Vec<i64> = (pass.next as i64..n).collect();
        let chunks: Vec<&[i64]> = idx.chunks(b).collect();
        oom::guarded_counting(
            || memory::oom_count(place),
            || {
                tch::no_grad(|| {
                    let _validation = stage(Phase::Validation, self.state.global_step);
                    let f = &self.pipeline.forward;
                    let mut ahead = chunks.first().map(|c| f.inputs(&self.data.val, c, 0));
                    for (i, chunk) in chunks.iter().enumerate() {
                        let batch = ahead.take().expect("one placed batch per micro-batch");
                        ahead = chunks.get(i + 1).map(|c| f.inputs(&self.data.val, c, 0));
                        let (l, c, k) =
                            f.forward_loss(self.model.net.as_ref(), self.model.stream.as_ref(), &batch, false);
                        // Adding allocates nothing, so a micro-batch is either in the sums or not.
                        pass.tally.add(Totals::new(l, c, k));
                        pass.next += chunk.len();
                    }
                })
            },
        )
    }

    /// Some: validation ran out of memory, here or (data-parallel, agreed) on another rank:
    /// every rank halves together, as they do for training steps, so their validation
    /// micro-batches stay the same.
    fn agree_on_eval(&mut self, attempt: Result<(), StepError>) -> Result<Option<(OomKind, String)>> {
        let (own, broken) = match attempt {
            Ok(()) => (None, None),
            Err(StepError::Oom { kind, message, .. }) => (Some((kind, message)), None),
            Err(StepError::Other(m) | StepError::PeerLost(m) | StepError::OomInCollective(m)) => (None, Some(m)),
        };
        let Some(d) = self.execution.group() else {
            return match broken {
                Some(m) => Err(anyhow::anyhow!("validation failed: {m}")),
                None => Ok(own),
            };
        };
        let local = Local {
            outcome: match (&own, &broken) {
                (_, Some(_)) => Outcome::Broken,
                (Some(_), _) => Outcome::OutOfMemory,
                _ => Outcome::Done,
            },
            stop: false,
            loss_sum: 0.0,
            correct: 0,
        };
        let agreed = match d.exchange(&local) {
            Ok(a) => a,
            Err(e) => {
                // Every step of the epoch is done: what is saved resumes at its end.
                let note = self.save_after_failed_collective(&format!("{e:#}"));
                return Err(anyhow::anyhow!("validation: {e:#}{note}"));
            }
        };
        if let Some(&first) = agreed.broken.first() {
            return Err(anyhow::anyhow!(
                "validation failed: {}",
                broken.unwrap_or_else(|| format!("rank {first} failed (its own message says why)"))
            ));
        }
        Ok(agreed.failed.first().map(|&first| {
            own.unwrap_or_else(|| (OomKind::Peer, format!("rank {first} ran out of memory in validation")))
        }))
    }

    /// Answers a validation OOM. Ok(true): go on at the halved micro-batch; Ok(false): already
    /// at one sample, so this epoch's validation is skipped.
    fn eval_oom(&mut self, kind: OomKind, message: String) -> Result<bool> {
        let o = self.recovery.on_eval_oom();
        let report = o.first.then(|| self.oom_report());
        self.stager.failed_attempt(self.place());
        self.clear_cache(ClearReason::Oom)?;
        let met = OomMet {
            phase: "validation".into(),
            kind,
            error: message.clone(),
            shape: BatchShape {
                micro_batch: o.before,
                accumulation_steps: 1,
            },
            decision: o.decision(),
            skipped: vec![],
            report,
        };
        self.emit(Event::Oom(self.oom_event(self.state.epoch + 1, met)))?;
        let reason = first_line(&message).to_owned();
        match o.after {
            Some(after) => {
                self.say(Notice::EvalHalved {
                    epoch: self.state.epoch + 1,
                    device: self.device_name(),
                    reason,
                    before: o.before,
                    after,
                    training: self.shape(),
                });
                Ok(true)
            }
            None => {
                self.say(Notice::EvalSkipped { reason });
                Ok(false)
            }
        }
    }

    /// Before a pass: validation's micro-batch grows back after enough clean ones.
    fn eval_grow_back(&mut self) -> Result<()> {
        let Some(g) = self.recovery.eval_grow_back() else {
            return Ok(());
        };
        self.emit(Event::GrowBack(GrowBackEvent {
            step: self.state.global_step,
            micro_batch_before: g.before.micro_batch,
            micro_batch: g.after.micro_batch,
            micro_batch_of: MicroBatchOf::Validation,
        }))
    }
}
