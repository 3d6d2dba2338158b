//! OOM recovery as a state machine: it owns the batch shape in force, the clean-step count, the
//! CPU fallback and the counters, and decides every transition. No libtorch in here: the
//! trainer reports what happened (an OOM, a clean step) and carries out what comes back.
use crate::oom::{BatchShape, Decision, OomCounts};
use crate::spec::OomAction;

/// One OOM's outcome: the decision, the shape before it, the actions that did not apply, and
/// whether this was the run's first OOM (which gets the `oom/` report).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub decision: Decision,
    pub before: BatchShape,
    pub skipped: Vec<String>,
    pub first: bool,
}

/// A grow-back the machine decided after enough clean steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrowBack {
    pub before: BatchShape,
    pub after: BatchShape,
}

#[derive(Debug, Clone)]
pub struct Recovery {
    actions: Vec<OomAction>,
    min_batch: i64,
    /// 0: never grow back.
    grow_back_after: i64,
    configured: BatchShape,
    shape: BatchShape,
    clean_steps: i64,
    on_cpu: bool,
    /// Whether the model can recompute (its preset is a sequence of blocks).
    has_blocks: bool,
    /// Whether activation checkpointing is on now.
    recompute: bool,
    reported: bool,
    counts: OomCounts,
}

/// Where a run stands, as checkpoints save it and resumes restore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub shape: BatchShape,
    pub clean_steps: i64,
    pub on_cpu_fallback: bool,
    /// Activation checkpointing is on (configured, or turned on by a "recompute" decision).
    pub recompute: bool,
}

impl Recovery {
    #[allow(clippy::too_many_arguments)]
    /// `on_cpu`: the run is on the CPU (from the start or after a fallback), where "cpu" cannot
    /// help. `reported`: an earlier session already wrote the `oom/` report.
    pub fn new(
        actions: Vec<OomAction>,
        min_batch: i64,
        grow_back_after: i64,
        configured: BatchShape,
        at: Position,
        on_cpu: bool,
        has_blocks: bool,
        reported: bool,
    ) -> Self {
        Recovery {
            actions,
            min_batch,
            grow_back_after,
            configured,
            shape: at.shape,
            clean_steps: at.clean_steps,
            on_cpu: on_cpu || at.on_cpu_fallback,
            has_blocks,
            recompute: at.recompute,
            reported,
            counts: OomCounts::default(),
        }
    }

    pub fn shape(&self) -> BatchShape {
        self.shape
    }

    pub fn configured(&self) -> BatchShape {
        self.configured
    }

    pub fn counts(&self) -> &OomCounts {
        &self.counts
    }

    pub fn clean_steps(&self) -> i64 {
        self.clean_steps
    }

    pub fn recompute(&self) -> bool {
        self.recompute
    }

    /// An OOM happened; the failed work will be retried unless the decision is `Fail`. Walks
    /// `memory.on_oom` in order: the first action that still applies wins.
    pub fn on_oom(&mut self) -> Outcome {
        self.counts.events += 1;
        let first = !self.reported;
        self.reported = true;
        let before = self.shape;
        let mut skipped = vec![];
        let mut decision = Decision::Fail;
        for a in &self.actions {
            match a {
                OomAction::Recompute if !self.has_blocks => {
                    skipped.push("recompute: the model is not a sequence of blocks".into())
                }
                OomAction::Recompute if self.recompute => {
                    skipped.push("recompute: activation checkpointing is already on".into())
                }
                OomAction::Recompute => {
                    decision = Decision::Recompute;
                    break;
                }
                OomAction::Backoff => match before.halved(self.min_batch) {
                    Some(to) => {
                        decision = Decision::Backoff { to };
                        break;
                    }
                    None => skipped.push(format!(
                        "backoff: micro-batch {} cannot be halved without going below memory.min_batch_size {}",
                        before.micro_batch, self.min_batch
                    )),
                },
                OomAction::Cpu if self.on_cpu => skipped.push("cpu: the run is already on the CPU".into()),
                OomAction::Cpu => {
                    decision = Decision::MoveToCpu;
                    break;
                }
                OomAction::Fail => break,
            }
        }
        match decision {
            Decision::Recompute => {
                self.counts.recomputes += 1;
                self.recompute = true;
                self.clean_steps = 0;
            }
            Decision::Backoff { to } => {
                self.counts.backoffs += 1;
                self.shape = to;
                self.clean_steps = 0;
            }
            Decision::MoveToCpu => {
                self.counts.cpu_fallbacks += 1;
                self.on_cpu = true;
                self.clean_steps = 0;
            }
            Decision::Fail => {}
        }
        Outcome {
            decision,
            before,
            skipped,
            first,
        }
    }

    /// An optimizer step finished cleanly. After `grow_back_after` of them below the configured
    /// micro-batch, the micro-batch doubles (at most back to the configured one).
    pub fn on_clean_step(&mut self) -> Option<GrowBack> {
        self.clean_steps += 1;
        let after = self.grow_back_after;
        if after <= 0 || self.shape.micro_batch >= self.configured.micro_batch || self.clean_steps < after {
            return None;
        }
        let before = self.shape;
        let micro = (before.micro_batch * 2).min(self.configured.micro_batch);
        self.shape = BatchShape {
            micro_batch: micro,
            accumulation_steps: (self.configured.effective() + micro - 1) / micro,
        };
        self.clean_steps = 0;
        self.counts.grow_backs += 1;
        Some(GrowBack {
            before,
            after: self.shape,
        })
    }

