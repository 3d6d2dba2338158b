//! Hands each command its work and turns errors into messages and exit codes.
use anyhow::Result;

use crate::cli::{Cli, Command, SpecArgs};
use crate::exit;
use crate::spec;

pub fn main(cli: Cli) -> i32 {
    // Ranks other than 0 are quiet unless something goes wrong, and then say which rank.
    let rank = std::env::var("RANK")
        .ok()
        .filter(|_| std::env::var("WORLD_SIZE").is_ok_and(|w| w != "1"));
    let follower = rank.as_deref().is_some_and(|r| r != "0");
    init_logging(cli.quiet || follower, cli.verbose);
    let who = rank.map(|r| format!("rank {r}: ")).unwrap_or_default();
    let result = match cli.command {
        Command::Info { json } => info(json),
        Command::Check(args) => check(&args),
        Command::Run(args) => match launch_ranks(&args) {
            Some(code) => return code,
            None => crate::run::run(&args, cli.quiet),
        },
        Command::Report { run_dir } => report(&run_dir),
        Command::Fit(args) => crate::fit::fit(&args, cli.quiet),
        Command::Watch(args) => crate::watch::watch(&args),
        Command::Clean(args) => crate::clean::clean(&args),
        Command::Export(args) => crate::export::export(&args),
        Command::Eval(args) => crate::eval::eval(&args),
        Command::Generate(args) => crate::generate::generate(&args),
    };
    match result {
        Ok(()) => exit::OK,
        Err(e) => {
            let code = exit::code_for(&e);
            if follower && code == exit::INTERRUPTED {
                // Rank 0 says where the checkpoint went.
                return code;
            }
            if code == exit::USAGE && e.downcast_ref::<spec::SpecError>().is_some() {
                // Spec errors already carry their location; one per line.
                crate::progress::say(format_args!("{who}{e}"));
            } else {
                crate::progress::say(format_args!("{who}error: {e:#}"));
            }
            code
        }
    }
}

/// `run --nproc N` (N > 1) outside a launched group: start the ranks and wait for them.
fn launch_ranks(args: &crate::cli::RunArgs) -> Option<i32> {
    let n = args.nproc.filter(|&n| n > 1)? as usize;
    if std::env::var_os("WORLD_SIZE").is_some() {
        eprintln!("error: --nproc inside a launched group (WORLD_SIZE is set): leave --nproc out under torchrun");
        return Some(exit::USAGE);
    }
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let available = crate::sysmem::host_memory().ok().map(|h| h.ram_available_bytes);
    if let Err(e) = crate::parallel::launch::check_rank_count(n, cores, available) {
        eprintln!("error: {e}");
        return Some(exit::USAGE);
    }
    // A bad --rank-set is said once, here, rather than by every rank.
    if let Err(e) = crate::spec::rank_sets(&args.rank_set, usize::MAX, n) {
        eprintln!("error: {e:#}");
        return Some(exit::USAGE);
    }
    // The same command line, less --nproc: each rank runs it with torchrun's variables.
    let mut rest = vec![];
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        if a == "--nproc" {
            it.next();
        } else if !a.starts_with("--nproc=") {
            rest.push(a);
        }
    }
    let timeout = match crate::parallel::World::from_lookup(|k| match k {
        "RANK" => Some("0".into()),
        "WORLD_SIZE" => Some(n.to_string()),
        "MASTER_ADDR" => Some("127.0.0.1".into()),
        "MASTER_PORT" => Some("1".into()),
        _ => std::env::var(k).ok(),
    }) {
        Ok(w) => w.map(|w| w.timeout).unwrap_or(crate::parallel::DEFAULT_TIMEOUT),
        Err(e) => {
            eprintln!("error: {e:#}");
            return Some(exit::USAGE);
        }
    };
    match crate::parallel::launch::launch(n, &rest, timeout) {
        Ok(code) => Some(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            Some(exit::FAILURE)
        }
    }
}

