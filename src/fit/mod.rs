//! `memtrain fit`: measures, instead of guessing, the largest micro-batch that fits a memory
//! budget for each precision and recomputation setting, and recommends the fastest that keeps
//! the spec's effective batch.
//!
//! Every probe is a child `memtrain run --max-steps N` under the cap: a few real optimizer steps
//! (the architecture step too), with `memory.on_oom = ["fail"]`. A child that runs out of
//! memory exits 3 and takes its allocator state with it, so one OOM cannot leave the next probe
//! a fragmented cache or a device in a bad state; the cost is a process start per probe.
mod graph;
mod probe;
mod search;
mod setting;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::cli::{Checkpointing, FitArgs};
use crate::exit::{OomExit, UsageError};
use crate::human::human_bytes;
use crate::plan::{Facts, Place, Plan, Request};

use crate::spec::{self, ByteSize, Precision};
use probe::*;
pub use search::{fastest, largest_fit, micro_batch_for, Measured};
pub use setting::{Budget, Graph, Placement, Probe, Setting};

#[derive(Debug, Clone, Serialize)]
pub struct SettingResult {
    #[serde(flatten)]
    pub setting: Setting,
    /// False where the preset is not a sequence of blocks, so checkpointing does not apply.
    pub applicable: bool,
    pub largest_micro_batch: Option<i64>,
    pub peak_bytes: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Recommendation {
    #[serde(flatten)]
    pub setting: Setting,
    pub batch_size: i64,
    pub accumulation_steps: i64,
    pub effective_batch: i64,
    pub peak_bytes: Option<u64>,
    /// Budget less the measured peak.
    pub headroom_bytes: Option<i64>,
    pub samples_per_s: Option<f64>,
    /// Set when the spec's `memory.min_batch_size` is above `batch_size` and must come down.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_batch_size: Option<i64>,
}

/// `fit --json`'s object (documented in docs/outputs.md).
#[derive(Debug, Serialize)]
pub struct Report {
    pub spec: PathBuf,
    pub device: String,
    pub budget: Budget,
    pub effective_batch: i64,
    pub steps_per_probe: i64,
    pub probes: Vec<Probe>,
    pub settings: Vec<SettingResult>,
    pub recommendation: Option<Recommendation>,
    pub written: Option<PathBuf>,
    #[serde(skip)]
    user_sets: Vec<String>,
    /// `train.cuda_graph` as the `--set` line must give it (see `graph::written_value`).
    #[serde(skip)]
    graph_set: Option<&'static str>,
}

fn parse_margin(text: &str, budget: u64) -> Result<u64, UsageError> {
    let t = text.trim();
    if let Some(p) = t.strip_suffix('%') {
        let p: f64 = p.trim().parse().map_err(|_| {
            UsageError(format!(
                "--margin {text}: write a percentage like 10% or a size like 512MiB"
            ))
        })?;
        if !(0.0..100.0).contains(&p) {
            return Err(UsageError(format!(
                "--margin {text}: a percentage from 0% to under 100%"
            )));
        }
        return Ok((budget as f64 * p / 100.0) as u64);
    }
    let b = ByteSize::parse(t).map_err(|e| UsageError(format!("--margin: {e}, or a percentage like 10%")))?;
    if b.0 >= budget {
        return Err(UsageError(format!(
            "--margin {text} is not below the budget of {}",
            human_bytes(budget)
        )));
    }
    Ok(b.0)
}

fn resolve_budget(args: &FitArgs, plan: &Plan, facts: &Facts) -> Result<Budget> {
    let cuda = matches!(plan.device, Place::Cuda(_));
    let total = facts.cuda_total_bytes;
    let (bytes, source, written_as) = if let Some(l) = &args.limit {
        let b = ByteSize::parse(l).map_err(|e| UsageError(format!("--limit: {e}")))?;
        if b.0 == 0 {
            return Err(
                UsageError("--limit 0: the budget must be more than nothing; give a size such as 4GiB".into()).into(),
            );
        }
        (b.0, "--limit".to_owned(), Some(("memory.limit", spec_size(b))))
    } else if let Some(f) = args.fraction {
        if !(f > 0.0 && f <= 1.0) {
            return Err(UsageError(format!("--fraction {f}: a fraction of the GPU's memory, in (0, 1]")).into());
        }
        let Some(total) = total.filter(|_| cuda) else {
            return Err(UsageError(
                "--fraction is a share of a GPU's memory and this spec runs on the CPU; give the budget with --limit SIZE".into(),
            )
            .into());
        };
        (
            (total as f64 * f) as u64,
            format!("--fraction {f} of {}", human_bytes(total)),
            Some(("memory.fraction", f.into())),
        )
    } else if let Some(cap) = &plan.cap {
        (cap.bytes, "the spec's memory cap".to_owned(), None)
    } else if let (true, Some(total)) = (cuda, total) {
        (total, "the GPU's memory".to_owned(), None)
    } else {
        let host = crate::sysmem::host_memory()?;
        (
            host.ram_available_bytes,
            "the host's available memory (give --limit for a smaller budget)".to_owned(),
            None,
        )
    };
    let margin_bytes = parse_margin(&args.margin, bytes)?;
    Ok(Budget {
        bytes,
        source,
        margin_bytes,
        usable_bytes: bytes - margin_bytes,
        written_as,
    })
}

/// A size as the spec writes it: "4GiB" where exact, else a byte count.
fn spec_size(b: ByteSize) -> toml_edit::Value {
    match toml::Value::try_from(b) {
        Ok(toml::Value::String(s)) => s.into(),
        _ => (b.0 as i64).into(),
    }
}

fn settings(args: &FitArgs, plan: &Plan, cuda: bool) -> Result<Vec<Setting>> {
    let spec = &plan.spec;
    // A frozen base kept in bf16 is for bf16-mixed autocast alone: the spec runs in no other.
    let frozen_bf16 = spec.train.frozen_dtype == crate::spec::FrozenDtype::Bf16;
    let runs_in = |p: &Precision| !frozen_bf16 || *p == Precision::Bf16Mixed;
    // The spec's own setting first: the others must beat it clearly to be recommended.
    let precisions: Vec<Precision> = if args.precisions.is_empty() {
        let mixed = if cuda {
            Precision::Fp16Mixed
        } else {
            Precision::Bf16Mixed
        };
        let mut p = vec![spec.train.precision];
        for q in [Precision::Fp32, mixed] {
            if !p.contains(&q) && runs_in(&q) {
                p.push(q);
            }
        }
        p
    } else {
        let mut out = vec![];
        for name in &args.precisions {
            let p = Precision::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
                let all: Vec<&str> = Precision::ALL.iter().map(|p| p.name()).collect();
                UsageError(format!(
                    "--precision {name}: not a precision; one of {}",
                    all.join(", ")
                ))
            })?;
            if !runs_in(&p) {
                return Err(UsageError(format!(
                    "--precision {name}: train.frozen_dtype = \"bf16\" keeps the frozen weights in bf16 for bf16-mixed autocast, the one precision it runs in; to compare {name}, add --set train.frozen_dtype=\"fp32\""
                ))
                .into());
            }
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out
    };
    let own = spec.train.activation_checkpointing;
    let checkpointing: &[bool] = match args.checkpointing {
        Checkpointing::Off => &[false],
        Checkpointing::On => &[true],
        Checkpointing::Both => &[own, !own],
    };
    Ok(precisions
        .iter()
        .flat_map(|&precision| {
            checkpointing.iter().map(move |&activation_checkpointing| Setting {
                precision,
                activation_checkpointing,
                placement: Placement::Device,
                cuda_graph: Graph::Off,
            })
        })
        .collect())
}

