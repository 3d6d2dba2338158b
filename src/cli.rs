//! Command-line surface. Parsing only; `app` does the work.
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "memtrain", version, about = "Train PyTorch models within a GPU memory budget", long_about = None)]
pub struct Cli {
    /// Less output: warnings and errors only.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
    /// More output (-v: debug, -vv: trace).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show libtorch, CUDA, host memory, the GPUs and who uses their memory.
    Info {
        /// One JSON object on stdout (schema in README).
        #[arg(long)]
        json: bool,
    },
    /// Validate a job spec, print it resolved, and estimate its static memory.
    Check(SpecArgs),
    /// Train a job spec.
    Run(RunArgs),
    /// Draw a run directory's records as report.html and print a summary.
    Report {
        /// A run directory written by `memtrain run`.
        run_dir: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct SpecArgs {
    /// The job spec (TOML).
    pub file: PathBuf,
    /// Override a spec key, e.g. --set train.batch_size=8 (repeatable; values typed as TOML).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Run directory (default: <job.output_dir>/<job.name>).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Continue from the latest checkpoint of the run directory (or of DIR).
    #[arg(long, value_name = "DIR", num_args = 0..=1)]
    pub resume: Option<Option<PathBuf>>,
    /// Stop after N optimizer steps (a smoke test of a spec); records and report, no checkpoint.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i64).range(1..))]
    pub max_steps: Option<i64>,
}
