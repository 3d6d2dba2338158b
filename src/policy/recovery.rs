//! OOM recovery as a state machine: the only owner of the run's position (the batch shape in
//! force, the clean-step count and the levers engaged, and validation's own micro-batch) and of
//! the counters. It walks
//! `memory.on_oom`'s levers and decides every transition; the levers say what applies. No
//! libtorch in here: the trainer reports what happened (an OOM, a clean step) and carries out
//! what comes back on the parts.
use super::levers::{answering, lever, Described, Engaged, Lever, Position, Situation, LEVERS};
use crate::oom::{BatchShape, Decision, OomCounts};
use crate::spec::OomAction;

/// One OOM's outcome: the lever engaged (None: nothing left, the run fails), the position
/// before and after, the levers that did not apply and why, and whether this was the run's
/// first OOM (which gets the `oom/` report).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub engaged: Option<&'static str>,
    pub before: Position,
    pub after: Position,
    pub skipped: Vec<String>,
    pub first: bool,
}

impl Outcome {
    pub fn lever(&self) -> Option<&'static dyn Lever> {
        self.engaged.and_then(lever)
    }

    /// As the OOM record states it.
    pub fn decision(&self) -> Decision {
        match self.lever() {
            None => Decision::fail(),
            Some(l) => Decision {
                action: l.action().into(),
                to: (self.after.shape != self.before.shape).then_some(self.after.shape),
            },
        }
    }
}

/// A grow-back the machine decided after enough clean steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrowBack {
    pub before: BatchShape,
    pub after: BatchShape,
}

/// Validation's own micro-batch. An OOM in validation halves it and nothing else: training's
/// shape, accumulation and levers stay as they are (a validation pass keeps no activations, so
/// what fits it says nothing about training).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalPosition {
    pub micro_batch: i64,
    /// Validation micro-batches run cleanly since the last validation OOM, counted per clean
    /// pass (so data-parallel ranks, which agree on every OOM, count alike).
    pub clean: i64,
}

/// A validation OOM's outcome: the micro-batch before and after (None: already 1, so this
/// epoch's validation is skipped), and whether this was the run's first OOM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalOutcome {
    pub before: i64,
    pub after: Option<i64>,
    pub first: bool,
}

impl EvalOutcome {
    /// As the OOM record states it.
    pub fn decision(&self) -> Decision {
        match self.after {
            Some(m) => Decision {
                action: Decision::EVAL_BACKOFF.into(),
                to: Some(BatchShape {
                    micro_batch: m,
                    accumulation_steps: 1,
                }),
            },
            None => Decision {
                action: Decision::SKIP_VALIDATION.into(),
                to: None,
            },
        }
    }
}

/// What ran out of memory, as the trainer measured it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Work that grows with the micro-batch (the activations) may have tipped it.
    Step,
    /// The session's first optimizer step held `held` bytes (parameters, gradients, optimizer
    /// state and the update's workspace), more than the `cap`: no micro-batch makes room.
    StaticBill { held: u64, cap: u64 },
}

impl Cause {
    /// An OOM in the first optimizer step is the static bill's when what the step held, with the
    /// update's largest workspace (one parameter's bytes), is over the run's cap. An allocation
    /// refused under a lower cap than the run's (a fault's squeeze) is not: the bill fits.
    pub fn of_first_update(held: u64, workspace: u64, cap: Option<u64>) -> Cause {
        match cap {
            Some(cap) if held + workspace > cap => Cause::StaticBill {
                held: held + workspace,
                cap,
            },
            _ => Cause::Step,
        }
    }
}

/// What recovery is told once, at the start of a run.
#[derive(Debug, Clone)]
pub struct Policy {
    /// `memory.on_oom`, in order.
    pub on_oom: Vec<OomAction>,
    /// 0: never grow back.
    pub grow_back_after: i64,
    /// The spec's batch shape; its product never changes.
    pub configured: BatchShape,
    /// Validation's micro-batch as the spec sets it (`train.eval_batch_size`, else the
    /// training micro-batch).
    pub eval_configured: i64,
    /// An earlier session already wrote the `oom/` report.
    pub reported: bool,
    /// Where the run starts and what the levers may look at; its position moves as levers are
    /// engaged and released.
    pub situation: Situation,
}

#[derive(Debug, Clone)]
pub struct Recovery {
    policy: Policy,
    eval: EvalPosition,
    counts: OomCounts,
    /// The latest OOM's cause (what the advice answers).
    cause: Cause,
    /// After an OOM of the static bill: the setting that moves its first term off the device,
    /// as the run stood when it ran out.
    to_fit: Option<String>,
}

