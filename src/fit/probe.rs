//! One probe: a real run of the job at one setting and micro-batch, in a child process under
//! the budget, and what its records say it measured.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::Value;

use super::graph;
use super::search::Measured;
use super::setting::{Budget, Graph, Probe, Setting};
use crate::cli::FitArgs;
use crate::exit::UsageError;
use crate::human::{human_bytes, human_duration};
use crate::records::{self, RunRecords, StepEvent};
use crate::spec;
use crate::spec::Spec;

pub(super) enum ProbeError {
    /// Checkpointing was asked for but the preset has no blocks to checkpoint.
    NotApplicable,
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for ProbeError {
    fn from(e: anyhow::Error) -> Self {
        ProbeError::Failed(e)
    }
}

/// A scratch directory for the probes' specs and run directories, removed at the end.
pub(super) struct Scratch(pub(super) PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(super) struct Prober<'a> {
    pub(super) args: &'a FitArgs,
    pub(super) exe: PathBuf,
    pub(super) scratch: Scratch,
    pub(super) budget: &'a Budget,
    pub(super) cuda: bool,
    /// The spec's effective batch: micro-batches below it are probed accumulating.
    pub(super) effective: i64,
    pub(super) count: usize,
    pub(super) probes: Vec<Probe>,
    pub(super) quiet: bool,
}

impl Prober<'_> {
    pub(super) fn accumulation_at(&self, micro_batch: i64) -> i64 {
        if micro_batch < self.effective {
            2
        } else {
            1
        }
    }

    /// What a probe's spec changes in the user's: the setting, the micro-batch, the cap, and
    /// quiet records of every step.
    pub(super) fn edits(&self, setting: Setting, micro_batch: i64) -> Vec<(&'static str, Option<toml_edit::Value>)> {
        // JSON scalars and string arrays are written the same in TOML.
        let v = |x: Value| Some(spec::toml_value(&x.to_string()));
        let mut edits = vec![
            ("job.name", v("fit-probe".into())),
            ("train.batch_size", v(micro_batch.into())),
            // Below the effective batch the run accumulates, holding one micro-batch's gradients
            // while the next runs forward: two micro-batches a step measure that peak.
            ("train.accumulation_steps", v(self.accumulation_at(micro_batch).into())),
            ("train.precision", v(setting.precision.name().into())),
            (
                "train.activation_checkpointing",
                v(setting.activation_checkpointing.into()),
            ),
            // Always written: the probe runs what was chosen, and a user's "on" beside a setting
            // that cannot capture (recomputation, say) would refuse the probe's spec.
            ("train.cuda_graph", v(setting.cuda_graph.name().into())),
            ("memory.on_oom", v(serde_json::json!(["fail"]))),
            ("memory.min_batch_size", v(1.into())),
            ("memory.limit", v(self.budget.usable_bytes.into())),
            ("memory.fraction", None),
            ("log.every_steps", v(1.into())),
            ("log.progress", v("off".into())),
            ("log.tensorboard", v(false.into())),
        ];
        edits.extend(setting.placement.keys().map(|(key, home)| (key, v(home.name().into()))));
        edits
    }