    /// What a checkpoint saves.
    pub fn position(&self, on_cpu_fallback: bool) -> Position {
        Position {
            shape: self.shape,
            clean_steps: self.clean_steps,
            on_cpu_fallback,
            recompute: self.recompute,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use OomAction::*;

    fn shape(m: i64, a: i64) -> BatchShape {
        BatchShape {
            micro_batch: m,
            accumulation_steps: a,
        }
    }

    fn machine(actions: Vec<OomAction>, min: i64, grow: i64, on_cpu: bool) -> Recovery {
        let s = shape(8, 1);
        let at = Position {
            shape: s,
            clean_steps: 0,
            on_cpu_fallback: false,
            recompute: false,
        };
        Recovery::new(actions, min, grow, s, at, on_cpu, true, false)
    }

    #[test]
    fn backoff_halves_until_the_minimum_then_the_next_action() {
        let mut r = machine(vec![Backoff, Cpu, Fail], 2, 0, false);
        let o = r.on_oom();
        assert!(o.first);
        assert_eq!(o.decision, Decision::Backoff { to: shape(4, 2) });
        assert_eq!(r.on_oom().decision, Decision::Backoff { to: shape(2, 4) });
        let o = r.on_oom();
        assert!(!o.first, "only the first OOM is reported");
        assert_eq!(o.decision, Decision::MoveToCpu);
        assert_eq!(o.skipped.len(), 1);
        // On the CPU now: "cpu" no longer applies, and the list ends in fail.
        let o = r.on_oom();
        assert_eq!(o.decision, Decision::Fail);
        assert_eq!(o.skipped.len(), 2);
        assert_eq!(
            r.counts(),
            &OomCounts {
                events: 4,
                recomputes: 0,
                backoffs: 2,
                cpu_fallbacks: 1,
                grow_backs: 0
            }
        );
        assert_eq!(r.shape(), shape(2, 4), "a failure changes nothing");
    }

    #[test]
    fn a_cpu_run_skips_cpu_with_a_reason_and_an_empty_list_fails() {
        let mut r = machine(vec![Cpu], 1, 0, true);
        let o = r.on_oom();
        assert_eq!(o.decision, Decision::Fail);
        assert_eq!(o.skipped, vec!["cpu: the run is already on the CPU".to_string()]);
        let mut r = machine(vec![], 1, 0, false);
        assert_eq!(r.on_oom().decision, Decision::Fail);
    }

    #[test]
    fn grow_back_after_clean_steps_and_never_past_the_configured_batch() {
        let mut r = machine(vec![Backoff], 1, 2, false);
        r.on_oom();
        r.on_oom();
        assert_eq!(r.shape(), shape(2, 4));
        assert_eq!(r.on_clean_step(), None);
        let g = r.on_clean_step().expect("two clean steps");
        assert_eq!((g.before, g.after), (shape(2, 4), shape(4, 2)));
        assert_eq!(r.clean_steps(), 0);
        r.on_clean_step();
        assert_eq!(r.on_clean_step().map(|g| g.after), Some(shape(8, 1)));
        assert_eq!(r.on_clean_step(), None);
        assert_eq!(r.on_clean_step(), None, "already at the configured micro-batch");
        assert_eq!(r.counts().grow_backs, 2);
    }

    #[test]
    fn an_oom_resets_the_clean_steps() {
        let mut r = machine(vec![Backoff], 1, 3, false);
        r.on_oom();
        r.on_clean_step();
        r.on_clean_step();
        r.on_oom();
        assert_eq!(r.clean_steps(), 0);
        assert_eq!(r.on_clean_step(), None);
    }

    #[test]
    fn resumed_positions_and_earlier_reports_are_honoured() {
        let at = Position {
            shape: shape(2, 4),
            clean_steps: 5,
            on_cpu_fallback: true,
            recompute: false,
        };
        let mut r = Recovery::new(vec![Cpu, Fail], 1, 0, shape(8, 1), at, false, true, true);
        assert_eq!(r.shape(), shape(2, 4));
        let o = r.on_oom();
        assert!(!o.first, "the oom/ report of the earlier session stays");
        assert_eq!(o.decision, Decision::Fail, "a fallen-back run is on the CPU");
    }

    #[test]
    fn recompute_comes_first_once_then_the_next_action() {
        let mut r = machine(vec![Recompute, Backoff, Fail], 1, 0, false);
        let o = r.on_oom();
        assert_eq!(o.decision, Decision::Recompute);
        assert_eq!(o.before, shape(8, 1), "the shape is kept");
        assert!(r.recompute() && r.position(false).recompute);
        let o = r.on_oom();
        assert_eq!(o.decision, Decision::Backoff { to: shape(4, 2) });
        assert_eq!(
            o.skipped,
            vec!["recompute: activation checkpointing is already on".to_string()]
        );
        assert_eq!(r.counts().recomputes, 1);
    }

    #[test]
    fn recompute_does_not_apply_to_a_model_without_blocks() {
        let s = shape(8, 1);
        let at = Position {
            shape: s,
            clean_steps: 0,
            on_cpu_fallback: false,
            recompute: false,
        };
        let mut r = Recovery::new(vec![Recompute, Fail], 1, 0, s, at, true, false, false);
        let o = r.on_oom();
        assert_eq!(o.decision, Decision::Fail);
        assert_eq!(
            o.skipped,
            vec!["recompute: the model is not a sequence of blocks".to_string()]
        );
        assert!(!r.recompute());
    }
}