impl Recovery {
    /// `eval`: a resumed run's validation position; None starts at the configured one. A saved
    /// micro-batch above the configured one (the spec lowered it) gives way to the spec.
    pub fn new(policy: Policy, eval: Option<EvalPosition>) -> Self {
        let configured = policy.eval_configured.max(1);
        let eval = match eval {
            Some(e) if e.micro_batch >= 1 && e.micro_batch <= configured => e,
            _ => EvalPosition {
                micro_batch: configured,
                clean: 0,
            },
        };
        Recovery {
            policy,
            eval,
            counts: OomCounts::new(LEVERS.iter().map(|l| l.counted_as())),
            cause: Cause::Step,
            to_fit: None,
        }
    }

    /// Validation's micro-batch in force.
    pub fn eval_micro_batch(&self) -> i64 {
        self.eval.micro_batch
    }

    /// What a checkpoint saves of validation.
    pub fn eval_position(&self) -> EvalPosition {
        self.eval
    }

    /// Validation ran out of memory (on this rank or, agreed, on another): its micro-batch
    /// halves, down to 1; at 1 the pass is skipped. Training's position does not move.
    pub fn on_eval_oom(&mut self) -> EvalOutcome {
        self.counts.events += 1;
        let first = !self.policy.reported;
        self.policy.reported = true;
        let before = self.eval.micro_batch;
        self.eval.clean = 0;
        let after = (before > 1).then_some(before / 2);
        if let Some(m) = after {
            self.eval.micro_batch = m;
            self.counts.eval_backoffs += 1;
        }
        EvalOutcome { before, after, first }
    }

    /// A validation pass ended. `clean`: no rank ran out of memory in it; its micro-batches
    /// (at the size in force) count towards growing back.
    pub fn on_eval_pass(&mut self, clean: bool, micro_batches: i64) {
        self.eval.clean = if clean { self.eval.clean + micro_batches } else { 0 };
    }

    /// Before a validation pass: after `memory.grow_back_after` clean validation micro-batches
    /// the micro-batch doubles, at most back to the configured one (as training's does).
    pub fn eval_grow_back(&mut self) -> Option<GrowBack> {
        let after = self.policy.grow_back_after;
        let configured = self.policy.eval_configured.max(1);
        if after <= 0 || self.eval.clean < after || self.eval.micro_batch >= configured {
            return None;
        }
        let before = self.eval.micro_batch;
        self.eval = EvalPosition {
            micro_batch: (before * 2).min(configured),
            clean: 0,
        };
        self.counts.eval_grow_backs += 1;
        let shape = |m| BatchShape {
            micro_batch: m,
            accumulation_steps: 1,
        };
        Some(GrowBack {
            before: shape(before),
            after: shape(self.eval.micro_batch),
        })
    }

    pub fn shape(&self) -> BatchShape {
        self.policy.situation.at.shape
    }

    pub fn configured(&self) -> BatchShape {
        self.policy.configured
    }

    pub fn counts(&self) -> &OomCounts {
        &self.counts
    }

    pub fn clean_steps(&self) -> i64 {
        self.policy.situation.at.clean_steps
    }

    /// What a checkpoint saves.
    pub fn position(&self) -> Position {
        self.policy.situation.at
    }

    pub fn engaged(&self) -> Engaged {
        self.policy.situation.at.engaged
    }

    fn situation(&self) -> Situation {
        self.policy.situation
    }

    /// Engages a lever the spec asks for from the start (no OOM, nothing counted). Err: the
    /// reason it does not apply; the run goes on without it.
    pub fn engage_configured(&mut self, l: &dyn Lever) -> Result<(), String> {
        if self.policy.situation.at.engaged.contains(l.name()) {
            return Ok(());
        }
        l.applies(&self.situation())?;
        self.policy.situation.at = Position {
            clean_steps: self.policy.situation.at.clean_steps,
            ..l.engaged(&self.situation())
        };
        Ok(())
    }

    /// An OOM happened; the failed work will be retried unless nothing was engaged. Walks
    /// `memory.on_oom` in order: the first lever that applies wins.
    pub fn on_oom(&mut self) -> Outcome {
        self.on_oom_from(Cause::Step)
    }

