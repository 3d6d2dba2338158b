//! Hands each command its work and turns errors into messages and exit codes.
use anyhow::Result;

use crate::cli::{Cli, Command, SpecArgs};
use crate::exit;
use crate::spec;

pub fn main(cli: Cli) -> i32 {
    init_logging(cli.quiet, cli.verbose);
    let result = match cli.command {
        Command::Info { json } => info(json),
        Command::Check(args) => check(&args),
        Command::Run(args) => crate::run::run(&args, cli.quiet),
        Command::Report { run_dir } => report(&run_dir),
        Command::Fit(args) => crate::fit::fit(&args, cli.quiet),
    };
    match result {
        Ok(()) => exit::OK,
        Err(e) => {
            let code = exit::code_for(&e);
            if code == exit::USAGE && e.downcast_ref::<spec::SpecError>().is_some() {
                // Spec errors already carry their location; one per line.
                eprintln!("{e}");
            } else {
                eprintln!("error: {e:#}");
            }
            code
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
    let filter = tracing_subscriber::EnvFilter::try_from_env("MEMTRAIN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("memtrain={level}")));
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
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        crate::info::print_human(&info);
    }
    Ok(())
}

fn check(args: &SpecArgs) -> Result<()> {
    let loaded = spec::load_args(&args.file, &args.set, &crate::model::validate)?;
    let est = crate::estimate::estimate(&loaded.spec)?;
    println!("# {}: valid. Resolved spec:", loaded.path.display());
    print!("{}", spec::to_toml(&loaded.spec));
    println!();
    print!("{est}");
    Ok(())
}

fn report(run_dir: &std::path::Path) -> Result<()> {
    let written = crate::report::write(run_dir)?;
    print!("{}", written.text);
    println!("report: {}", written.html.display());
    Ok(())
}
