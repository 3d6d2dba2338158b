//! `memtrain run`: plan → build → train → report.
mod build;
mod clock;
mod components;
mod engage;
mod execution;
mod finetune;
mod forward;
mod graph;
mod launch;
mod oom_answer;
mod parts;
mod rebuild;
mod resume;
mod rollback;
mod save;
mod stager;
mod step;
mod stream;
mod summary;
mod tally;
mod terminal;
mod tokens;
mod trainer;
mod validation;

use std::fs;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::cli::RunArgs;
use crate::exit::UsageError;
use crate::human::device_name;
use crate::memory::Cap;
use crate::model;
use crate::oom;
use crate::parallel::{Dist, World};
use crate::plan::{Facts, Place, Plan, Request};
use crate::records::Status;
use crate::shim;
use crate::spec::{self, Spec};

pub(crate) use build::read_init_from;
pub use build::{copy_into, init_from};
use execution::Execution;
pub use forward::PrecisionStage;
pub use parts::Kept;
pub use rebuild::{drawn_model, frozen_as_trained};
pub use stream::{streamed_decode, streamed_forward, streamed_logits, Streamer};
use trainer::Trainer;

pub fn run(args: &RunArgs, quiet: bool) -> Result<()> {
    let t_start = Instant::now();
    oom::install_hook();
    // Freed memory is reused from here on, not handed back and faulted in again each step. The
    // NaN this once exposed (oneDNN's bf16 weight gradient leaves taps that meet only padding
    // unwritten) is avoided where it arises: `model::layers::Conv`.
    crate::sysmem::warm_malloc_thresholds();
    // Before anything is loaded, so every CPU tensor byte of the run is counted.
    shim::cpu_alloc_install().context("installing the counting CPU allocator")?;
    if deterministic_requested()? {
        shim::set_deterministic().context("turning on deterministic algorithms")?;
    }
    let world = World::from_env().map_err(|e| UsageError(format!("{e:#}")))?;
    // Ranks other than 0 print nothing unless something goes wrong.
    let quiet = quiet || world.as_ref().is_some_and(|w| w.rank != 0);
    let spec = load_spec(args, world.as_ref())?;
    let request = Request {
        out: args.out.clone(),
        resume: args.resume.clone(),
    };
    let facts = Facts::probe(&spec, &request, world.as_ref())?;
    let plan = Plan::resolve(&spec, &request, &facts)?;
    drop(spec);
    // For `watch` and `clean`; the file goes when this returns, whatever the outcome.
    let _registration = crate::registry::register(
        world.as_ref().map(|w| w.rank),
        &plan.spec.job.name,
        &plan.run_dir,
        &device_name(plan.device.tch()),
        args.max_steps,
    );
    // Before joining: a NCCL barrier's first CUDA allocation starts the caching allocator, which
    // reads its settings (the cap's fraction among them) once, then.
    set_environment(&plan);
    let execution = join(world, &plan)?;
    // A follower rank's records go to a directory of its own, removed when it is done.
    let private_dir = (plan.writes_to != plan.run_dir).then(|| RemoveOnDrop(plan.writes_to.clone()));
    if let Some(msg) = &plan.nothing_to_do {
        // Nothing to train; leave the finished run's records exactly as they are.
        crate::progress::say(format_args!("{msg}"));
        return Ok(());
    }
    apply(&plan, execution.leads())?;
    let session = build::Session {
        max_steps: args.max_steps,
        quiet,
    };
    let parts = build::components(&plan, execution, session)?;
    let leads = parts.execution.leads();
    let mut trainer = Trainer::new(parts, t_start)?;
    let result = trainer.train();
    drop(private_dir);
    if !leads {
        return result.map(|_| ());
    }
    report(&trainer, &plan.run_dir, result, args.max_steps)
}

/// The spec with this rank's `--rank-set` values.
fn load_spec(args: &RunArgs, world: Option<&World>) -> Result<Spec> {
    let mut sets = args.spec.set.clone();
    match world {
        Some(w) => sets.extend(spec::rank_sets(&args.rank_set, w.rank, w.size)?),
        None if !args.rank_set.is_empty() => {
            return Err(UsageError(
                "--rank-set applies to data-parallel runs: add --nproc N (or launch with torchrun)".into(),
            )
            .into())
        }
        None => {}
    }
    Ok(spec::load_args(&args.spec.file, &sets, &model::validate)?.spec)
}

/// Data-parallel: every rank has resolved its plan (and checked the run directory) before rank
/// 0 creates anything; the plan gave each rank its device, threads and directory.
fn join(world: Option<World>, plan: &Plan) -> Result<Execution> {
    let Some(w) = world else {
        return Ok(Execution::Local(graph::StepGraphs::new(plan.graph.clone())));
    };
    if plan.device != Place::Cpu && !shim::dist::backends().nccl && w.size == 1 {
        return Err(UsageError(format!(
            "{}=1 asks for a one-rank NCCL group on {}, and this memtrain was built without NCCL's headers; unset it, set job.device = \"cpu\" for a one-rank Gloo group, or build with a CUDA toolkit (see docs/data-parallel.md#building-with-gloo-and-nccl)",
            crate::parallel::SINGLE_RANK_GROUP,
            device_name(plan.device.tch())
        ))
        .into());
    }
    if plan.device != Place::Cpu && !shim::dist::backends().nccl {
        return Err(UsageError(format!(
            "data-parallel training on {} needs NCCL, and this memtrain was built without NCCL's headers; set job.device = \"cpu\" to train on Gloo, or rebuild after scripts/bootstrap, which installs them (see docs/data-parallel.md#building-with-gloo-and-nccl)",
            device_name(plan.device.tch())
        ))
        .into());
    }
    if w.size == 1 {
        tracing::info!(
            "{}=1: training as a one-rank {} group",
            crate::parallel::SINGLE_RANK_GROUP,
            if plan.device == Place::Cpu { "Gloo" } else { "NCCL" }
        );
    }
    let d = Dist::join(w, plan.device.tch())?;
    d.barrier()?;
    Ok(Execution::DataParallel(d))
}

