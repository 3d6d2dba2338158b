//! The job spec's schema: every key, its type and its default. Validation lives in `validate.rs`.
use std::fmt;
use std::path::PathBuf;

pub use super::launch::{CudaGraph, OptimizerImpl};
use crate::host::Home;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

mod augment;
pub use augment::{Augment, ColorJitter, Normalize, ResizedCrop, Spread};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    #[serde(default)]
    pub job: Job,
    pub model: Model,
    #[serde(default)]
    pub data: Data,
    #[serde(default)]
    pub train: Train,
    #[serde(default)]
    pub memory: Memory,
    #[serde(default)]
    pub checkpoint: Checkpoint,
    #[serde(default)]
    pub log: Log,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Job {
    /// Names the run directory; empty means the spec file's stem.
    pub name: String,
    pub seed: i64,
    pub output_dir: PathBuf,
    pub device: Device,
    /// CPU threads for libtorch; 0 keeps libtorch's default.
    pub threads: i64,
}

impl Default for Job {
    fn default() -> Self {
        Job {
            name: String::new(),
            seed: 0,
            output_dir: "runs".into(),
            device: Device::Auto,
            threads: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Auto => write!(f, "auto"),
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|i| i.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("expected \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got \"{s}\"")),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Device {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// A byte count written as an integer or with a unit ("4GiB", "512MiB", "1.5GB").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn parse(s: &str) -> Result<Self, String> {
        if s.trim().starts_with('-') {
            return Err(format!("a size cannot be negative, got \"{s}\""));
        }
        parse_size::Config::new()
            .with_binary()
            .parse_size(s.trim())
            .map(ByteSize)
            .map_err(|e| format!("\"{s}\" is not a size ({e}); write it like \"4GiB\", \"512MiB\" or a byte count"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::human::human_bytes(self.0))
    }
}

impl Serialize for ByteSize {
    /// Exact, so a resolved spec reads back as the same number of bytes.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let b = self.0;
        match [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]
            .iter()
            .find(|(_, u)| b > 0 && b.is_multiple_of(*u))
        {
            Some((unit, u)) => s.collect_str(&format_args!("{}{unit}", b / u)),
            None => s.serialize_u64(b),
        }
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Text(String),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("expected a size: a byte count or a string like \"4GiB\" or \"512MiB\"")
        })? {
            Raw::Int(n) if n < 0 => Err(serde::de::Error::custom(format!("a size cannot be negative, got {n}"))),
            Raw::Int(n) => Ok(ByteSize(n as u64)),
            Raw::Text(t) => ByteSize::parse(&t).map_err(serde::de::Error::custom),
        }
    }
}

/// `[model]`: which preset, its initial weights, and its options. Each preset owns its options
/// table (`[model.<preset>]`): the model module parses, checks and fills in its defaults, so
/// adding a preset never touches the schema.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Model {
    pub preset: String,
    /// Initial weights by name: a safetensors file, a sharded checkpoint's index, or a Hugging
    /// Face model directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// Whose names `init_from` uses; `auto` tells them from the names themselves.
    #[serde(default, skip_serializing_if = "InitFormat::is_auto")]
    pub init_format: InitFormat,
    /// memtrain variable-name patterns (`*` any run of characters) that `init_from` leaves as
    /// the build initialised them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub init_skip: Vec<String>,
    /// Every other key of `[model]`: the preset's own table, and anything misplaced, which the
    /// preset registry reports.
    #[serde(flatten)]
    pub options: std::collections::BTreeMap<String, toml::Value>,
}

/// `model.init_format`: the library whose names a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InitFormat {
    #[default]
    Auto,
    Torchvision,
    Timm,
    Huggingface,
    OpenClip,
}

