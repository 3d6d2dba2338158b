//! A llama full fine-tune with its decoder layers streamed from host memory
//! (`memory.parameters = "host"`): the output projection (the tied embedding, which the
//! embedding lookup reads first) trains on the device with its update on the host. Exact on the
//! CPU, and a model whose fp32 full fine-tune cannot fit a cap trains under it.
use std::path::Path;

use crate::common::*;
use crate::placement_stream::{peak, streamed};

/// `n` token ids below `vocab`, a pattern the model can learn, as uint16 in `dir/train.bin`.
fn token_file(dir: &Path, n: u32, vocab: u32) {
    let ids: Vec<u8> = (0..n)
        .flat_map(|i| (((i * 7 + (i * i) % 13) % vocab) as u16).to_le_bytes())
        .collect();
    std::fs::write(dir.join("train.bin"), &ids).unwrap();
}

/// A full fine-tune of the `[model.llama]` body on `dir/train.bin`, one epoch, AdamW.
fn job(t: &Test, llama: &str, seq_len: i64, train: &str) -> Test {
    t.clone().spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\npreset = \"llama\"\n[model.llama]\n{llama}\nseq_len = {seq_len}\n\
         [data]\nsource = \"tokens\"\npath = \"{}\"\ntoken_dtype = \"uint16\"\nseq_len = {seq_len}\nval_fraction = 0.1\n\
         [train]\nepochs = 1\noptimizer = \"adamw\"\nlr = 0.003\nweight_decay = 0.01\n{train}\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        t.dir().join("train.bin").display()
    )))
}

/// The output projection trains while the layers stream, untied and tied: the per-step losses,
/// final weights and optimizer state equal the unstreamed run's bit for bit. With accumulation
/// (a tied embedding's two gradients of a micro-batch, from the loss and from the lookup, add
/// up before the step's sum, as in one backward) and clipping. `check` counts the projection
/// and its gradient on the device.
#[test]
fn a_full_fine_tune_streams_its_layers_and_trains_its_output_projection_exactly() {
    for tie in [false, true] {
        let t = Test::new();
        token_file(t.dir(), 480, 96);
        let llama = format!(
            "vocab_size = 96\nhidden_size = 32\nintermediate_size = 48\nnum_hidden_layers = 2\n\
             num_attention_heads = 4\nnum_key_value_heads = 2\ntie_word_embeddings = {tie}"
        );
        let train = "batch_size = 2\naccumulation_steps = 2\ngrad_clip_norm = 1.0\noptimizer_impl = \"single\"";
        let t = job(&t, &llama, 16, train);
        let plain = t.clone().name("plain").run();
        let s = streamed(&t).run();
        assert!(!s.stderr.contains("cannot stream"), "tie {tie}: {}", s.stderr);
        assert!(step_losses(&plain).len() >= 6, "tie {tie}");
        assert_eq!(step_losses(&s), step_losses(&plain), "tie {tie}: losses");
        assert_eq!(s.final_bytes(), plain.final_bytes(), "tie {tie}: final weights");
        let state = |o: &Outcome| file_bytes(&o.final_model().with_file_name("optimizer.safetensors"));
        assert_eq!(state(&s), state(&plain), "tie {tie}: optimizer state");
        let levers = s.final_state()["levers"].clone();
        assert_eq!(
            levers,
            serde_json::json!(["recompute", "host_optimizer_state", "host_gradients", "host_parameters"]),
            "tie {tie}"
        );
        let host = s.summary().memory.peak_host_bytes.unwrap_or(0);
        assert!(
            host > 100_000,
            "tie {tie}: the layers and the state rest on the host ({host} B)"
        );
        // The output projection (96 x 32 fp32) and its gradient stay on the device: 24 KiB.
        let checked = streamed(&t).command("check").run().stdout;
        let line = checked.lines().find(|l| l.starts_with("device static")).unwrap();
        assert!(line.starts_with("device static    24.00 KiB"), "tie {tie}: {line}");
        assert!(
            checked.contains("with its gradient; its update runs on the host"),
            "{checked}"
        );
        let lever = checked
            .lines()
            .find(|l| l.trim_start().starts_with("host_parameters"))
            .unwrap();
        assert!(lever.contains("on from the start (spec)"), "{lever}");
    }
}