    pub(super) fn probe(&mut self, setting: Setting, micro_batch: i64) -> Result<Measured, ProbeError> {
        self.count += 1;
        let dir = self.scratch.0.join(format!("probe-{}", self.count));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let edits = self.edits(setting, micro_batch);
        let text = spec::edited_text(&self.args.spec.file, &self.args.spec.set, &edits).map_err(anyhow::Error::from)?;
        let spec_path = dir.join("spec.toml");
        std::fs::write(&spec_path, text).with_context(|| format!("writing {}", spec_path.display()))?;
        let run_dir = dir.join("run");
        let t = Instant::now();
        let out = Command::new(&self.exe)
            .arg("--quiet")
            .arg("run")
            .arg(&spec_path)
            .arg("--out")
            .arg(&run_dir)
            .arg("--max-steps")
            .arg(graph::probe_steps(self.args.steps, setting.cuda_graph).to_string())
            .output()
            .with_context(|| format!("starting {}", self.exe.display()))?;
        let seconds = t.elapsed().as_secs_f64();
        let (measured, oom) = match out.status.code() {
            Some(crate::exit::OK) => self.completed(setting, micro_batch, &run_dir)?,
            Some(crate::exit::OOM) => (Measured::out_of_memory(micro_batch), where_oom(&run_dir)),
            // The CPU cap counts tensor bytes only; past it, the kernel's OOM killer may be what
            // stops a probe.
            None if killed_by(&out.status) == Some(libc::SIGKILL) => (
                Measured::out_of_memory(micro_batch),
                Some("killed by SIGKILL: the kernel's OOM killer, most likely".into()),
            ),
            code => {
                return Err(ProbeError::Failed(probe_failure(
                    micro_batch,
                    &setting,
                    code,
                    &out.stderr,
                )))
            }
        };
        let _ = std::fs::remove_dir_all(&dir);
        let probe = Probe {
            setting,
            measured: measured.clone(),
            seconds,
            oom,
        };
        if !self.quiet {
            eprintln!("{}", probe_line(&probe));
        }
        self.probes.push(probe);
        Ok(measured)
    }
}

impl Prober<'_> {
    /// Each candidate with, where `variant` gives one, its captured twin probed at the same
    /// micro-batch (and added to `settings`). The twin goes before its eager setting when the
    /// user's spec asks for graphs ("auto" or "on"), after it otherwise: the spec's own choice is
    /// the earlier, which a later one must beat by `FASTER_BY`.
    pub(super) fn with_graphs(
        &mut self,
        settings: &mut Vec<Setting>,
        candidates: Vec<(usize, Measured)>,
        spec: &Spec,
        say: &dyn Fn(String),
    ) -> Result<Vec<(usize, Measured)>> {
        let graph_first = spec.train.cuda_graph != crate::spec::CudaGraph::Off;
        let mut out = vec![];
        for (i, m) in candidates {
            let Some(on) = graph::variant(settings[i], spec, self.cuda) else {
                out.push((i, m));
                continue;
            };
            let g = match self.probe(on, m.micro_batch) {
                Ok(g) => g,
                Err(ProbeError::Failed(e)) => return Err(e),
                Err(ProbeError::NotApplicable) => unreachable!("its eager setting applied"),
            };
            if !g.fits {
                let why = self.probes.last().and_then(|p| p.oom.clone());
                say(format!(
                    "left out {on} at micro-batch {}: the captured step does not fit there ({}); the eager one stands",
                    m.micro_batch,
                    why.as_deref().unwrap_or("out of memory")
                ));
                out.push((i, m));
                continue;
            }
            settings.push(on);
            out.extend(graph::in_order((i, m), (settings.len() - 1, g), graph_first));
        }
        Ok(out)
    }

    /// What a probe that exited 0 measured, from its records. A captured probe that captured
    /// nothing (its capture ran out of memory and it went on eager) does not fit as a captured
    /// setting; the records' reason comes with it.
    fn completed(
        &self,
        setting: Setting,
        micro_batch: i64,
        run_dir: &Path,
    ) -> Result<(Measured, Option<String>), ProbeError> {
        // A probe's own records; a missing one is fit's failure, not the user's input.
        let records = records::read(run_dir).map_err(|e| anyhow::anyhow!("reading a probe's records: {e:#}"))?;
        let summary = records
            .summary
            .as_ref()
            .context("a probe that completed wrote no summary.json")?;
        if setting.activation_checkpointing && !summary.precision.activation_checkpointing {
            return Err(ProbeError::NotApplicable);
        }
        Ok(match setting.cuda_graph {
            Graph::Off => (measure(&records, micro_batch, self.cuda, 0), None),
            // Timed over the replays alone: the warm-ups and the capture are set-up.
            Graph::On => match graph::captured_at(&records) {
                Ok(at) => (measure(&records, micro_batch, self.cuda, at), None),
                Err(why) => (Measured::out_of_memory(micro_batch), Some(why)),
            },
        })
    }
}