/// Every run gets its report, interrupted and failed ones included; then the last words.
fn report(trainer: &Trainer, run_dir: &std::path::Path, result: Result<Status>, max_steps: Option<i64>) -> Result<()> {
    let progress = trainer.progress();
    // The report reads the records and draws them: it holds no tensors, so a squeezed cap
    // leaves it be. Whatever stops it, the run's outcome stands and the records can be drawn
    // again later.
    let written = {
        let _squeeze = crate::fault::squeeze_in(crate::fault::Phase::Report, trainer.global_step());
        oom::guarded(|| crate::report::write(run_dir))
    };
    let redo = format!(
        "the records are intact: write it later with `memtrain report {}`",
        run_dir.display()
    );
    match written {
        Ok(Ok(r)) => progress.println(&format!("report: {}", r.html.display())),
        Ok(Err(e)) => tracing::warn!("could not write the report: {e:#}; {redo}"),
        Err(oom::StepError::Oom { message, .. }) => tracing::warn!(
            "out of memory in {}: {message}; skipped it, {redo}",
            crate::fault::Phase::Report.label()
        ),
        Err(oom::StepError::Other(m) | oom::StepError::PeerLost(m) | oom::StepError::OomInCollective(m)) => {
            tracing::warn!("could not write the report: {m}; {redo}")
        }
    }
    let status = result?;
    if status == Status::StepLimit {
        progress.println(&format!(
            "stopped after {} optimizer steps (--max-steps); no checkpoint written",
            max_steps.unwrap_or_default()
        ));
    }
    if status == Status::Completed {
        if let Some(r) = trainer.last() {
            progress.println(&terminal::done_line(r, &run_dir.join("summary.json")));
        }
    }
    Ok(())
}

/// Carries out the plan's side effects, in the order CUDA needs: environment variables (read
/// at the allocator's first use), threads, the CPU cap, allocator history.
/// The plan's environment variables (allocator settings, symbolization), set before anything
/// touches the device.
fn set_environment(plan: &Plan) {
    for (k, v) in &plan.env {
        // Edition 2021: safe. Called before libtorch starts threads that read the environment.
        std::env::set_var(k, v);
    }
}

/// Test hook: `1` turns on libtorch's deterministic algorithms for the run, so gpu-check can
/// compare a run's losses with PyTorch's under the same settings.
pub const DETERMINISTIC: &str = "MEMTRAIN_TEST_DETERMINISTIC";

fn deterministic_requested() -> Result<bool> {
    match std::env::var(DETERMINISTIC).ok().as_deref().map(str::trim) {
        None | Some("" | "0") => Ok(false),
        Some("1") => Ok(true),
        Some(v) => Err(UsageError(format!(
            "{DETERMINISTIC}={v:?}: set it to 1 (deterministic algorithms) or 0"
        ))
        .into()),
    }
}

/// `leads`: this process speaks for the run (one rank of a data-parallel group does).
fn apply(plan: &Plan, leads: bool) -> Result<()> {
    if leads {
        for why in &plan.notices {
            tracing::warn!("{why}");
        }
    }
    for c in &plan.alloc.conflicts {
        tracing::warn!(
            "allocator setting {}: the environment says {}, the spec says {}; using the spec's",
            c.key,
            c.environment,
            c.spec
        );
    }
    if let Some(n) = plan.threads {
        tch::set_num_threads(n);
    }
    match (plan.device, &plan.cap) {
        (Place::Cpu, Some(cap)) => shim::cpu_alloc_set_cap(Some(cap.bytes)),
        // Also set in PYTORCH_CUDA_ALLOC_CONF for the native allocator; this call is the only
        // one cudaMallocAsync honours. A binary built without the CUDA runtime's headers has
        // only the configuration's fraction, which the native allocator still honours.
        (Place::Cuda(i), Some(Cap { fraction: Some(f), .. })) => {
            if let Err(e) = shim::cuda_set_memory_fraction(*f, i) {
                tracing::warn!(
                    "the cap on cuda:{i} rests on the allocator settings alone (backend:cudaMallocAsync ignores them): {e:#}"
                );
            }
        }
        _ => {}
    }
    if let Place::Cuda(_) = plan.device {
        // Not fatal: the OOM report then takes its snapshot after the attempt unwound.
        if let Err(e) = shim::keep_oom_snapshots() {
            tracing::warn!("the OOM report's snapshot will be taken after the failed step: {e:#}");
        }
    }
    if plan.record_history {
        shim::record_memory_history(true, 100_000).context("starting allocator history recording")?;
    }
    Ok(())
}

/// A directory removed when the run ends (a follower rank's private run directory).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
