//! What a run is made of, built once by `build` from the plan and handed to the trainer as one
//! value: the loop's settings, the parts (model, architecture step), the data, the step
//! pipeline, recovery, where records and checkpoints go, and the execution strategy.
use super::execution::Execution;
use super::parts::{ArchStep, Trained};
use super::step::StepPipeline;
use crate::checkpoint::{Store, TrainState};
use crate::data::Splits;
use crate::memory::{CachePolicy, Cap};
use crate::policy::recovery::Recovery;
use crate::progress::Progress;
use crate::records::Recorder;
use crate::spec::Monitor;

/// The loop's settings, taken from the spec once.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    pub epochs: i64,
    pub seed: i64,
    pub log_every: i64,
    pub checkpoint_every: i64,
    /// `checkpoint.every_steps` and `every_minutes`: saves within an epoch.
    pub checkpoint_steps: i64,
    pub checkpoint_minutes: f64,
    pub monitor: Monitor,
    pub clear_on_epoch_end: bool,
    pub clear_after_checkpoint: bool,
    pub preflight: bool,
    pub record_history: bool,
    /// `--max-steps`: stop after this many optimizer steps of this session.
    pub max_steps: Option<i64>,
    /// The resolved spec, as checkpoints keep it.
    pub spec_toml: String,
    pub cap: Option<Cap>,
    pub alloc_conf: Option<String>,
}

/// Where a run's outcomes go: the records, the terminal, checkpoints, and the cache policy
/// that decides when cached device memory is given back.
pub struct Outputs {
    pub recorder: Recorder,
    pub progress: Progress,
    pub store: Store,
    pub cache: CachePolicy,
}

/// Everything the trainer is built from.
pub struct Components {
    pub settings: LoopSettings,
    pub model: Trained,
    pub arch: Option<ArchStep>,
    pub data: Splits,
    pub pipeline: StepPipeline,
    pub recovery: Recovery,
    pub execution: Execution,
    pub out: Outputs,
    pub state: TrainState,
}
