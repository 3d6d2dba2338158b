//! Events as a run writes them, for the tests of the records and of their readers.
use super::events::*;
use crate::alloc_conf::Conflict;
use crate::memory::{Cap, ClearReason, Cleared, MemorySample, StepMemory};
use crate::model::Genotype;
use crate::oom::{BatchShape, Decision, OomCounts, OomKind};
use crate::spec::schema::Precision;

pub fn start(step: i64, resumed: bool, cap_bytes: Option<u64>) -> StartEvent {
    StartEvent {
        job: "j".into(),
        step,
        device: "cpu".into(),
        resumed,
        micro_batch: 8,
        accumulation_steps: 1,
        effective_batch: 8,
        cap: cap_bytes.map(|bytes| Cap {
            kind: "cpu_tensor_bytes".into(),
            bytes,
            fraction: Some(0.5),
        }),
        allocator_conf: Some("expandable_segments:True".into()),
        allocator_conflicts: vec![Conflict {
            key: "expandable_segments".into(),
            environment: "False".into(),
            spec: "True".into(),
        }],
        train_samples: 48,
        val_samples: 12,
        libtorch: "2.11.0".into(),
        optimizer_impl: Some("single".into()),
        setup_peak_allocated_bytes: Some(1000),
        setup_peak_reserved_bytes: None,
        init: None,
        cuda_graph: None,
    }
}

pub fn step(step: i64, loss: f64, allocated: u64, peak_allocated: u64) -> StepEvent {
    StepEvent {
        epoch: 1,
        step,
        loss,
        lr: 0.1,
        micro_batch: 8,
        samples: 8,
        seconds: 0.25,
        samples_per_s: 32.0,
        memory: StepMemory {
            allocated_bytes: Some(allocated),
            reserved_bytes: None,
            peak_allocated_bytes: Some(peak_allocated),
            peak_reserved_bytes: None,
            peak_requested_bytes: None,
            host_bytes: Some(64),
            peak_host_bytes: Some(128),
            rss_bytes: 9,
        },
        loss_scale: Some(65536.0),
        skipped: false,
        host_reads: 1,
        host_update_seconds: None,
        data_wait_seconds: 0.05,
        language: None,
    }
}

pub fn epoch(step: i64, val_acc: f64) -> EpochEvent {
    EpochEvent {
        result: EpochResult {
            epoch: 1,
            train_loss: 1.7,
            train_acc: 0.5,
            val_loss: Some(1.6),
            val_acc: Some(val_acc),
            seconds: 2.0,
            samples_per_s: 24.0,
            language: None,
        },
        samples: 48,
        step,
        lr: 0.1,
        micro_batch: 8,
        accumulation_steps: 1,
        device: "cpu".into(),
        memory: MemorySample {
            allocated_bytes: Some(100),
            reserved_bytes: Some(200),
            peak_allocated_bytes: Some(400),
            peak_reserved_bytes: Some(500),
            peak_requested_bytes: Some(390),
            device_free_bytes: Some(1 << 30),
            device_total_bytes: Some(2 << 30),
            num_alloc_retries: Some(0),
            host_bytes: Some(64),
            peak_host_bytes: Some(128),
            rss_bytes: 9,
            peak_rss_bytes: 10,
        },
        cache: CacheCounters {
            clears: 1,
            auto_clears: 0,
            clear_seconds: 0.5,
            syncs: 2,
            sync_seconds: 0.25,
        },
        genotype: Some(Genotype {
            normal: vec![vec![("sep_conv_3x3".into(), 0), ("skip_connect".into(), 1)]],
            reduce: vec![vec![("max_pool_3x3".into(), 1), ("none".into(), 0)]],
        }),
        ranks: vec![rank_peak(0), rank_peak(1)],
        host_reads: 2,
        data_wait_seconds: 0.25,
    }
}

fn rank_peak(rank: usize) -> RankPeak {
    RankPeak {
        rank,
        peak_allocated_bytes: Some(400 + rank as u64),
        peak_reserved_bytes: None,
        peak_rss_bytes: 10,
    }
}

pub fn oom(step: i64, decision: Decision) -> OomEvent {
    OomEvent {
        epoch: 1,
        step,
        phase: "backward".into(),
        kind: OomKind::Cpu,
        error: "CPU cap\nException raised from alloc_cpu at alloc.cpp:1".into(),
        batch_shape: vec![8, 64],
        device: "cpu".into(),
        micro_batch_before: 8,
        accumulation_before: 1,
        decision,
        skipped: vec!["recompute: the mlp preset is not a sequence of blocks".into()],
        report: None,
    }
}

