//! What the training loop tells the recorder. Each event is one `metrics.jsonl` line whose
//! `type` is the variant's snake_case name; `End` also becomes summary.json.
use serde::Serialize;
use serde_json::Value;

use crate::memory::{CachePolicy, Cap, Cleared, MemorySample, StepMemory};
use crate::model::Genotype;
use crate::oom::{Decision, OomCounts, OomKind};

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    Start(StartEvent),
    Preflight(PreflightEvent),
    Step(StepEvent),
    Epoch(EpochEvent),
    Checkpoint(CheckpointEvent),
    Oom(OomEvent),
    GrowBack(GrowBackEvent),
    CacheClear(CacheClearEvent),
    End(Summary),
}

#[derive(Debug, Clone, Serialize)]
pub struct StartEvent {
    pub job: String,
    /// The global step the session starts from (0, or the checkpoint's when resuming).
    pub step: i64,
    pub device: String,
    pub resumed: bool,
    pub micro_batch: i64,
    pub accumulation_steps: i64,
    pub effective_batch: i64,
    pub cap: Option<Cap>,
    pub allocator_conf: Option<String>,
    pub allocator_conflicts: Value,
    pub train_samples: i64,
    pub val_samples: i64,
    pub libtorch: String,
    /// The peaks of setting up (building the model, loading data and checkpoint), which the
    /// cap also covers; the step records' peaks start after them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub setup_peak_allocated_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub setup_peak_reserved_bytes: Option<u64>,
}

/// The first optimizer step of a session, measured against the cap.
#[derive(Debug, Clone, Serialize)]
pub struct PreflightEvent {
    pub micro_batch: i64,
    pub accumulation_steps: i64,
    pub peak_bytes: u64,
    /// What `peak_bytes` measures ("peak allocated", or "peak RSS" where tensors are not counted).
    pub measure: &'static str,
    pub cap_bytes: Option<u64>,
    pub headroom_bytes: Option<i64>,
    pub device: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepEvent {
    pub epoch: i64,
    pub step: i64,
    pub loss: f64,
    pub lr: f64,
    pub micro_batch: i64,
    /// The step's samples (its group) and its wall time, architecture step included.
    pub samples: i64,
    pub seconds: f64,
    pub samples_per_s: f64,
    /// Current figures after this step; peaks since the previous step line.
    pub memory: StepMemory,
    /// fp16-mixed: the scale this step's loss was multiplied by, and whether its gradients held
    /// inf or NaN so the optimizer step was skipped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    pub skipped: bool,
}

/// Per-epoch results, also the summary's `final`.
#[derive(Debug, Default, Clone, Serialize)]
pub struct EpochResult {
    pub epoch: i64,
    pub train_loss: f64,
    pub train_acc: f64,
    pub val_loss: Option<f64>,
    pub val_acc: Option<f64>,
    pub seconds: f64,
    pub samples_per_s: f64,
}

/// One data-parallel rank's memory peaks, as rank 0 records them for every rank.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RankPeak {
    pub rank: usize,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub peak_rss_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct EpochEvent {
    #[serde(flatten)]
    pub result: EpochResult,
    /// The global optimizer step the epoch ended at.
    pub step: i64,
    pub lr: f64,
    pub micro_batch: i64,
    pub accumulation_steps: i64,
    pub device: String,
    pub memory: MemorySample,
    pub cache: CachePolicy,
    pub genotype: Option<Genotype>,
    /// Data-parallel: every rank's peaks over the epoch, rank 0's included.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankPeak>,
}

impl std::ops::Deref for EpochEvent {
    type Target = EpochResult;
    fn deref(&self) -> &EpochResult {
        &self.result
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct CheckpointEvent {
    pub reason: String,
    pub path: std::path::PathBuf,
    pub bytes: u64,
    pub seconds: f64,
    pub spike_bytes: u64,
    pub epochs_completed: i64,
    pub step: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct OomEvent {
    pub epoch: i64,
    pub step: i64,
    pub phase: String,
    pub kind: OomKind,
    pub error: String,
    pub batch_shape: Vec<i64>,
    pub device: String,
    pub micro_batch_before: i64,
    pub accumulation_before: i64,
    pub decision: Decision,
    pub skipped: Vec<String>,
    /// Present on the run's first OOM: the recorder writes it to `oom/`.
    #[serde(skip)]
    pub report: Option<OomReport>,
}

/// What `oom/report.json` adds to the event, and the CUDA allocator snapshot.
#[derive(Debug, Clone)]
pub struct OomReport {
    pub allocator_stats: Option<Value>,
    pub memory: MemorySample,
    pub cap: Option<Cap>,
    pub allocator_conf: Option<String>,
    pub snapshot: Option<Vec<u8>>,
    pub record_history: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct GrowBackEvent {
    pub step: i64,
    pub micro_batch_before: i64,
    pub micro_batch: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CacheClearEvent {
    pub step: i64,
    #[serde(flatten)]
    pub cleared: Cleared,
}

/// How a run ended, for summary.json and the exit code.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    #[default]
    Completed,
    Interrupted,
    Oom,
    /// `--max-steps` reached: a smoke test or a `fit` probe; no checkpoint is written.
    StepLimit,
}

impl Status {
    pub fn exit_code(self) -> i32 {
        match self {
            Status::Completed | Status::StepLimit => crate::exit::OK,
            Status::Interrupted => crate::exit::INTERRUPTED,
            Status::Oom => crate::exit::OOM,
        }
    }
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct BatchSummary {
    pub configured_micro_batch: i64,
    pub configured_accumulation_steps: i64,
    pub effective_batch: i64,
    pub final_micro_batch: i64,
    pub final_accumulation_steps: i64,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct MemorySummary {
    pub cap: Option<Cap>,
    pub allocator_conf: Option<String>,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub peak_rss_bytes: u64,
    /// The per-step memory readings and the time they took, to show they cost next to nothing.
    pub step_readings: u64,
    pub step_reading_seconds: f64,
    /// Data-parallel: every rank's peaks over the run, rank 0's included.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankPeak>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct CheckpointSummary {
    pub saved: usize,
    pub max_spike_bytes: Option<u64>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Summary {
    pub status: Status,
    pub exit_code: i32,
    pub job: String,
    pub device: String,
    pub epochs_completed: i64,
    pub global_steps: i64,
    pub samples_trained: u64,
    pub wall_seconds: f64,
    pub train_seconds: f64,
    pub samples_per_s: f64,
    #[serde(rename = "final")]
    pub last: Option<EpochResult>,
    pub batch: BatchSummary,
    pub memory: MemorySummary,
    pub cache: Option<CachePolicy>,
    pub oom: OomCounts,
    pub checkpoints: CheckpointSummary,
    pub precision: PrecisionSummary,
}

/// How the run computed: precision, the loss scaler's state, recomputation.
#[derive(Debug, Default, Clone, Serialize)]
pub struct PrecisionSummary {
    pub mode: &'static str,
    /// fp16-mixed: the scale at the end, and the optimizer steps skipped on inf/NaN.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    pub skipped_steps: u64,
    pub activation_checkpointing: bool,
}
