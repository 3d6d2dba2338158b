//! `memtrain run`: plan → build → train → report.
mod build;
mod clock;
mod components;
mod execution;
mod forward;
pub mod levers;
mod parts;
mod recovery;
mod resume;
mod step;
mod stream;
mod tally;
mod trainer;

use std::fs;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::cli::RunArgs;
use crate::dist::{Dist, World};
use crate::exit::UsageError;
use crate::human::device_name;
use crate::memory::Cap;
use crate::model;
use crate::oom;
use crate::plan::{DevicePlan, Facts, Plan, Request};
use crate::records::Status;
use crate::shim;
use crate::spec::{self, Spec};

pub use build::init_from;
use execution::Execution;
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
    let facts = Facts::probe(&spec, &request)?;
    let mut plan = Plan::resolve(&spec, &request, &facts)?;
    // For `watch` and `clean`; the file goes when this returns, whatever the outcome.
    let _registration = crate::registry::register(
        world.as_ref().map(|w| w.rank),
        &spec.job.name,
        &plan.run_dir,
        &device_name(plan.device.tch()),
        args.max_steps,
    );
    // Before joining: a NCCL barrier's first CUDA allocation starts the caching allocator, which
    // reads its settings (the cap's fraction among them) once, then.
    set_environment(&plan);
    let (execution, private_dir) = join(world, &mut plan)?;
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
    let parts = plan.build(&spec, execution, session)?;
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
        Some(w) => sets.extend(rank_sets(&args.rank_set, w.rank, w.size)?),
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
/// 0 creates anything; ranks other than 0 write to a private directory that goes away.
fn join(world: Option<World>, plan: &mut Plan) -> Result<(Execution, Option<RemoveOnDrop>)> {
    let Some(w) = world else {
        return Ok((Execution::Local, None));
    };
    if plan.device != DevicePlan::Cpu && !shim::dist::backends().nccl && w.size == 1 {
        return Err(UsageError(format!(
            "{}=1 asks for a one-rank NCCL group on {}, and this memtrain was built without NCCL's headers; unset it, set job.device = \"cpu\" for a one-rank Gloo group, or build with a CUDA toolkit (see docs/data-parallel.md#building-with-gloo-and-nccl)",
            crate::dist::SINGLE_RANK_GROUP,
            device_name(plan.device.tch())
        ))
        .into());
    }
    if plan.device != DevicePlan::Cpu && !shim::dist::backends().nccl {
        return Err(UsageError(format!(
            "data-parallel training on {} needs NCCL, and this memtrain was built without NCCL's headers; set job.device = \"cpu\" to train on Gloo, or rebuild after scripts/bootstrap, which installs them (see docs/data-parallel.md#building-with-gloo-and-nccl)",
            device_name(plan.device.tch())
        ))
        .into());
    }
    // Each rank on its own GPU: NCCL refuses two ranks on one.
    plan.device = rank_device(plan.device, w.local_rank);
    if let Some((k, v)) = nccl_env(plan.device, std::env::var_os(NCCL_BLOCKING_WAIT).is_some()) {
        // Edition 2021: safe. Before the group exists, so a lost peer comes back as an error
        // from wait() (and rank 0 saves) instead of the watchdog ending the process.
        std::env::set_var(k, v);
    }
    if w.size == 1 {
        tracing::info!(
            "{}=1: training as a one-rank {} group",
            crate::dist::SINGLE_RANK_GROUP,
            if plan.device == DevicePlan::Cpu { "Gloo" } else { "NCCL" }
        );
    }
    let d = Dist::join(w, plan.device.tch())?;
    d.barrier()?;
    let mut private_dir = None;
    if d.rank() != 0 {
        let dir = std::env::temp_dir().join(format!("memtrain-rank{}-{}", d.rank(), std::process::id()));
        plan.run_dir = dir.clone();
        private_dir = Some(RemoveOnDrop(dir));
    }
    if plan.threads.is_none() {
        // The machine's cores split between this machine's ranks.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        plan.threads = Some((cores / d.world.local_size).max(1) as _);
    }
    Ok((Execution::DataParallel(d), private_dir))
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
        Err(oom::StepError::Other(m) | oom::StepError::PeerLost(m)) => {
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
            let val = r
                .val_acc
                .map(|a| format!(", val acc {:.1}%", a * 100.0))
                .unwrap_or_default();
            progress.println(&format!(
                "done: {} epochs, final train loss {:.4}{val}; summary in {}",
                r.epoch,
                r.train_loss,
                run_dir.join("summary.json").display()
            ));
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

const NCCL_BLOCKING_WAIT: &str = "TORCH_NCCL_BLOCKING_WAIT";

/// A data-parallel rank's device: `cuda:LOCAL_RANK` on GPUs, the CPU as planned.
fn rank_device(planned: DevicePlan, local_rank: usize) -> DevicePlan {
    match planned {
        DevicePlan::Cuda(_) => DevicePlan::Cuda(local_rank),
        DevicePlan::Cpu => DevicePlan::Cpu,
    }
}

/// NCCL's blocking wait, unless the user chose: without it `WorkNCCL::wait` does not block and a
/// lost peer ends the process through the watchdog.
fn nccl_env(device: DevicePlan, user_set: bool) -> Option<(&'static str, &'static str)> {
    match (device, user_set) {
        (DevicePlan::Cuda(_), false) => Some((NCCL_BLOCKING_WAIT, "1")),
        _ => None,
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
        (DevicePlan::Cpu, Some(cap)) => shim::cpu_alloc_set_cap(Some(cap.bytes)),
        // Also set in PYTORCH_CUDA_ALLOC_CONF for the native allocator; this call is the only
        // one cudaMallocAsync honours. A binary built without the CUDA runtime's headers has
        // only the configuration's fraction, which the native allocator still honours.
        (DevicePlan::Cuda(i), Some(Cap { fraction: Some(f), .. })) => {
            if let Err(e) = shim::cuda_set_memory_fraction(*f, i) {
                tracing::warn!(
                    "the cap on cuda:{i} rests on the allocator settings alone (backend:cudaMallocAsync ignores them): {e:#}"
                );
            }
        }
        _ => {}
    }
    if let DevicePlan::Cuda(_) = plan.device {
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

/// `--rank-set R:KEY=VALUE` entries that apply to `rank`, as `--set` values.
pub(crate) fn rank_sets(entries: &[String], rank: usize, world: usize) -> Result<Vec<String>> {
    let mut out = vec![];
    for e in entries {
        let (r, set) = e
            .split_once(':')
            .and_then(|(r, set)| Some((r.trim().parse::<usize>().ok()?, set)))
            .ok_or_else(|| {
                UsageError(format!(
                    "--rank-set {e:?}: expected RANK:KEY=VALUE, e.g. 1:memory.limit=64MiB"
                ))
            })?;
        // Ranks must agree on everything that decides which collectives they run (optimizer,
        // sharding, batch, checkpoints); memory is what differs between devices.
        if !set.trim_start().starts_with("memory.") {
            return Err(UsageError(format!(
                "--rank-set {e:?}: only memory.* keys can differ between ranks (e.g. 1:memory.limit=64MiB); use --set for the others"
            ))
            .into());
        }
        if r >= world {
            return Err(UsageError(format!(
                "--rank-set {e:?}: there is no rank {r}; the ranks are 0 to {}",
                world - 1
            ))
            .into());
        }
        if r == rank {
            out.push(set.to_owned());
        }
    }
    Ok(out)
}

/// A directory removed when the run ends (a follower rank's private run directory).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_gpu_rank_takes_its_local_device_and_blocking_nccl_waits() {
        assert_eq!(rank_device(DevicePlan::Cuda(0), 3), DevicePlan::Cuda(3));
        assert_eq!(rank_device(DevicePlan::Cpu, 3), DevicePlan::Cpu);
        assert_eq!(
            nccl_env(DevicePlan::Cuda(1), false),
            Some(("TORCH_NCCL_BLOCKING_WAIT", "1"))
        );
        assert_eq!(
            nccl_env(DevicePlan::Cuda(1), true),
            None,
            "the user's own setting stands"
        );
        assert_eq!(nccl_env(DevicePlan::Cpu, false), None, "Gloo has no such switch");
    }
}
