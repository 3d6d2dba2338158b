//! memtrain: a training runner for PyTorch models (through tch) built around GPU memory.
//! Data flows one way: spec → plan → run → records.
pub mod alloc_conf;
pub mod app;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod estimate;
pub mod exit;
pub mod info;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod oom;
pub mod optim;
pub mod progress;
pub mod report;
pub mod run;
pub mod shim;
pub mod signals;
pub mod spec;
pub mod sysmem;
pub mod train;