    /// `on_oom` for an OOM of known cause: one of the static bill skips the levers that cannot
    /// shrink it (a smaller micro-batch, recomputation, activations on the host).
    pub fn on_oom_from(&mut self, cause: Cause) -> Outcome {
        self.cause = cause;
        self.to_fit = match cause {
            Cause::StaticBill { .. } => self.placement_to_fit(),
            Cause::Step => None,
        };
        self.counts.events += 1;
        let first = !self.policy.reported;
        self.policy.reported = true;
        let before = self.policy.situation.at;
        let mut skipped = vec![];
        let mut engaged = None;
        'actions: for a in &self.policy.on_oom {
            let levers = answering(a.name());
            if levers.is_empty() {
                break;
            }
            for l in levers {
                if !helps(l, cause) {
                    skipped.push(format!(
                        "{}: it does not shrink what the optimizer step holds (parameters, gradients and optimizer state)",
                        l.name()
                    ));
                    continue;
                }
                match l.applies(&self.situation()) {
                    Ok(()) => {
                        engaged = Some(l);
                        break 'actions;
                    }
                    Err(why) => skipped.push(format!("{}: {why}", l.name())),
                }
            }
        }
        if let Some(l) = engaged {
            self.policy.situation.at = l.engaged(&self.situation());
            *self.counts.engaged.entry(l.counted_as().to_owned()).or_default() += 1;
        }
        Outcome {
            engaged: engaged.map(|l| l.name()),
            before,
            after: self.policy.situation.at,
            skipped,
            first,
        }
    }

    /// What the message of a run that ran out of options suggests before `--resume`: adding
    /// `"backoff"` when the policy lacks it; otherwise lowering `memory.min_batch_size` where
    /// that lets backoff go further, and the other actions the policy does not list that have a
    /// lever that would apply now (no recomputation for a model that is not a chain of blocks).
    pub fn advice(&self) -> String {
        if let Cause::StaticBill { .. } = self.cause {
            let mut ways: Vec<String> = self.to_fit.iter().map(|k| format!("after setting {k}")).collect();
            ways.push("with a larger memory.limit or a smaller model".into());
            return ways.join(", or ");
        }
        let on_oom = &self.policy.on_oom;
        if !on_oom.contains(&OomAction::Backoff) {
            return "after adding \"backoff\" to memory.on_oom, or with a smaller train.batch_size".into();
        }
        let mut ways = vec![];
        if self.policy.situation.min_batch > 1 {
            ways.push(format!(
                "after lowering memory.min_batch_size (now {})",
                self.policy.situation.min_batch
            ));
        }
        let situation = self.situation();
        let missing: Vec<String> = [OomAction::Offload, OomAction::Recompute]
            .into_iter()
            .filter(|a| !on_oom.contains(a))
            .filter(|a| answering(a.name()).iter().any(|l| l.applies(&situation).is_ok()))
            .map(|a| format!("\"{}\"", a.name()))
            .collect();
        if !missing.is_empty() {
            ways.push(format!("after adding {} to memory.on_oom", missing.join(" or ")));
        }
        ways.push("with a larger memory.limit or a smaller model".into());
        ways.join(", or ")
    }

    /// `check`'s cannot-fit warning, after an OOM of the static bill, with the setting that
    /// moves the first term of it off the device.
    pub fn cannot_fit(&self) -> Option<String> {
        let Cause::StaticBill { held, cap } = self.cause else {
            return None;
        };
        let warning = crate::estimate::cannot_fit(held, cap);
        Some(match &self.to_fit {
            Some(k) => format!("{warning} To fit, set {k}."),
            None => warning,
        })
    }

    /// The spec setting of the first lever that moves part of the static bill to the host and
    /// applies now (`memory.optimizer_state = "host"` before the gradients).
    fn placement_to_fit(&self) -> Option<String> {
        let s = self.situation();
        LEVERS
            .iter()
            .filter(|l| l.about().moves_static_bill && l.applies(&s).is_ok())
            .find_map(|l| l.about().setting)
            .map(|k| format!("{k} = \"host\""))
    }

    /// An optimizer step finished cleanly. Levers that let go after enough clean steps do
    /// (backoff: the micro-batch doubles, at most back to the configured one).
    pub fn on_clean_step(&mut self) -> Option<GrowBack> {
        self.policy.situation.at.clean_steps += 1;
        let before = self.policy.situation.at.shape;
        let released = LEVERS.iter().find_map(|l| {
            l.released(
                &self.policy.situation.at,
                self.policy.configured,
                self.policy.grow_back_after,
            )
        })?;
        self.policy.situation.at = released;
        self.counts.grow_backs += 1;
        Some(GrowBack {
            before,
            after: self.policy.situation.at.shape,
        })
    }
}

