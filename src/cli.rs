//! Command-line surface. Parsing only; `app` does the work.
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

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
        /// One JSON object on stdout (fields in docs/outputs.md#info---json).
        #[arg(long)]
        json: bool,
    },
    /// Validate a job spec, print it resolved, and estimate its static memory.
    Check(SpecArgs),
    /// Train a job spec.
    Run(RunArgs),
    /// Find the largest micro-batch that fits a memory budget for each precision and
    /// recomputation setting, by running real steps, and recommend the fastest.
    Fit(FitArgs),
    /// Draw a run directory's records as report.html and print a summary.
    Report {
        /// A run directory written by `memtrain run`.
        run_dir: PathBuf,
    },
    /// A live view of the GPUs, who holds their memory, and each running (or given) memtrain
    /// job's memory timeline and events; refreshes every second. q, Esc or Ctrl-C quits.
    Watch(WatchArgs),
    /// Evaluate a run's best checkpoint on its validation data or another image folder: loss,
    /// accuracy, top-5 and a per-class table, printed and written as JSON.
    Eval(EvalArgs),
    /// End processes that hold memory for nothing: this user's orphaned memtrain runs, or the
    /// processes named with --pid. Lists them only, unless --yes.
    Clean(CleanArgs),
    /// Write a run's weights, LoRA merged, under the names torchvision, timm or Hugging Face
    /// load, into a new directory.
    Export(ExportArgs),
    /// Continue a prompt with a language-model run's weights, greedily or by sampling, through
    /// the decoder's key/value cache, under the run's device and memory cap.
    Generate(GenerateArgs),
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A run directory written by `memtrain run` (a language model: the llama preset).
    pub run_dir: PathBuf,
    /// The text to continue, tokenized with the run's data.tokenizer (or --tokenizer).
    #[arg(
        long,
        value_name = "TEXT",
        required_unless_present = "prompt_ids",
        conflicts_with = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Token ids to continue instead of text, separated by commas or spaces.
    #[arg(long, value_name = "IDS")]
    pub prompt_ids: Option<String>,
    /// A tokenizer.json to use instead of the run's data.tokenizer.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// The most tokens to add.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_new_tokens: i64,
    /// Sampling temperature; 0 takes the most likely token each time (greedy).
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample from the K most likely tokens only (0: from all).
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub top_k: i64,
    /// The sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: i64,
    /// Go on past the end-of-text token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// A checkpoint directory (or model.safetensors) of the run instead of its best (else newest).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<std::path::PathBuf>,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A run directory written by `memtrain run`.
    pub run_dir: PathBuf,
    /// Whose names to write: torchvision (and its state_dict), timm, or huggingface (with config.json).
    #[arg(long, value_enum)]
    pub format: ExportFormat,
    /// The directory to create (it must not exist).
    pub out: PathBuf,
    /// A checkpoint of the run to export instead of its best (else newest) one: its directory
    /// or its model.safetensors.
    #[arg(long, value_name = "PATH")]
    pub checkpoint: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    Torchvision,
    Timm,
    Huggingface,
}

impl ExportFormat {
    pub fn name(self) -> &'static str {
        match self {
            ExportFormat::Torchvision => "torchvision",
            ExportFormat::Timm => "timm",
            ExportFormat::Huggingface => "huggingface",
        }
    }
}

#[derive(Debug, Args)]
pub struct WatchArgs {
    /// Run directories to show besides the running jobs (finished ones too).
    #[arg(value_name = "RUN_DIR")]
    pub run_dirs: Vec<PathBuf>,
    /// Print one frame as plain text and exit.
    #[arg(long)]
    pub once: bool,
    /// With --once: print the frame's model as one JSON object (fields in docs/outputs.md#watch---once---json).
    #[arg(long, requires = "once")]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// A run directory written by `memtrain run`.
    pub run_dir: PathBuf,
    /// An image folder (root/<class>/<image>) to evaluate on instead of the run's validation
    /// data; its classes are matched to the run's by name (classes.json).
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// The weights to evaluate: a model.safetensors or a checkpoint directory (default: the
    /// run's best checkpoint, else its newest).
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// Where to write the results (default: RUN_DIR/eval.json).
    #[arg(long, value_name = "OUT")]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct CleanArgs {
    /// End them: SIGTERM, then SIGKILL after the grace period. Without it, only list them.
    #[arg(long)]
    pub yes: bool,
    /// Act on this process instead of the orphaned memtrain runs (repeatable); it must be yours.
    #[arg(long = "pid", value_name = "PID")]
    pub pids: Vec<u32>,
    /// Seconds between SIGTERM and SIGKILL.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub grace: f64,
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
    /// Train data-parallel on N ranks on this machine (N CPU processes, or one per GPU); the
    /// effective batch stays global. Under torchrun, leave it out: the ranks join its group.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub nproc: Option<u32>,
    /// Override a memory.* spec key on one rank only, e.g. --rank-set 1:memory.limit=64MiB (repeatable).
    #[arg(long = "rank-set", value_name = "RANK:KEY=VALUE")]
    pub rank_set: Vec<String>,
}

#[derive(Debug, Args)]
pub struct FitArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// The memory budget, e.g. 4GiB (default: the spec's memory.limit/fraction, else the GPU's
    /// memory, or the host's available memory on the CPU).
    #[arg(long, value_name = "SIZE", conflicts_with = "fraction")]
    pub limit: Option<String>,
    /// The budget as a fraction of the GPU's memory.
    #[arg(long, value_name = "F")]
    pub fraction: Option<f64>,
    /// Headroom kept below the budget: probes run capped at the budget less this (10% or 512MiB).
    #[arg(long, value_name = "M", default_value = "10%")]
    pub margin: String,
    /// Optimizer steps per probe; the peak covers all, the throughput all but the first.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(i64).range(2..))]
    pub steps: i64,
    /// Try only this precision (repeatable). Default: fp32, mixed precision (bf16-mixed on the
    /// CPU, fp16-mixed on CUDA) and the spec's own.
    #[arg(long = "precision", value_name = "P")]
    pub precisions: Vec<String>,
    /// Activation checkpointing settings to try.
    #[arg(long, value_enum, default_value_t = Checkpointing::Both)]
    pub checkpointing: Checkpointing,
    /// Write the spec with the recommendation (and a --limit/--fraction budget) to this file.
    #[arg(long, value_name = "OUT.toml")]
    pub write: Option<PathBuf>,
    /// One JSON object on stdout (fields in docs/outputs.md#fit---json); the probe lines still go to stderr.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Checkpointing {
    Off,
    On,
    Both,
}