pub fn fit(args: &FitArgs, quiet: bool) -> Result<()> {
    let loaded = spec::load_args(&args.spec.file, &args.spec.set, &crate::model::validate)?;
    let spec = loaded.spec;
    let scratch = Scratch(std::env::temp_dir().join(format!("memtrain-fit-{}", std::process::id())));
    let request = Request {
        out: Some(scratch.0.join("plan")),
        resume: None,
    };
    let facts = Facts::probe(&spec, &request, None)?;
    let plan = Plan::resolve(&spec, &request, &facts)?;
    let cuda = matches!(plan.device, Place::Cuda(_));
    let budget = resolve_budget(args, &plan, &facts)?;
    let settings = settings(args, &plan, cuda)?;
    if let Some(out) = &args.write {
        writable_file(out)?;
    }
    let effective = plan.configured.effective();
    let device = crate::human::device_name(plan.device.tch());
    let say = |s: String| {
        if !quiet {
            eprintln!("{s}");
        }
    };
    say(format!(
        "fit: {} on {device}; budget {} ({}), margin {} -> probes capped at {}; effective batch {effective}; {} steps per probe",
        args.spec.file.display(),
        human_bytes(budget.bytes),
        budget.source,
        human_bytes(budget.margin_bytes),
        human_bytes(budget.usable_bytes),
        args.steps
    ));
    say(format!("fit: {}", crate::policy::levers::fit_line()));
    let mut prober = Prober {
        args,
        exe: std::env::current_exe().context("finding the memtrain executable for the probes")?,
        scratch,
        budget: &budget,
        cuda,
        effective,
        count: 0,
        probes: vec![],
        quiet,
    };
    let mut results = vec![];
    let mut candidates = vec![];
    let mut settings = settings;
    for (i, setting) in settings.iter_mut().enumerate() {
        let (result, candidate) = search_setting(&mut prober, *setting, effective, &plan, &say)?;
        // The rung of the placement ladder the search settled on.
        *setting = result.setting;
        results.push(result);
        candidates.extend(candidate.map(|m| (i, m)));
    }
    let candidates = prober.with_graphs(&mut settings, candidates, &spec, &say)?;
    let candidates = confirm(&mut prober, &settings, candidates, &say)?;
    let recommendation = fastest(&candidates).map(|(i, m)| Recommendation {
        setting: settings[*i],
        batch_size: m.micro_batch,
        accumulation_steps: effective / m.micro_batch,
        effective_batch: effective,
        peak_bytes: m.peak_bytes,
        headroom_bytes: m.peak_bytes.map(|p| budget.bytes as i64 - p as i64),
        samples_per_s: m.samples_per_s,
        min_batch_size: (spec.memory.min_batch_size > m.micro_batch).then_some(m.micro_batch),
    });
    let graph_set = recommendation
        .as_ref()
        .and_then(|r| graph::written_value(r.setting, &spec, cuda));
    let written = match (&recommendation, &args.write) {
        (Some(r), Some(out)) => Some(write_spec(args, r, graph_set, &budget, out)?),
        _ => None,
    };
    let report = Report {
        spec: args.spec.file.clone(),
        device,
        budget: budget.clone(),
        effective_batch: effective,
        steps_per_probe: args.steps,
        probes: prober.probes.clone(),
        settings: results,
        recommendation,
        written,
        user_sets: args.spec.set.clone(),
        graph_set,
    };
    if args.json {
        crate::outln!("{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        crate::out!("{}", human(&report))?;
    }
    match report.recommendation {
        Some(_) => Ok(()),
        None => Err(nothing_fits(&report, &plan, &budget)),
    }
}

/// Why there is no recommendation: no setting applies (exit 2), or nothing fits (exit 3).
fn nothing_fits(report: &Report, plan: &Plan, budget: &Budget) -> anyhow::Error {
    let spec = &plan.spec;
    if !report.settings.iter().any(|s| s.applicable) {
        return UsageError(format!(
            "no setting applies: the {} preset is not a sequence of blocks, so activation checkpointing does not apply to it; use --checkpointing off or both",
            spec.model.preset
        ))
        .into();
    }
    if report.settings.iter().any(|s| s.largest_micro_batch.is_some()) {
        return OomExit(format!(
            "no setting fits reliably in {}: each one that fitted ran out of memory when probed again; raise --margin or --limit",
            human_bytes(budget.usable_bytes)
        ))
        .into();
    }
    OomExit(format!(
        "nothing fits in {} (the {} budget less the margin): micro-batch 1 runs out of memory in every setting tried; raise --limit, lower --margin, or use a smaller model",
        human_bytes(budget.usable_bytes),
        human_bytes(budget.bytes)
    ))
    .into()
}

/// One setting's search: the largest micro-batch that fits, then the largest divisor of the
/// effective batch at most that large that fits (measured if it was not probed): the
/// setting's candidate for the recommendation.
fn search_setting(
    prober: &mut Prober,
    setting: Setting,
    effective: i64,
    plan: &Plan,
    say: &dyn Fn(String),
) -> Result<(SettingResult, Option<Measured>)> {
    let spec = &plan.spec;
    let mut setting = setting;
    let found = loop {
        let found = largest_fit(effective, |b| prober.probe(setting, b));
        let streams = spec::streams(&spec.model.preset);
        match (
            &found,
            setting.placement.next(setting.activation_checkpointing, streams),
        ) {
            (Ok(None), Some(next)) => {
                say(format!(
                    "probe  {setting}  micro-batch 1 does not fit: moving more to the host ({})",
                    next.name()
                ));
                setting.placement = next;
            }
            _ => break found,
        }
    };
    let (applicable, largest) = match found {
        Ok(l) => (true, l),
        Err(ProbeError::NotApplicable) => {
            say(format!(
                "probe  {setting}  not applicable: the {} preset is not a sequence of blocks",
                spec.model.preset
            ));
            (false, None)
        }
        Err(ProbeError::Failed(e)) => return Err(e),
    };
    let result = SettingResult {
        setting,
        applicable,
        largest_micro_batch: largest.as_ref().map(|m| m.micro_batch),
        peak_bytes: largest.as_ref().and_then(|m| m.peak_bytes),
    };
    let Some(largest) = largest else {
        return Ok((result, None));
    };
    let mut limit = largest.micro_batch;
    while let Some(b) = micro_batch_for(effective, limit) {
        let known = prober
            .probes
            .iter()
            .rev()
            .find(|p| p.setting == setting && p.measured.micro_batch == b)
            .map(|p| p.measured.clone());
        let m = match known {
            Some(m) => m,
            None => match prober.probe(setting, b) {
                Ok(m) => m,
                Err(ProbeError::Failed(e)) => return Err(e),
                Err(ProbeError::NotApplicable) => break,
            },
        };
        if m.fits {
            return Ok((result, Some(m)));
        }
        limit = b - 1;
    }
    Ok((result, None))
}

/// Rounds of re-measuring the candidates, alternating their order, before choosing: a few
/// steps' throughput on a busy machine is noisy.
const CONFIRM_ROUNDS: usize = 2;

/// Each candidate probed again `CONFIRM_ROUNDS` times; its throughput becomes the median of
/// every measurement at its micro-batch and its peak the largest. A candidate that runs out of
/// memory on a repeat does not fit reliably and is dropped.
fn confirm(
    prober: &mut Prober,
    settings: &[Setting],
    candidates: Vec<(usize, Measured)>,
    say: &dyn Fn(String),
) -> Result<Vec<(usize, Measured)>> {
    if candidates.len() < 2 {
        return Ok(candidates);
    }
    say(format!(
        "confirming: {} candidates, {CONFIRM_ROUNDS} more probes each, alternating",
        candidates.len()
    ));
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    for _ in 0..CONFIRM_ROUNDS {
        for &k in &order {
            let (i, m) = &candidates[k];
            match prober.probe(settings[*i], m.micro_batch) {
                Ok(_) => {}
                Err(ProbeError::Failed(e)) => return Err(e),
                Err(ProbeError::NotApplicable) => unreachable!("it applied in the search"),
            }
        }
        order.reverse();
    }
    let mut out = vec![];
    for (i, m) in candidates {
        let runs: Vec<&Measured> = prober
            .probes
            .iter()
            .filter(|p| p.setting == settings[i] && p.measured.micro_batch == m.micro_batch)
            .map(|p| &p.measured)
            .collect();
        if runs.iter().any(|r| !r.fits) {
            say(format!(
                "dropped {} at micro-batch {}: it ran out of memory on a repeat",
                settings[i], m.micro_batch
            ));
            continue;
        }
        let mut rates: Vec<f64> = runs.iter().filter_map(|r| r.samples_per_s).collect();
        rates.sort_by(f64::total_cmp);
        out.push((
            i,
            Measured {
                micro_batch: m.micro_batch,
                fits: true,
                peak_bytes: runs.iter().filter_map(|r| r.peak_bytes).max(),
                samples_per_s: rates.get(rates.len() / 2).copied(),
            },
        ));
    }
    Ok(out)
}

fn human(r: &Report) -> String {
    let mut out = String::from("largest micro-batch that fits:\n");
    for s in &r.settings {
        let what = match (s.applicable, s.largest_micro_batch) {
            (false, _) => "not applicable".to_owned(),
            (true, None) => "none (micro-batch 1 runs out of memory)".to_owned(),
            (true, Some(b)) => format!(
                "{b:>5}  (peak {})",
                s.peak_bytes.map_or_else(|| "-".into(), human_bytes)
            ),
        };
        out += &format!("  {}  {what}\n", s.setting);
    }
    out += &graph::human_lines(&r.probes);
    if let Some(rec) = &r.recommendation {
        let ck = if rec.setting.activation_checkpointing {
            "on"
        } else {
            "off"
        };
        out += &format!(
            "recommendation: precision {}, activation checkpointing {ck}, on the host: {}{}: batch_size {} x accumulation_steps {} = {} (the spec's effective batch)\n",
            rec.setting.precision.name(),
            rec.setting.placement.name(),
            graph::recommendation_words(&r.probes, rec.setting),
            rec.batch_size,
            rec.accumulation_steps,
            rec.effective_batch
        );
        if let (Some(p), Some(h)) = (rec.peak_bytes, rec.headroom_bytes) {
            out += &format!(
                "  measured peak {} of the {} budget: {} headroom; {} samples/s\n",
                human_bytes(p),
                human_bytes(r.budget.bytes),
                human_bytes(h.max(0) as u64),
                rec.samples_per_s.map_or_else(|| "-".into(), |s| format!("{s:.1}"))
            );
        }
        match &r.written {
            Some(p) => {
                out += &format!(
                    "  written to {}; run it with: memtrain run {}\n",
                    p.display(),
                    p.display()
                )
            }
            None => {
                let mut sets: Vec<String> = r.user_sets.clone();
                sets.extend([
                    format!("train.batch_size={}", rec.batch_size),
                    format!("train.accumulation_steps={}", rec.accumulation_steps),
                    format!("train.precision={}", rec.setting.precision.name()),
                    format!(
                        "train.activation_checkpointing={}",
                        rec.setting.activation_checkpointing
                    ),
                ]);
                sets.extend(
                    rec.setting
                        .placement
                        .keys()
                        .iter()
                        .filter(|(_, h)| h.is_host())
                        .map(|(k, h)| format!("{k}={}", h.name())),
                );
                if let Some(m) = rec.min_batch_size {
                    sets.push(format!("memory.min_batch_size={m}"));
                }
                if let Some(g) = r.graph_set {
                    sets.push(format!("train.cuda_graph={g}"));
                }
                let line: Vec<String> = sets.iter().map(|s| format!("--set {s}")).collect();
                out += &format!("  run it with: memtrain run {} {}\n", r.spec.display(), line.join(" "));
                if r.budget.written_as.is_some() {
                    out += "  under the same budget: add it to the spec, or write the tuned spec (budget included) with --write OUT.toml\n";
                } else {
                    out += "  (or write the tuned spec with --write OUT.toml)\n";
                }
            }
        }
    }
    out
}

/// `--write OUT` must name a file whose directory exists, said before any probe runs rather
/// than after all of them.
fn writable_file(out: &Path) -> Result<(), UsageError> {
    if out.is_dir() {
        return Err(UsageError(format!(
            "--write {}: a directory; name the file the tuned spec goes to, e.g. {}/tuned.toml",
            out.display(),
            out.display()
        )));
    }
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(UsageError(format!(
            "--write {}: the directory {} does not exist; create it or write elsewhere",
            out.display(),
            parent.display()
        )));
    }
    Ok(())
}