impl InitFormat {
    pub fn is_auto(&self) -> bool {
        *self == InitFormat::Auto
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataSource {
    Synthetic,
    Npz,
    Safetensors,
    Mnist,
    Cifar10,
    Imagefolder,
    /// A flat binary (or `.npy`) of token ids, cut into windows of `seq_len + 1` tokens.
    Tokens,
    /// JSON lines of text, tokenized by `data.tokenizer` into token windows.
    Jsonl,
}

impl DataSource {
    /// Whether the samples are token ids for a language model: `x` int64 `[seq_len]`, `y` the
    /// next tokens, int64 `[seq_len]`, -100 where a token carries no loss.
    pub fn is_tokens(self) -> bool {
        matches!(self, DataSource::Tokens | DataSource::Jsonl)
    }
}

/// `data.token_dtype`: how a flat token file stores its ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenDtype {
    Uint16,
    Uint32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Data {
    pub source: DataSource,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// A separate validation file; without it `val_fraction` of `path` is held out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_path: Option<PathBuf>,
    pub val_fraction: f64,
    /// Synthetic only: number of samples (training plus validation). Absent for file sources,
    /// whose files say how many; the loader fills in the default for synthetic data.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub samples: Option<i64>,
    /// Synthetic only: standard deviation of the noise added to the class signal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub noise: Option<f64>,
    /// imagefolder: images are resized to this height and width; 0 takes the model's.
    pub image_size: i64,
    /// Per-channel normalisation of image pixels in [0, 1]: x = (x - mean) / std. Empty: none.
    pub mean: Vec<f64>,
    pub std: Vec<f64>,
    /// Well-known mean and std by name, filled into `mean` and `std` when resolved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub normalize: Option<Normalize>,
    /// Random crop and flip of training images, seeded so that resume replays them.
    pub augment: Augment,
    /// Training batches gathered ahead of the step by the loader's threads; 0: in the step.
    pub prefetch: i64,
    /// Threads that decode images on the first pass and gather batches ahead; 0: one per core.
    pub workers: i64,
    /// Read the imagefolder cache and uncompressed npz/safetensors files through a memory map
    /// (the page cache holds what fits); false loads them whole into memory.
    pub memory_map: bool,
    /// imagefolder: where the decoded cache is kept; none: beside the tree.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
    /// Token sources: tokens a sample holds (the model's context).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<i64>,
    /// tokens: the ids' type in a flat binary file (an `.npy` header says its own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_dtype: Option<TokenDtype>,
    /// jsonl: the Hugging Face `tokenizer.json` that turns text into token ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// jsonl: the field of plain text, packed into windows with EOS between documents.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_field: Option<String>,
    /// jsonl: the fields of a prompt and its completion, one window a pair, loss on the
    /// completion alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_field: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_field: Option<String>,
    /// jsonl: the end-of-text token between documents; none: the tokenizer's, found by name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eos_id: Option<i64>,
}

impl Data {
    pub const SAMPLES: i64 = 512;
    pub const NOISE: f64 = 1.0;

    /// Synthetic data's sample count, as set or by default.
    pub fn synthetic_samples(&self) -> i64 {
        self.samples.unwrap_or(Self::SAMPLES)
    }

    pub fn synthetic_noise(&self) -> f64 {
        self.noise.unwrap_or(Self::NOISE)
    }

    /// Fills in the synthetic-only keys' defaults, so the resolved spec shows them, for
    /// synthetic data only: a file source's resolved spec keeps only the keys it reads.
    pub fn resolve(&mut self) {
        if self.source == DataSource::Synthetic {
            self.samples = Some(self.synthetic_samples());
            self.noise = Some(self.synthetic_noise());
        }
        // Named constants show as numbers in the resolved spec; a mean or std of its own set
        // beside the name is left for validation to refuse.
        if let Some(n) = self.normalize {
            let (mean, std) = n.constants();
            if self.mean.is_empty() && self.std.is_empty() {
                self.mean = mean.to_vec();
                self.std = std.to_vec();
            }
        }
    }

    /// Synthetic-only keys set for a file source, which reads every sample of its files. The
    /// defaults themselves pass: resolved specs once recorded them for every source.
    pub fn unread_synthetic_keys(&self) -> Vec<&'static str> {
        match self.source {
            DataSource::Synthetic => vec![],
            _ => [
                ("data.samples", self.samples.is_some_and(|n| n != Self::SAMPLES)),
                ("data.noise", self.noise.is_some_and(|x| x != Self::NOISE)),
            ]
            .into_iter()
            .filter_map(|(k, set)| set.then_some(k))
            .collect(),
        }
    }
}

impl Default for Data {
    fn default() -> Self {
        Data {
            source: DataSource::Synthetic,
            path: None,
            val_path: None,
            val_fraction: 0.2,
            samples: None,
            noise: None,
            image_size: 0,
            mean: vec![],
            std: vec![],
            normalize: None,
            augment: Augment::default(),
            prefetch: 2,
            workers: 0,
            memory_map: true,
            cache_dir: None,
            seq_len: None,
            token_dtype: None,
            tokenizer: None,
            text_field: None,
            prompt_field: None,
            completion_field: None,
            eos_id: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    Sgd,
    Adam,
    Adamw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Precision {
    /// Everything in fp32.
    #[serde(rename = "fp32")]
    Fp32,
    /// Autocast to fp16 for the run's device type, fp32 master weights and optimizer state,
    /// dynamic loss scaling.
    #[serde(rename = "fp16-mixed")]
    Fp16Mixed,
    /// Autocast to bf16, fp32 master weights and optimizer state; no loss scaling (bf16 has
    /// fp32's exponent range).
    #[serde(rename = "bf16-mixed")]
    Bf16Mixed,
    /// Weights, gradients, optimizer state and activations all in bf16.
    #[serde(rename = "bf16")]
    Bf16,
}

impl Precision {
    pub const ALL: [Precision; 4] = [
        Precision::Fp32,
        Precision::Fp16Mixed,
        Precision::Bf16Mixed,
        Precision::Bf16,
    ];

    /// Bytes per parameter, gradient and optimizer-state value.
    pub fn bytes(self) -> u64 {
        match self {
            Precision::Bf16 => 2,
            _ => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16Mixed => "fp16-mixed",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::Bf16 => "bf16",
        }
    }

    /// The dtype autocast runs in, for the mixed modes.
    pub fn autocast(self) -> Option<tch::Kind> {
        match self {
            Precision::Fp16Mixed => Some(tch::Kind::Half),
            Precision::Bf16Mixed => Some(tch::Kind::BFloat16),
            _ => None,
        }
    }

    pub fn scales_loss(self) -> bool {
        self == Precision::Fp16Mixed
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    Constant,
    Step,
    Cosine,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Train {
    pub epochs: i64,
    /// Micro-batch: samples per forward/backward.
    pub batch_size: i64,
    /// Micro-batches whose gradients are summed before one optimizer step.
    pub accumulation_steps: i64,
    /// Validation's micro-batch (default: `batch_size`). A validation OOM halves only this one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_batch_size: Option<i64>,
    pub optimizer: OptimizerKind,
    pub lr: f64,
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    /// Bits per stored Adam/AdamW moment value: 32, or 8 for block-wise quantized moments
    /// (Dettmers et al. 2022; fp32 parameters of at least 4096 values).
    pub optimizer_state_bits: u32,
    /// How the update is launched: one parameter at a time, foreach ops or fused kernels.
    pub optimizer_impl: OptimizerImpl,
    /// Whether the step is captured as a CUDA graph and replayed.
    pub cuda_graph: CudaGraph,
    /// Clip the global gradient norm to this value; 0 turns clipping off.
    pub grad_clip_norm: f64,
    pub precision: Precision,
    /// Keep only the activations at block boundaries and recompute each block in the backward
    /// pass (presets built as a sequence of blocks).
    pub activation_checkpointing: bool,
    /// Data-parallel: each parameter's optimizer state lives on one rank only (ZeRO stage 1).
    pub shard_optimizer_state: bool,
    pub schedule: Schedule,
    /// Optimizer steps of linear warmup from 0 to `lr`.
    pub warmup_steps: i64,
    /// Step schedule: multiply by `lr_gamma` every `lr_step_epochs` epochs.
    pub lr_step_epochs: i64,
    pub lr_gamma: f64,
    /// Cosine schedule: the rate it decays to.
    pub min_lr: f64,
    /// Name patterns of the parameters that do not train (no gradient, no optimizer state).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub freeze: Vec<String>,
    /// A BatchNorm layer whose weight and bias are both frozen runs in eval mode: its running
    /// statistics neither normalize the batch nor change.
    pub freeze_batchnorm_stats: bool,
    /// The epoch (1-based) at whose start the frozen parameters begin to train.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unfreeze_at_epoch: Option<i64>,
    /// Parameter groups by name pattern: the first group a parameter matches sets its learning
    /// rate scale and weight decay.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub param_groups: Vec<ParamGroup>,
    /// Biases, 1-D weights, class tokens and position embeddings take no weight decay.
    pub no_decay: bool,
    /// ViT layer-wise learning-rate decay: each block's rate is scaled by this per block above it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layer_decay: Option<f64>,
    /// The dtype frozen linear and convolution weights are kept in: "bf16" halves them in a
    /// bf16-mixed run, whose autocast reads them in bf16 anyway.
    pub frozen_dtype: FrozenDtype,
}

/// `[[train.param_groups]]`: the parameters whose names match one of `match`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamGroup {
    #[serde(rename = "match")]
    pub patterns: Vec<String>,
    #[serde(default = "one")]
    pub lr_scale: f64,
    /// None: `train.weight_decay` (with `no_decay`'s rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
}

fn one() -> f64 {
    1.0
}

impl Default for Train {
    fn default() -> Self {
        Train {
            epochs: 10,
            batch_size: 32,
            accumulation_steps: 1,
            eval_batch_size: None,
            optimizer: OptimizerKind::Adam,
            lr: 1e-3,
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            betas: [0.9, 0.999],
            eps: 1e-8,
            optimizer_state_bits: 32,
            optimizer_impl: OptimizerImpl::Auto,
            cuda_graph: CudaGraph::Off,
            grad_clip_norm: 0.0,
            precision: Precision::Fp32,
            activation_checkpointing: false,
            shard_optimizer_state: false,
            schedule: Schedule::Constant,
            warmup_steps: 0,
            lr_step_epochs: 10,
            lr_gamma: 0.1,
            min_lr: 0.0,
            freeze: Vec::new(),
            freeze_batchnorm_stats: true,
            unfreeze_at_epoch: None,
            param_groups: Vec::new(),
            no_decay: false,
            layer_decay: None,
            frozen_dtype: FrozenDtype::Fp32,
        }
    }
}

/// `train.frozen_dtype`: what frozen linear and convolution weights are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FrozenDtype {
    /// As the model's weights: fp32.
    #[default]
    Fp32,
    /// bf16: what bf16-mixed autocast casts them to for every matrix multiply and convolution,
    /// so the run computes the same; half the bytes.
    Bf16,
}

/// `memory.cache_clear_every`: a step count (0 = never) or "auto".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheClear {
    Every(u64),
    Auto,
}

impl Serialize for CacheClear {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            CacheClear::Every(n) => s.serialize_u64(*n),
            CacheClear::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for CacheClear {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Text(String),
        }
        let bad = || serde::de::Error::custom("expected a step count (0 = never) or \"auto\"");
        match Raw::deserialize(d).map_err(|_| bad())? {
            Raw::Int(n) if n >= 0 => Ok(CacheClear::Every(n as u64)),
            Raw::Int(n) => Err(serde::de::Error::custom(format!(
                "must be 0 (never), a positive step count or \"auto\", got {n}"
            ))),
            Raw::Text(t) if t == "auto" => Ok(CacheClear::Auto),
            Raw::Text(_) => Err(bad()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OomAction {
    /// Turn activation checkpointing on for the rest of the run and retry at the same micro-batch.
    Recompute,
    /// Move the next term of the bill that can go to host memory (optimizer state, then
    /// gradients, then activations) and retry at the same micro-batch.
    Offload,
    Backoff,
    Cpu,
    Fail,
}

impl OomAction {
    pub const ALL: [OomAction; 5] = [
        OomAction::Recompute,
        OomAction::Offload,
        OomAction::Backoff,
        OomAction::Cpu,
        OomAction::Fail,
    ];

    /// The spec's word for it, which is also the name of the lever it engages (all but "fail").
    pub fn name(self) -> &'static str {
        match self {
            OomAction::Recompute => "recompute",
            OomAction::Offload => "offload",
            OomAction::Backoff => "backoff",
            OomAction::Cpu => "cpu",
            OomAction::Fail => "fail",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Memory {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<ByteSize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f64>,
    pub cache_clear_every: CacheClear,
    /// "auto" clears when reserved-but-unallocated bytes exceed this.
    pub auto_clear_threshold: ByteSize,
    pub clear_on_epoch_end: bool,
    pub clear_after_checkpoint: bool,
    /// Synchronise the device every N steps (0 = never).
    pub sync_every: i64,
    pub on_oom: Vec<OomAction>,
    pub min_batch_size: i64,
    /// Double the micro-batch again after this many clean optimizer steps (0 = never).
    pub grow_back_after: i64,
    pub record_history: bool,
    pub preflight: bool,
    pub allocator: Allocator,
    /// Where each term of the bill lives: "device" (the default) or "host".
    pub optimizer_state: Home,
    pub gradients: Home,
    pub activations: Home,
    pub parameters: Home,
}

impl Default for Memory {
    fn default() -> Self {
        Memory {
            limit: None,
            fraction: None,
            cache_clear_every: CacheClear::Every(0),
            auto_clear_threshold: ByteSize(512 << 20),
            clear_on_epoch_end: false,
            clear_after_checkpoint: true,
            sync_every: 0,
            on_oom: vec![OomAction::Backoff, OomAction::Fail],
            min_batch_size: 1,
            grow_back_after: 0,
            record_history: false,
            preflight: true,
            allocator: Allocator::default(),
            optimizer_state: Home::Device,
            gradients: Home::Device,
            activations: Home::Device,
            parameters: Home::Device,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Allocator {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expandable_segments: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_split_size_mb: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub garbage_collection_threshold: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub roundup_power2_divisions: Option<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Monitor {
    ValLoss,
    ValAcc,
    TrainLoss,
}

impl Monitor {
    /// Whether a larger value is better.
    pub fn maximize(self) -> bool {
        matches!(self, Monitor::ValAcc)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Checkpoint {
    /// Save every N epochs (0 = only at the end and on interruption).
    pub every_epochs: i64,
    /// Also save within an epoch every N optimizer steps (0: never).
    pub every_steps: i64,
    /// Also save within an epoch once this many minutes have passed since the last save (0: never).
    pub every_minutes: f64,
    pub keep_last: i64,
    pub keep_best: bool,
    pub monitor: Monitor,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Checkpoint {
            every_epochs: 1,
            every_steps: 0,
            every_minutes: 0.0,
            keep_last: 2,
            keep_best: true,
            monitor: Monitor::ValLoss,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Progress {
    Auto,
    Bars,
    Lines,
    Off,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Log {
    /// A per-step record in metrics.jsonl every N optimizer steps (0 = none); its memory peaks
    /// cover every step since the previous record.
    pub every_steps: i64,
    pub progress: Progress,
    /// Also write the scalars as TensorBoard event files under `<run dir>/tensorboard/`.
    pub tensorboard: bool,
}

impl Default for Log {
    fn default() -> Self {
        Log {
            every_steps: 1,
            progress: Progress::Auto,
            tensorboard: false,
        }
    }
}
