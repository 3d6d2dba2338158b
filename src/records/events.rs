//! What the training loop tells the recorder. Each event is one `metrics.jsonl` line whose
//! `type` is the variant's snake_case name; `End` also becomes summary.json. Every event reads
//! back as it was written (`records::read`), so the report and fit use these types, not names.
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::alloc_conf::Conflict;
use crate::memory::{CachePolicy, Cap, Cleared, MemorySample, StepMemory};
use crate::model::Genotype;
use crate::oom::{Decision, OomCounts, OomKind};
use crate::spec::schema::Precision;

/// JSON has no NaN or infinity: serde_json writes them as null (a diverged loss), and they read
/// back as NaN.
fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    Prefetch(PrefetchEvent),
    Graph(GraphEvent),
    End(Summary),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    pub allocator_conflicts: Vec<Conflict>,
    pub train_samples: i64,
    pub val_samples: i64,
    pub libtorch: String,
    /// `train.optimizer_impl` as resolved for this session: "single", "foreach" or "fused".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_impl: Option<String>,
    /// The peaks of setting up (building the model, loading data and checkpoint), which the
    /// cap also covers; the step records' peaks start after them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub setup_peak_allocated_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub setup_peak_reserved_bytes: Option<u64>,
    /// What `model.init_from` loaded, when it is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<InitLoad>,
    /// `train.cuda_graph` as resolved for this session: "captured: ..." or "eager: <why>".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_graph: Option<String>,
}

/// What `model.init_from` did: memtrain variables filled from the checkpoint (kept) or left as
/// the build initialised them (created: a new head, `init_skip`), checkpoint tensors no variable
/// took (dropped), variables the checkpoint lacked (missing: always 0 in a run that started),
/// position embeddings resampled to the model's grid, and whose names the checkpoint used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitLoad {
    pub format: String,
    pub kept: u64,
    pub created: u64,
    pub dropped: u64,
    pub missing: u64,
    pub resampled: u64,
    /// The most anonymous host memory the load held above what the process held before it
    /// (the tensor being copied), and the checkpoint's largest tensor, which bounds it.
    pub peak_host_bytes: u64,
    pub largest_tensor_bytes: u64,
}

/// The first optimizer step of a session, measured against the cap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreflightEvent {
    pub micro_batch: i64,
    pub accumulation_steps: i64,
    pub peak_bytes: u64,
    /// What `peak_bytes` measures ("peak allocated", or "peak RSS" where tensors are not counted).
    pub measure: String,
    pub cap_bytes: Option<u64>,
    pub headroom_bytes: Option<i64>,
    pub device: String,
    /// CUDA: what this process holds on the card outside the caching allocator (the context,
    /// cuBLAS/cuDNN workspaces), which no cap covers; from NVML, when it reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beyond_cap_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepEvent {
    pub epoch: i64,
    pub step: i64,
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub lr: f64,
    pub micro_batch: i64,
    /// The step's samples (its group).
    pub samples: i64,
    /// The step's wall time, architecture step included: from the end of the previous step
    /// record's step (or the start of the epoch's steps) to the end of this one's, divided by
    /// the optimizer steps in between (1 when every step is logged). On CUDA both ends are timed
    /// events behind the steps' work, on the device's clock, so this covers the device's work,
    /// not only the host's; summed over an epoch's records with every step logged, it is the
    /// epoch's training time.
    #[serde(deserialize_with = "nan_if_null")]
    pub seconds: f64,
    /// The epoch's samples so far over its step time so far (the sum of its records' `seconds`).
    #[serde(deserialize_with = "nan_if_null")]
    pub samples_per_s: f64,
    /// Current figures after this step; peaks since the previous step line.
    pub memory: StepMemory,
    /// fp16-mixed: the scale this step's loss was multiplied by, and whether its gradients held
    /// inf or NaN so the optimizer step was skipped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    pub skipped: bool,
    /// Values read off the device since the previous step record (this one's loss included):
    /// each read makes the host wait for the device.
    #[serde(default)]
    pub host_reads: u64,
    /// With the optimizer state on the host: the CPU time of the update (the host updates of
    /// the steps since the previous step record), from the first write to the last upload
    /// issued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_update_seconds: Option<f64>,
    /// The time a step waited for its training batches (made ahead by the loader, or gathered
    /// in the step), averaged like `seconds` over the steps since the previous step record.
    #[serde(default)]
    pub data_wait_seconds: f64,
    /// A language model's step: its tokens, rate and perplexity (`loss` is then the mean over
    /// the step's counted target tokens).
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub language: Option<StepTokens>,
}

/// A language model's step figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepTokens {
    /// The step's counted target tokens (not ignored), which its loss is the mean over.
    pub tokens: u64,
    /// The run's counted target tokens so far, this step's included.
    pub tokens_seen: u64,
    /// The epoch's tokens so far over its step time so far, as `samples_per_s`.
    pub tokens_per_s: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
}

