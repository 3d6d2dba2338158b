//! memtrain: a training runner for PyTorch models (through tch) built around GPU memory.
//!
//! Data flows one way: `spec` → `plan` → `run` → `records`. Below them, with no knowledge of
//! those above: `model` (presets), `data`, `optim`, `checkpoint`, `memory` and `oom`, `shim`
//! (the only C++), and small helpers. `app` hands each command its work.
pub mod alloc_conf;
pub mod app;
pub mod atomic;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod dist;
pub mod estimate;
pub mod exit;
pub mod fault;
pub mod fit;
pub mod human;
pub mod info;
pub mod memory;
pub mod model;
pub mod oom;
pub mod optim;
pub mod plan;
pub mod progress;
pub mod records;
pub mod report;
pub mod run;
pub mod scaler;
pub mod shim;
pub mod signals;
pub mod spec;
pub mod sysmem;
