//! memtrain: a training runner for PyTorch models (through tch) built around GPU memory.
//!
//! Data flows one way: spec → plan → components → step pipeline → events → records. The layers,
//! each using only those below it (`scripts/module-graph src` lists every circle, and a test
//! keeps that list empty):
//!
//! 1. commands: `main`, `cli`, `app` (hands each command its work), `info`, `fit`, `report`,
//!    `watch`, `clean`, `export`, and `run::run` (facts → plan → components → trainer → report);
//! 2. the job: `spec` (reading, overriding and validating the TOML), `plan` (`Facts::probe`, then
//!    a pure `Plan::resolve` that nothing changes afterwards), `estimate` (`check`);
//! 3. the run: `run`'s factory (`build::components`, from the plan alone), trainer, step
//!    pipeline, forward part and execution strategy; `parallel` (data-parallel groups);
//! 4. policy: `policy::levers` and `policy::recovery`, which decide and hold no tensors; `run`
//!    carries out their decisions, `report`, `fit` and `check` describe them;
//! 5. what a run is made of: `model` (presets), `weights` (other libraries' checkpoints, read
//!    for `model.init_from`), `data`, `optim`, `checkpoint`, `records`, `scaler`, `memory` and
//!    `oom`, `host`, `alloc_conf`, `progress`, `signals`, `readback`.
//!    Each reads only its own section of the spec's schema (`spec::schema`: plain data types),
//!    never the whole spec;
//! 6. the ground: `spec::schema` and `spec::error`, `shim` (the only C++ and the only caller of
//!    `torch_sys`), `sysmem`, `atomic`, `human`, `exit`, `fault`, `procs` (other processes, from
//!    /proc) and `registry` (the running memtrain processes, for `watch`, `info` and `clean`).
pub mod alloc_conf;
pub mod app;
pub mod atomic;
pub mod checkpoint;
pub mod clean;
pub mod cli;
pub mod data;
pub mod estimate;
pub mod eval;
pub mod exit;
pub mod export;
pub mod fault;
pub mod fit;
pub mod generate;
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
pub mod weights;