pub fn backoff() -> Decision {
    Decision {
        action: "backoff".into(),
        to: Some(BatchShape {
            micro_batch: 4,
            accumulation_steps: 2,
        }),
    }
}

fn engaged(action: &str) -> Decision {
    Decision {
        action: action.into(),
        to: None,
    }
}

pub fn cache_clear(step: i64) -> CacheClearEvent {
    CacheClearEvent {
        step,
        cleared: Cleared {
            reason: ClearReason::Every,
            seconds: 0.5,
            released_bytes: Some(2048),
        },
    }
}

pub fn checkpoint(step: i64) -> CheckpointEvent {
    CheckpointEvent {
        reason: "epoch".into(),
        path: "checkpoints/step-000000005".into(),
        bytes: 4096,
        seconds: 0.125,
        spike_bytes: 64,
        epochs_completed: 1,
        step,
    }
}

pub fn preflight() -> PreflightEvent {
    PreflightEvent {
        micro_batch: 8,
        accumulation_steps: 1,
        peak_bytes: 400,
        measure: "peak allocated".into(),
        cap_bytes: Some(1000),
        headroom_bytes: Some(600),
        device: "cpu".into(),
        beyond_cap_bytes: Some(300 << 20),
    }
}

pub fn summary(status: Status, global_steps: i64) -> Summary {
    Summary {
        status,
        exit_code: status.exit_code(),
        job: "j".into(),
        device: "cpu".into(),
        epochs_completed: 1,
        global_steps,
        samples_trained: 48,
        wall_seconds: 3.0,
        train_seconds: 2.0,
        samples_per_s: 24.0,
        last: Some(epoch(global_steps, 0.6).result),
        batch: BatchSummary {
            configured_micro_batch: 8,
            configured_accumulation_steps: 1,
            effective_batch: 8,
            final_micro_batch: 4,
            final_accumulation_steps: 2,
        },
        memory: MemorySummary {
            cap: start(0, false, Some(1000)).cap,
            allocator_conf: None,
            peak_allocated_bytes: Some(400),
            peak_reserved_bytes: None,
            peak_requested_bytes: Some(390),
            peak_rss_bytes: 10,
            peak_host_bytes: Some(128),
            step_readings: 6,
            step_reading_seconds: 1e-5,
            ranks: vec![rank_peak(0)],
        },
        cache: Some(epoch(global_steps, 0.6).cache),
        oom: OomCounts {
            events: 1,
            engaged: [("recomputes", 0), ("backoffs", 1), ("cpu_fallbacks", 0)]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            grow_backs: 1,
            eval_backoffs: 1,
            eval_grow_backs: 1,
        },
        checkpoints: CheckpointSummary {
            saved: 1,
            max_spike_bytes: Some(64),
        },
        precision: PrecisionSummary {
            mode: Precision::Fp16Mixed,
            loss_scale: Some(32768.0),
            skipped_steps: 1,
            activation_checkpointing: true,
            optimizer_impl: Some("fused".into()),
        },
        host_reads: 5,
        training: None,
        init: None,
    }
}

/// One event of every kind, every OOM decision among them, in an order a run could write.
pub fn every_kind() -> Vec<Event> {
    vec![
        Event::Start(start(0, false, Some(1000))),
        Event::Preflight(preflight()),
        Event::Step(step(1, 2.0, 100, 400)),
        Event::Oom(oom(1, engaged("recompute"))),
        Event::Oom(oom(1, backoff())),
        Event::Oom(oom(1, engaged("move_to_cpu"))),
        Event::Oom(OomEvent {
            phase: "validation".into(),
            accumulation_before: 1,
            ..oom(
                1,
                Decision {
                    action: Decision::EVAL_BACKOFF.into(),
                    to: Some(BatchShape {
                        micro_batch: 4,
                        accumulation_steps: 1,
                    }),
                },
            )
        }),
        Event::Step(step(2, 1.5, 120, 300)),
        Event::CacheClear(cache_clear(2)),
        Event::GrowBack(GrowBackEvent {
            step: 2,
            micro_batch_before: 4,
            micro_batch: 8,
            micro_batch_of: MicroBatchOf::Training,
        }),
        Event::GrowBack(GrowBackEvent {
            step: 2,
            micro_batch_before: 16,
            micro_batch: 32,
            micro_batch_of: MicroBatchOf::Validation,
        }),
        Event::Epoch(epoch(2, 0.6)),
        Event::Checkpoint(checkpoint(2)),
        Event::Oom(oom(3, Decision::fail())),
        Event::End(summary(Status::Oom, 3)),
    ]
}

/// metrics.jsonl's text for these events.
pub fn lines(events: &[Event]) -> String {
    events
        .iter()
        .map(|e| serde_json::to_string(e).unwrap() + "\n")
        .collect()
}
