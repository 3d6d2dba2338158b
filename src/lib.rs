//! memtrain: a training runner for PyTorch models (through tch) built around GPU memory.
//!
//! Data flows one way: spec → plan → components → step pipeline → events → records. The layers,
//! each using only those below it (`scripts/module-graph` shows there is no circle):
//!
//! 1. commands: `main`, `cli`, `app` (hands each command its work), `info`, `fit`, `report`,
//!    `watch`, `clean`, and `run::run` (plan → build → train → report);
//! 2. the job: `spec` (reading, overriding and validating the TOML), `plan` (pure: what the run
//!    will be), `estimate` (`check`);
//! 3. the run's parts: `run`'s build, components, levers, recovery, step pipeline, forward part
//!    and execution strategy; `dist` (data-parallel groups);
//! 4. what a run is made of: `model` (presets), `data`, `optim`, `checkpoint`, `records`,
//!    `scaler`, `memory` and `oom`, `alloc_conf`, `progress`, `signals`.
//!    Each reads only its own section of the spec's schema (`spec::Model`, `spec::Data`,
//!    `spec::Train`: plain data types), never the whole spec;
//! 5. the ground: `shim` (the only C++ and the only caller of `torch_sys`), `sysmem`, `atomic`,
//!    `human`, `exit`, `fault`, `procs` (other processes, from /proc) and `registry` (the
//!    running memtrain processes, for `watch`, `info` and `clean`).
pub mod alloc_conf;
pub mod app;
pub mod atomic;
pub mod checkpoint;
pub mod clean;
pub mod cli;
pub mod data;
pub mod estimate;
pub mod exit;
pub mod fault;
pub mod fit;
pub mod host;
pub mod human;
pub mod info;
pub mod memory;
pub mod model;
pub mod oom;
pub mod optim;
pub mod parallel;
pub mod plan;
pub mod policy;
pub mod procs;
pub mod progress;
pub mod readback;
pub mod records;
pub mod registry;
pub mod report;
pub mod run;
pub mod scaler;
pub mod shim;
pub mod signals;
pub mod spec;
pub mod sysmem;
pub mod watch;