/// A language model's epoch figures.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EpochTokens {
    /// The run's counted target tokens so far.
    pub tokens_seen: u64,
    /// The epoch's counted target tokens over its training time.
    pub tokens_per_s: f64,
    /// `exp(train_loss)`, the training loss being the epoch's token mean.
    pub train_perplexity: f64,
    /// `exp(val_loss)`, the validation loss being the token mean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_perplexity: Option<f64>,
}

/// Per-epoch results, also the summary's `final`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochResult {
    pub epoch: i64,
    #[serde(deserialize_with = "nan_if_null")]
    pub train_loss: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub train_acc: f64,
    pub val_loss: Option<f64>,
    pub val_acc: Option<f64>,
    #[serde(deserialize_with = "nan_if_null")]
    pub seconds: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub samples_per_s: f64,
    /// A language model's run (`train_loss`, `val_loss` and the accuracies are then per counted
    /// target token).
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub language: Option<EpochTokens>,
}

/// One data-parallel rank's memory peaks, as rank 0 records them for every rank.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RankPeak {
    pub rank: usize,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub peak_rss_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochEvent {
    #[serde(flatten)]
    pub result: EpochResult,
    /// The samples this session trained in the epoch (a resumed epoch counts only its rest).
    #[serde(default)]
    pub samples: u64,
    /// The global optimizer step the epoch ended at.
    pub step: i64,
    #[serde(deserialize_with = "nan_if_null")]
    pub lr: f64,
    pub micro_batch: i64,
    pub accumulation_steps: i64,
    pub device: String,
    pub memory: MemorySample,
    pub cache: CacheCounters,
    pub genotype: Option<Genotype>,
    /// Data-parallel: every rank's peaks over the epoch, rank 0's included.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankPeak>,
    /// Values read off the device since the last step record: validation's and the epoch's sums.
    #[serde(default)]
    pub host_reads: u64,
    /// The time the epoch's steps waited for their training batches, in all.
    #[serde(default)]
    pub data_wait_seconds: f64,
}

impl std::ops::Deref for EpochEvent {
    type Target = EpochResult;
    fn deref(&self) -> &EpochResult {
        &self.result
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointEvent {
    pub reason: String,
    pub path: std::path::PathBuf,
    pub bytes: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub seconds: f64,
    pub spike_bytes: u64,
    pub epochs_completed: i64,
    pub step: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
#[derive(Debug, Clone, PartialEq)]
pub struct OomReport {
    pub allocator_stats: Option<Value>,
    pub memory: MemorySample,
    pub cap: Option<Cap>,
    pub allocator_conf: Option<String>,
    pub snapshot: Option<Vec<u8>>,
    pub record_history: bool,
}

/// oom/report.json: the run's first OOM, where it happened and the allocator's state then.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OomReportFile {
    pub phase: String,
    pub epoch: i64,
    pub step: i64,
    pub device: String,
    pub failing_batch_shape: Vec<i64>,
    pub micro_batch: i64,
    pub accumulation_steps: i64,
    pub error: String,
    pub allocator_stats: Option<Value>,
    pub memory: MemorySample,
    pub cap: Option<Cap>,
    pub allocator_conf: Option<String>,
    /// The snapshot's file name in oom/, where one was taken.
    pub snapshot: Option<String>,
    pub record_history: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GrowBackEvent {
    pub step: i64,
    pub micro_batch_before: i64,
    pub micro_batch: i64,
    /// Whose micro-batch grew: training's, or validation's own (records from before validation
    /// had one say neither: training's).
    #[serde(default)]
    pub micro_batch_of: MicroBatchOf,
}

/// Training and validation each have a micro-batch of their own.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MicroBatchOf {
    #[default]
    Training,
    Validation,
}

/// The data loader gave up prefetch depth because available RAM ran low.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefetchEvent {
    /// The global step after which it was recorded.
    pub step: i64,
    pub prefetch_before: i64,
    pub prefetch: i64,
    /// Available RAM (MemAvailable) when the depth was given up.
    pub available_bytes: u64,
}

/// A step shape was captured as a CUDA graph, or a step that could have been runs eager from
/// now on, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GraphEvent {
    /// The global step it happened at (the captured step is this one).
    pub step: i64,
    /// "weights", or "architecture" for DARTS's architecture step.
    pub of: String,
    pub micro_batch: i64,
    /// Micro-batches per step in the captured graph.
    pub micro_batches: i64,
    /// "captured", or "eager".
    pub action: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What the graph's private memory pool holds between replays (the device's reserved
    /// memory grew by this much during the capture).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheClearEvent {
    pub step: i64,
    #[serde(flatten)]
    pub cleared: Cleared,
}

/// How a run ended, for summary.json and the exit code.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
    /// As summary.json spells it.
    pub fn name(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            Status::Interrupted => "interrupted",
            Status::Oom => "oom",
            Status::StepLimit => "step_limit",
        }
    }

    pub fn exit_code(self) -> i32 {
        match self {
            Status::Completed | Status::StepLimit => crate::exit::OK,
            Status::Interrupted => crate::exit::INTERRUPTED,
            Status::Oom => crate::exit::OOM,
        }
    }
}