pub(super) fn killed_by(status: &std::process::ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.signal()
}

pub(super) fn probe_line(p: &Probe) -> String {
    let m = &p.measured;
    let peak = m.peak_bytes.map_or_else(|| "-".into(), human_bytes);
    let verdict = match (m.fits, &p.oom) {
        (true, _) => format!(
            "fits {}",
            m.samples_per_s
                .map(|r| format!("{r:>10.1} samples/s"))
                .unwrap_or_default()
        ),
        (false, Some(why)) => format!("OOM  ({why})"),
        (false, None) => "OOM ".into(),
    };
    format!(
        "probe  {}  micro-batch {:>5}  peak {peak:>10}  {verdict}  [{}]",
        p.setting,
        m.micro_batch,
        human_duration(p.seconds)
    )
}

/// Where a probe that exited 3 ran out: in the phase its OOM record names, or while setting up
/// when it left no records (a run writes none until its model, data and optimizer are set up).
pub(super) fn where_oom(run_dir: &Path) -> Option<String> {
    match records::read(run_dir) {
        Ok(r) => r.ooms().last().map(|o| format!("out of memory in {}", o.phase)),
        Err(_) => Some("out of memory while setting up".into()),
    }
}

/// The probe's peak (reserved on CUDA: that is what the cap limits; allocated tensor bytes on
/// the CPU) over all its steps, and its throughput over the steps after the first and after
/// global step `set_up` (a captured probe's capture: its warm-ups and capture are not replays).
pub(super) fn measure(records: &RunRecords, micro_batch: i64, cuda: bool, set_up: i64) -> Measured {
    let steps: Vec<&StepEvent> = records.steps().collect();
    let step_peak = |s: &StepEvent| match cuda {
        true => s.memory.peak_reserved_bytes,
        false => s.memory.peak_allocated_bytes,
    };
    // Setting up (data, model) counts too: the cap covers it, and it can be the larger.
    let setup = records.starts().filter_map(|s| match cuda {
        true => s.setup_peak_reserved_bytes,
        false => s.setup_peak_allocated_bytes,
    });
    let peak = steps.iter().filter_map(|s| step_peak(s)).chain(setup).max();
    // Each step line carries the step's samples and wall time; the first step pays for
    // warm-up and is left out. (Validation and saves between steps are not in the steps' time.)
    // A figure JSON could not carry (null, read back as NaN) is left out.
    let timed: Vec<(f64, f64)> = steps
        .iter()
        .skip(1)
        .filter(|s| s.step > set_up && s.seconds.is_finite())
        .map(|s| (s.samples as f64, s.seconds))
        .collect();
    let seconds: f64 = timed.iter().map(|t| t.1).sum();
    let samples_per_s = if seconds > 0.0 {
        Some(timed.iter().map(|t| t.0).sum::<f64>() / seconds)
    } else {
        steps.last().map(|s| s.samples_per_s).filter(|r| r.is_finite())
    };
    Measured {
        micro_batch,
        fits: true,
        peak_bytes: peak,
        samples_per_s,
    }
}

/// A probe that stopped for another reason than memory. One that refused the spec (exit 2: data
/// that does not fit the budget before any step, say) stops fit with exit 2 and the probe's
/// words, which say what to change; anything else is unexpected.
pub(super) fn probe_failure(
    micro_batch: i64,
    setting: &impl std::fmt::Display,
    code: Option<i32>,
    stderr: &[u8],
) -> anyhow::Error {
    let stderr = String::from_utf8_lossy(stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(6).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    let setting = setting.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
    let message = format!(
        "the probe at micro-batch {micro_batch} ({setting}) failed (exit {}):\n{}",
        code.map_or("by a signal".into(), |c| c.to_string()),
        tail.join("\n")
    );
    match code {
        Some(crate::exit::USAGE) => UsageError(message).into(),
        _ => anyhow::anyhow!(message),
    }
}