/// The spec file with the recommendation (and the budget, when it came from the command line)
/// written into it, comments kept; checked by loading it back before it lands.
fn write_spec(
    args: &FitArgs,
    rec: &Recommendation,
    graph_set: Option<&'static str>,
    budget: &Budget,
    out: &Path,
) -> Result<PathBuf> {
    let v = |x: toml_edit::Value| Some(x);
    let mut edits: Vec<(&str, Option<toml_edit::Value>)> = vec![
        ("train.batch_size", v(rec.batch_size.into())),
        ("train.accumulation_steps", v(rec.accumulation_steps.into())),
        ("train.precision", v(rec.setting.precision.name().into())),
        (
            "train.activation_checkpointing",
            v(rec.setting.activation_checkpointing.into()),
        ),
    ];
    if let Some(m) = rec.min_batch_size {
        edits.push(("memory.min_batch_size", v(m.into())));
    }
    if let Some(g) = graph_set {
        edits.push(("train.cuda_graph", v(g.into())));
    }
    for (key, home) in rec.setting.placement.keys() {
        edits.push((key, v(home.name().into())));
    }
    if let Some((key, value)) = &budget.written_as {
        let other = if *key == "memory.limit" {
            "memory.fraction"
        } else {
            "memory.limit"
        };
        edits.push((key, Some(value.clone())));
        edits.push((other, None));
    }
    let text = spec::edited_text(&args.spec.file, &args.spec.set, &edits)?;
    let check = std::env::temp_dir().join(format!("memtrain-fit-check-{}.toml", std::process::id()));
    std::fs::write(&check, &text)?;
    let loaded = spec::load_with(&check, &[], &crate::model::validate);
    let _ = std::fs::remove_file(&check);
    if let Err(e) = loaded {
        bail!("the tuned spec does not validate (a bug in fit): {e}");
    }
    crate::atomic::write_atomic(out, text.as_bytes()).with_context(|| format!("writing {}", out.display()))?;
    Ok(out.to_owned())
}

#[cfg(test)]
mod tests;