/// Whether engaging `l` can answer an OOM of this cause.
fn helps(l: &dyn Lever, cause: Cause) -> bool {
    match cause {
        Cause::Step => true,
        Cause::StaticBill { .. } => l.about().moves_static_bill,
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

    fn fresh(s: BatchShape) -> Position {
        Position {
            shape: s,
            clean_steps: 0,
            engaged: Engaged::default(),
        }
    }

    fn policy(on_oom: Vec<OomAction>, min: i64, grow: i64, on_cpu: bool) -> Policy {
        Policy {
            on_oom,
            grow_back_after: grow,
            configured: shape(8, 1),
            eval_configured: 8,
            reported: false,
            situation: Situation {
                at: fresh(shape(8, 1)),
                min_batch: min,
                planned_on_cpu: on_cpu,
                has_blocks: true,
                blockwise: true,
                data_parallel: false,
                state_slots: 2,
                torchscript: false,
            },
        }
    }

    fn machine(on_oom: Vec<OomAction>, min: i64, grow: i64, on_cpu: bool) -> Recovery {
        Recovery::new(policy(on_oom, min, grow, on_cpu), None)
    }

    fn backoff_to(s: BatchShape) -> Decision {
        Decision {
            action: "backoff".into(),
            to: Some(s),
        }
    }

    fn counts(events: u64, recomputes: u64, backoffs: u64, cpu: u64, grow_backs: u64) -> OomCounts {
        // Every lever has its count; the placements stay at 0 in these tests.
        let mut c = OomCounts::new(LEVERS.iter().map(|l| l.counted_as()));
        c.events = events;
        c.grow_backs = grow_backs;
        c.engaged.insert("recomputes".into(), recomputes);
        c.engaged.insert("backoffs".into(), backoffs);
        c.engaged.insert("cpu_fallbacks".into(), cpu);
        c
    }

    #[test]
    fn backoff_halves_until_the_minimum_then_the_next_action() {
        let mut r = machine(vec![Backoff, Cpu, Fail], 2, 0, false);
        let o = r.on_oom();
        assert!(o.first);
        assert_eq!(o.decision(), backoff_to(shape(4, 2)));
        assert_eq!(r.on_oom().decision(), backoff_to(shape(2, 4)));
        let o = r.on_oom();
        assert!(!o.first, "only the first OOM is reported");
        assert_eq!(o.decision().action, "move_to_cpu");
        assert_eq!(o.skipped.len(), 1);
        // On the CPU now: "cpu" no longer applies, and the list ends in fail.
        let o = r.on_oom();
        assert!(o.decision().is_fail());
        assert_eq!(o.skipped.len(), 2);
        assert_eq!(r.counts(), &counts(4, 0, 2, 1, 0));
        assert_eq!(r.shape(), shape(2, 4), "a failure changes nothing");
        let json = serde_json::to_value(r.counts()).unwrap();
        assert_eq!(json["backoffs"], 2, "counts keep their summary.json names: {json}");
        assert_eq!(json["cpu_fallbacks"], 1);
        assert_eq!(json["recomputes"], 0);
    }

    #[test]
    fn a_cpu_run_skips_cpu_with_a_reason_and_an_empty_list_fails() {
        let mut r = machine(vec![Cpu], 1, 0, true);
        let o = r.on_oom();
        assert!(o.decision().is_fail());
        assert_eq!(o.skipped, vec!["cpu: the run is already on the CPU".to_string()]);
        let mut r = machine(vec![], 1, 0, false);
        assert!(r.on_oom().decision().is_fail());
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
            engaged: Engaged::default().with("cpu"),
        };
        let mut p = policy(vec![Cpu, Fail], 1, 0, false);
        p.reported = true;
        p.situation.at = at;
        let mut r = Recovery::new(p, None);
        assert_eq!(r.shape(), shape(2, 4));
        let o = r.on_oom();
        assert!(!o.first, "the oom/ report of the earlier session stays");
        assert!(o.decision().is_fail(), "a fallen-back run is on the CPU");
    }

    #[test]
    fn recompute_comes_first_once_then_the_next_action() {
        let mut r = machine(vec![Recompute, Backoff, Fail], 1, 0, false);
        let o = r.on_oom();
        assert_eq!(
            o.decision(),
            Decision {
                action: "recompute".into(),
                to: None
            }
        );
        assert_eq!(o.before.shape, shape(8, 1), "the shape is kept");
        assert!(r.engaged().contains("recompute") && r.position().engaged.contains("recompute"));
        let o = r.on_oom();
        assert_eq!(o.decision(), backoff_to(shape(4, 2)));
        assert_eq!(
            o.skipped,
            vec!["recompute: activation checkpointing is already on".to_string()]
        );
        assert_eq!(r.counts().of("recomputes"), 1);
    }

    #[test]
    fn recompute_does_not_apply_to_a_model_without_blocks() {
        let mut p = policy(vec![Recompute, Fail], 1, 0, true);
        p.situation.has_blocks = false;
        let mut r = Recovery::new(p, None);
        let o = r.on_oom();
        assert!(o.decision().is_fail());
        assert_eq!(
            o.skipped,
            vec!["recompute: the model is not a sequence of blocks".to_string()]
        );
        assert!(!r.engaged().contains("recompute"));
        assert_eq!(
            r.engage_configured(&crate::policy::levers::Recompute),
            Err("the model is not a sequence of blocks".into()),
            "the spec's request gets the same reason"
        );
    }

    #[test]
    fn the_spec_engages_a_lever_without_counting_an_oom() {
        let mut r = machine(vec![Recompute, Fail], 1, 0, false);
        r.engage_configured(&crate::policy::levers::Recompute).unwrap();
        assert!(r.engaged().contains("recompute"));
        assert_eq!(r.counts(), &counts(0, 0, 0, 0, 0));
        let o = r.on_oom();
        assert!(
            o.decision().is_fail(),
            "already engaged: the list falls through to fail"
        );
    }

    #[test]
    fn offload_moves_one_term_per_oom_in_order_then_gives_way() {
        let mut r = machine(vec![Offload, Backoff, Fail], 4, 0, true);
        let names: Vec<Option<&str>> = (0..5).map(|_| r.on_oom().engaged).collect();
        assert_eq!(
            names,
            [
                Some("host_optimizer_state"),
                Some("host_gradients"),
                Some("host_activations"),
                Some("host_parameters"),
                Some("backoff")
            ]
        );
        let e = r.engaged();
        assert!(
            e.contains("recompute"),
            "activations on the host come with recomputation: {e:?}"
        );
        assert_eq!(r.shape(), shape(4, 2));
        let last = r.on_oom();
        assert_eq!(last.engaged, None);
        assert!(
            last.skipped
                .iter()
                .any(|s| s == "host_gradients: already on the host (the gradients)"),
            "{:?}",
            last.skipped
        );
        assert_eq!(r.counts().engaged["state_offloads"], 1);
    }

    #[test]
    fn a_validation_oom_halves_only_validations_micro_batch_and_it_grows_back() {
        let mut r = machine(vec![Backoff, Cpu, Fail], 1, 4, false);
        let o = r.on_eval_oom();
        assert!(o.first);
        assert_eq!((o.before, o.after), (8, Some(4)));
        assert_eq!(
            o.decision(),
            Decision {
                action: "eval_backoff".into(),
                to: Some(shape(4, 1))
            }
        );
        assert_eq!(r.shape(), shape(8, 1), "training's shape does not move");
        assert!(r.engaged().names().is_empty(), "no lever engaged");
        assert_eq!(r.eval_micro_batch(), 4);
        // A pass with an OOM in it counts nothing; clean passes count their micro-batches.
        r.on_eval_pass(false, 3);
        assert_eq!(r.eval_grow_back(), None);
        r.on_eval_pass(true, 3);
        assert_eq!(r.eval_grow_back(), None, "3 clean micro-batches of the 4 asked for");
        r.on_eval_pass(true, 3);
        let g = r.eval_grow_back().expect("6 clean micro-batches");
        assert_eq!((g.before.micro_batch, g.after.micro_batch), (4, 8));
        r.on_eval_pass(true, 100);
        assert_eq!(r.eval_grow_back(), None, "never past the configured micro-batch");
        let c = r.counts();
        assert_eq!(
            (c.events, c.eval_backoffs, c.eval_grow_backs, c.grow_backs),
            (1, 1, 1, 0)
        );
        assert_eq!(c.of("backoffs"), 0, "training's backoffs are not counted");
    }

    #[test]
    fn validation_at_one_sample_skips_and_a_saved_position_is_kept() {
        let at = EvalPosition {
            micro_batch: 1,
            clean: 2,
        };
        let mut r = Recovery::new(policy(vec![Fail], 1, 0, true), Some(at));
        assert_eq!(r.eval_position(), at, "a resumed run's validation position is kept");
        let o = r.on_eval_oom();
        assert_eq!(o.after, None);
        assert_eq!(o.decision().action, "skip_validation");
        assert_eq!(r.eval_micro_batch(), 1);
        assert_eq!(r.counts().eval_backoffs, 0);
        // A spec that lowered eval_batch_size below the saved one wins.
        let saved = EvalPosition {
            micro_batch: 32,
            clean: 0,
        };
        let r = Recovery::new(policy(vec![Fail], 1, 0, true), Some(saved));
        assert_eq!(r.eval_micro_batch(), 8);
    }

    #[test]
    fn an_oom_of_the_static_bill_skips_backoff_for_the_state_on_the_host() {
        let cause = Cause::of_first_update(130 << 20, 32 << 20, Some(135 << 20));
        assert_eq!(
            cause,
            Cause::StaticBill {
                held: 162 << 20,
                cap: 135 << 20
            }
        );
        assert_eq!(
            Cause::of_first_update(2 << 20, 1 << 20, Some(1 << 30)),
            Cause::Step,
            "a squeezed cap under a bill that fits the run's is no static OOM"
        );
        assert_eq!(Cause::of_first_update(2 << 20, 1 << 20, None), Cause::Step);
        let mut r = machine(vec![Backoff, Offload, Fail], 1, 0, true);
        let o = r.on_oom_from(cause);
        assert_eq!(o.engaged, Some("host_optimizer_state"));
        assert_eq!(o.after.shape, shape(8, 1), "the micro-batch is kept");
        assert!(
            o.skipped[0].starts_with("backoff: it does not shrink"),
            "{:?}",
            o.skipped
        );
        let w = r.cannot_fit().unwrap();
        assert!(
            w.ends_with("this spec cannot fit. To fit, set memory.optimizer_state = \"host\"."),
            "as the run stood when it ran out: {w}"
        );
        // Without a lever for it in the policy the run stops at once, and says what fits.
        let mut r = machine(vec![Backoff, Fail], 1, 0, true);
        assert!(r.on_oom_from(cause).decision().is_fail());
        assert_eq!(r.shape(), shape(8, 1));
        assert_eq!(
            r.advice(),
            "after setting memory.optimizer_state = \"host\", or with a larger memory.limit or a smaller model"
        );
        assert!(r
            .cannot_fit()
            .unwrap()
            .ends_with("To fit, set memory.optimizer_state = \"host\"."));
        // A step OOM afterwards gets the usual advice again.
        r.on_oom();
        assert!(r.cannot_fit().is_none());
        assert!(!r.advice().contains("memory.optimizer_state"));
    }

    #[test]
    fn the_advice_never_suggests_what_the_policy_already_tries() {
        let r = machine(vec![Fail], 1, 0, false);
        assert_eq!(
            r.advice(),
            "after adding \"backoff\" to memory.on_oom, or with a smaller train.batch_size"
        );
        let r = machine(vec![Backoff, Fail], 4, 0, false);
        let a = r.advice();
        assert!(!a.contains("\"backoff\""), "{a}");
        assert!(a.contains("lowering memory.min_batch_size (now 4)"), "{a}");
        assert!(a.contains("adding \"offload\" or \"recompute\""), "{a}");
        let r = machine(vec![Recompute, Offload, Backoff, Fail], 1, 0, false);
        assert_eq!(r.advice(), "with a larger memory.limit or a smaller model");
        // An MLP (no blocks) under SGD without momentum's state slots: recomputation cannot
        // apply, and of offload only the gradients can move.
        let mut mlp = policy(vec![Backoff, Fail], 1, 0, false);
        mlp.situation.has_blocks = false;
        mlp.situation.blockwise = false;
        let a = Recovery::new(mlp.clone(), None).advice();
        assert!(a.contains("adding \"offload\" to memory.on_oom"), "{a}");
        assert!(!a.contains("recompute"), "{a}");
        let mut nothing_moves = mlp;
        nothing_moves.situation.data_parallel = true;
        nothing_moves.situation.state_slots = 0;
        let a = Recovery::new(nothing_moves, None).advice();
        assert_eq!(a, "with a larger memory.limit or a smaller model");
    }
}