/// The claim at a small scale: a tied-embedding Llama whose fp32 AdamW full fine-tune needs
/// 8 MiB of static state does not fit a 2 MiB cap, neither as it is nor with the optimizer
/// state and gradients on the host (its parameters alone are 2 MiB); with the layers streamed
/// it trains under the cap, by the counting CPU allocator, to the uncapped run's losses and
/// weights. Under a cap it first meets in a step, "offload" streams it from then on.
#[test]
fn a_full_fine_tune_too_large_for_the_cap_trains_under_it_streamed() {
    let t = Test::new();
    token_file(t.dir(), 1040, 512);
    let llama = "vocab_size = 512\nhidden_size = 64\nintermediate_size = 256\nnum_hidden_layers = 8\n\
                 num_attention_heads = 4\nnum_key_value_heads = 2\ntie_word_embeddings = true";
    let t = job(&t, llama, 64, "batch_size = 1\noptimizer_impl = \"single\"");
    let cap = 2u64 << 20;
    let capped = |t: &Test| t.clone().set("memory.limit", "2MiB");
    let checked = capped(&t).command("check").run().stdout;
    assert!(checked.contains("total static     8.02 MiB"), "{checked}");
    assert!(checked.contains("this spec cannot fit"), "{checked}");
    capped(&t).name("resident").exit(3).stderr_has("out of memory").run();
    capped(&t)
        .name("host_state")
        .set("memory.optimizer_state", "host")
        .set("memory.gradients", "host")
        .set("train.activation_checkpointing", true)
        .exit(3)
        .stderr_has("out of memory")
        .run();
    let checked = capped(&streamed(&t)).command("check").run().stdout;
    assert!(!checked.contains("cannot fit"), "{checked}");
    let free = t.clone().name("free").run();
    let s = capped(&streamed(&t)).run();
    let p = peak(&s);
    assert!(p <= cap, "device peak {p} under the cap");
    assert!(peak(&free) > 4 * cap, "uncapped and unstreamed: {}", peak(&free));
    assert_eq!(step_losses(&s), step_losses(&free));
    assert_eq!(s.final_bytes(), free.final_bytes());
    let losses = step_losses(&s);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    // Not streamed from the start: an OOM answered by "offload" streams it from then on.
    let offloaded = t
        .clone()
        .name("offloaded")
        .set("memory.limit", "2400KiB")
        .set("memory.optimizer_state", "host")
        .set("memory.gradients", "host")
        .set("memory.on_oom", vec!["offload"])
        .stderr_has("offloading: parameters rest in host memory")
        .run();
    assert!(!offloaded.stderr.contains("cannot stream"), "{}", offloaded.stderr);
    assert_eq!(offloaded.final_bytes(), free.final_bytes());
}

/// A LoRA llama with its base in bf16 (`train.frozen_dtype`) and its layers streamed: the bf16
/// copies of the base are made where the base rests, in host memory, so a cap under the bf16
/// base alone (960 KiB of projections; the tied embedding stays fp32, on the device) but over
/// what the device holds trains to the uncapped run's losses, with the base counted on the
/// host. `generate` streams it under the same cap.
#[test]
fn a_streamed_bf16_base_rests_on_the_host_under_a_cap_it_would_exceed() {
    let t = Test::new();
    token_file(t.dir(), 1040, 512);
    let llama = "vocab_size = 512\nhidden_size = 64\nintermediate_size = 256\nnum_hidden_layers = 8\n\
                 num_attention_heads = 4\nnum_key_value_heads = 2\ntie_word_embeddings = true";
    let t = job(
        &t,
        llama,
        64,
        "batch_size = 1\nprecision = \"bf16-mixed\"\nfrozen_dtype = \"bf16\"",
    )
    .set("model.lora.rank", 4)
    .set("model.lora.targets", vec!["q", "v"]);
    let cap = 832u64 << 10;
    let free = streamed(&t).name("free").run();
    let s = streamed(&t).name("capped").set("memory.limit", "832KiB").run();
    assert!(s.stderr.contains("kept in bf16 (960 KiB saved)"), "{}", s.stderr);
    assert!(step_losses(&s).len() >= 10);
    assert_eq!(step_losses(&s), step_losses(&free));
    assert_eq!(step_losses(&s), step_losses(&t.clone().name("resident").run()));
    assert!(peak(&s) <= cap, "device peak {} under the cap", peak(&s));
    let host = s.summary().memory.peak_host_bytes.unwrap_or(0);
    assert!(host >= 960 << 10, "the bf16 base rests on the host ({host} B)");
    let generated = t
        .clone()
        .command("generate")
        .no_spec()
        .args(&[
            s.out.to_str().unwrap(),
            "--prompt-ids",
            "2",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
        ])
        .run();
    assert!(generated.stdout.starts_with("2 | "), "{}", generated.stdout);
}
