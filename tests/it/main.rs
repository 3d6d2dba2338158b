//! The integration tests, as one test binary: one link against libtorch for all of them. Each
//! module drives the built `memtrain` the way a user does, through the fixture in `common`.
mod common;

mod bench;
mod cpu_allocator;
mod data;
mod distributed;
mod docs;
mod eval;
mod finetune_data;
mod finetune_groups;
mod fit;
mod foundation;
mod generate;
mod gpu_check;
mod llama;
mod lm_loss;
mod lora;
mod lora_presets;
mod models;
mod oom;
mod optim8;
mod oracle;
mod phases;
mod placement;
mod placement_stream;
mod precision;
mod reads;
mod report;
mod structure;
mod tokens;
mod training;
mod validation;
mod watch;
mod weights;