#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchSummary {
    pub configured_micro_batch: i64,
    pub configured_accumulation_steps: i64,
    pub effective_batch: i64,
    pub final_micro_batch: i64,
    pub final_accumulation_steps: i64,
}

#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemorySummary {
    pub cap: Option<Cap>,
    pub allocator_conf: Option<String>,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    /// CUDA's native allocator: the peak of the bytes tensors asked for, before the allocator
    /// rounded them to its blocks (most of the gap to `peak_allocated_bytes`; a block freed
    /// while another stream still uses it counts as requested until that use ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_requested_bytes: Option<u64>,
    pub peak_rss_bytes: u64,
    /// Peak host tensor bytes: what the memory levers moved off the device (CPU runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_host_bytes: Option<u64>,
    /// The per-step memory readings and the time they took, to show they cost next to nothing.
    pub step_readings: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub step_reading_seconds: f64,
    /// Data-parallel: every rank's peaks over the run, rank 0's included.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankPeak>,
}

#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointSummary {
    pub saved: usize,
    pub max_spike_bytes: Option<u64>,
}

#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub status: Status,
    pub exit_code: i32,
    pub job: String,
    pub device: String,
    pub epochs_completed: i64,
    pub global_steps: i64,
    pub samples_trained: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub wall_seconds: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub train_seconds: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub samples_per_s: f64,
    #[serde(rename = "final")]
    pub last: Option<EpochResult>,
    pub batch: BatchSummary,
    pub memory: MemorySummary,
    pub cache: Option<CacheCounters>,
    pub oom: OomCounts,
    pub checkpoints: CheckpointSummary,
    pub precision: PrecisionSummary,
    /// Values this session read off the device, every phase together (see the step and epoch
    /// records' own counts).
    #[serde(default)]
    pub host_reads: u64,
    /// What trained: the parameter groups and the frozen parameters (absent in summaries from
    /// before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training: Option<Box<TrainingSummary>>,
    /// What `model.init_from` loaded at this session's start, when it is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<Box<InitLoad>>,
}

/// The weights by what they train with, and what training them costs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainingSummary {
    pub trainable_parameters: u64,
    /// Parameters `train.freeze` kept from training at the end (0 once unfrozen).
    pub frozen_parameters: u64,
    /// One step's gradients: the bytes of every parameter that trains.
    pub gradient_bytes: u64,
    /// The optimizer state this process holds.
    pub optimizer_state_bytes: u64,
    pub groups: Vec<GroupLine>,
}

impl TrainingSummary {
    /// The groups in one line per group, as the run and `memtrain report` print them.
    pub fn lines(&self) -> Vec<String> {
        let t = self;
        let mut out: Vec<String> = t
            .groups
            .iter()
            .map(|g| {
                format!(
                    "group {}: {} parameters in {} tensors, lr x{}, weight decay {}{}",
                    g.name,
                    crate::human::human_count(g.parameters),
                    g.tensors,
                    g.lr_scale,
                    g.weight_decay,
                    match g.start_step {
                        0 => String::new(),
                        s => format!(", training from step {}", s + 1),
                    }
                )
            })
            .collect();
        if t.frozen_parameters > 0 {
            out.push(format!(
                "frozen: {} parameters, not trained (train.freeze, or the base under model.lora)",
                crate::human::human_count(t.frozen_parameters)
            ));
        }
        out
    }
}

/// One parameter group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupLine {
    pub name: String,
    pub parameters: u64,
    pub tensors: usize,
    /// Multiplies the scheduled learning rate (`train.lr`).
    pub lr_scale: f64,
    pub weight_decay: f64,
    /// The optimizer step count its parameters started training at (0, or when unfrozen).
    pub start_step: i64,
}

/// The cache-clearing counters as records carry them (the policy itself stays with the run).
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CacheCounters {
    pub clears: u64,
    pub auto_clears: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub clear_seconds: f64,
    pub syncs: u64,
    #[serde(deserialize_with = "nan_if_null")]
    pub sync_seconds: f64,
}

impl From<&CachePolicy> for CacheCounters {
    fn from(p: &CachePolicy) -> Self {
        CacheCounters {
            clears: p.clears,
            auto_clears: p.auto_clears,
            clear_seconds: p.clear_seconds,
            syncs: p.syncs,
            sync_seconds: p.sync_seconds,
        }
    }
}

/// How the run computed: precision, the loss scaler's state, recomputation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrecisionSummary {
    pub mode: Precision,
    /// fp16-mixed: the scale at the end, and the optimizer steps skipped on inf/NaN.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    pub skipped_steps: u64,
    pub activation_checkpointing: bool,
    /// The optimizer implementation at the end ("single" once an offload moved the state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_impl: Option<String>,
}

/// A summary nobody filled in yet computes in the spec's default precision.
impl Default for PrecisionSummary {
    fn default() -> Self {
        PrecisionSummary {
            mode: Precision::Fp32,
            loss_scale: None,
            skipped_steps: 0,
            activation_checkpointing: false,
            optimizer_impl: None,
        }
    }
}