fn init_logging(quiet: bool, verbose: u8) {
    let level = match (quiet, verbose) {
        (true, _) => "warn",
        (false, 0) => "info",
        (false, 1) => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("MEMTRAIN_LOG").unwrap_or_else(|e| {
        if let Ok(v) = std::env::var("MEMTRAIN_LOG") {
            eprintln!(
                "warning: MEMTRAIN_LOG={v:?} is not a log filter ({e}); using the default. Write it like memtrain=debug"
            );
        }
        tracing_subscriber::EnvFilter::new(format!("memtrain={level}"))
    });
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .without_time()
        .init();
}

fn info(json: bool) -> Result<()> {
    let info = crate::info::collect()?;
    if json {
        crate::outln!("{}", serde_json::to_string_pretty(&info)?)?;
    } else {
        crate::info::print_human(&info)?;
    }
    Ok(())
}

/// `run` builds the model in fp32 in host memory first; a machine without that much free RAM
/// stops there, which `check` can say before anyone waits for it.
fn build_room_notice(model: &spec::Model, est: &crate::estimate::Estimate) -> Option<String> {
    let free = crate::sysmem::available_bytes()?;
    let need = est.build_bytes();
    (model.preset != "torchscript" && need > free).then(|| {
        format!(
            "`memtrain run` builds the model in host memory (in fp32, but a frozen base kept in bf16) before it moves anything: {} here, \
             more than the {} of RAM free on this machine now; run it where more is free",
            crate::human::human_bytes(need),
            crate::human::human_bytes(free)
        )
    })
}

fn check(args: &SpecArgs) -> Result<()> {
    // The load plan of model.init_from from the checkpoint's header: a checkpoint `run` would
    // refuse is a spec error here, at init_from's line.
    let init = std::cell::RefCell::new(None);
    let more = |m: &mut spec::Model, d: &spec::Data| {
        let mut problems = crate::model::validate(m, d);
        if problems.is_empty() {
            match crate::model::init_plan(m) {
                Ok(plan) => *init.borrow_mut() = plan,
                Err(p) => problems.push(p),
            }
        }
        problems
    };
    let loaded = spec::load_args(&args.file, &args.set, &more)?;
    let est = crate::estimate::estimate(&crate::estimate::Sections {
        model: &loaded.spec.model,
        train: &loaded.spec.train,
        memory: &loaded.spec.memory,
        device: loaded.spec.job.device,
    })?;
    crate::data::check_source(&loaded.spec.data, est.vocab)?;
    if let Some(n) = crate::plan::unread_data_keys(&loaded.spec.data) {
        tracing::warn!("{n}");
    }
    if let Some(n) = build_room_notice(&loaded.spec.model, &est) {
        tracing::warn!("{n}");
    }
    if let Ok(Some(classes)) = crate::data::classes::probe(&loaded.spec.data) {
        if let Some(n) = crate::model::class_notice(&loaded.spec.model, &classes, &loaded.spec.data) {
            tracing::warn!("{n}");
        }
    }
    crate::outln!("# {}: valid. Resolved spec:", loaded.path.display())?;
    crate::out!("{}", spec::to_toml(&loaded.spec))?;
    crate::outln!()?;
    crate::out!("{est}")?;
    crate::outln!(
        "{}",
        crate::data::check_line(&loaded.spec.data, &est.input_shape, est.micro_batch)
    )?;
    if let (Some(plan), Some(path)) = (init.into_inner(), &loaded.spec.model.init_from) {
        crate::outln!("model.init_from {}: {}", path.display(), plan.describe())?;
    }
    // Each lever as the spec's run would start.
    let s = crate::policy::levers::Situation {
        at: crate::policy::levers::Position {
            shape: crate::oom::BatchShape {
                micro_batch: loaded.spec.train.batch_size,
                accumulation_steps: loaded.spec.train.accumulation_steps,
            },
            clean_steps: 0,
            engaged: crate::policy::levers::Engaged::default(),
        },
        min_batch: loaded.spec.memory.min_batch_size,
        planned_on_cpu: loaded.spec.job.device == crate::spec::Device::Cpu,
        has_blocks: est.has_blocks,
        blockwise: est.blockwise,
        data_parallel: false,
        state_slots: est.state_per_weight as usize,
        torchscript: loaded.spec.model.preset == "torchscript",
    };
    let configured = crate::policy::levers::configured(&loaded.spec.train, &loaded.spec.memory);
    let levers = crate::policy::levers::check_lines(&est, &s, &loaded.spec.memory.on_oom, &configured);
    crate::out!("{levers}")?;
    Ok(())
}

fn report(run_dir: &std::path::Path) -> Result<()> {
    let written = crate::report::write(run_dir)?;
    crate::out!("{}", written.text)?;
    crate::outln!("report: {}", written.html.display())?;
    Ok(())
}
