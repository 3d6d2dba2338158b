//! The llama preset with each memory lever the language-model guide says composes with it, on a
//! tiny decoder trained on a token file: recomputation and host activations (exact on the CPU),
//! 8-bit optimizer state (the first step exact, then within a stated tolerance, in fewer bytes),
//! a full fine-tune in bf16-mixed (fp32 master weights and state), a backoff that keeps the
//! tokens of every optimizer step, and a streamed LoRA base whose frozen weights get no
//! gradient, on the device or in host memory. Streaming and host state and gradients on a full
//! fine-tune: tests/it/llama_stream.rs.
use std::path::Path;

use crate::common::*;

const VOCAB: i64 = 128;
const HIDDEN: i64 = 64;
const INTERMEDIATE: i64 = 128;
const LAYERS: i64 = 2;
const KV_HEADS: i64 = 2;
const HEADS: i64 = 4;

/// `n` token ids below `VOCAB` in a pattern the model can learn, as uint16 in `dir/train.bin`.
fn token_file(dir: &Path, n: u32) {
    let ids: Vec<u8> = (0..n)
        .flat_map(|i| (((i * 7 + (i * i) % 13) % VOCAB as u32) as u16).to_le_bytes())
        .collect();
    std::fs::write(dir.join("train.bin"), &ids).unwrap();
}

/// A full fine-tune of an untied tiny llama (92K parameters, most tensors large enough for
/// 8-bit state) on 1920 tokens in windows of 16: 101 training windows, 26 AdamW steps of 4 (the
/// last of 1), every step recorded. One optimizer implementation, so that a lever that moves the
/// state to the host runs the same update.
fn job() -> Test {
    let t = Test::new();
    token_file(t.dir(), 1920);
    let spec = format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\npreset = \"llama\"\n\
         [model.llama]\nvocab_size = {VOCAB}\nhidden_size = {HIDDEN}\nintermediate_size = {INTERMEDIATE}\n\
         num_hidden_layers = {LAYERS}\nnum_attention_heads = {HEADS}\nnum_key_value_heads = {KV_HEADS}\nseq_len = 16\n\
         [data]\nsource = \"tokens\"\npath = \"{}\"\ntoken_dtype = \"uint16\"\nseq_len = 16\nval_fraction = 0.1\n\
         [train]\nepochs = 1\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.003\nweight_decay = 0.01\noptimizer_impl = \"single\"\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        t.dir().join("train.bin").display()
    );
    t.spec(table(&spec))
}

/// The checkpoint's `levers` list.
fn levers(o: &Outcome) -> serde_json::Value {
    o.final_state()["levers"].clone()
}

/// The largest relative difference between two loss curves of one length.
fn largest_gap(ours: &[f64], theirs: &[f64]) -> f64 {
    assert_eq!(ours.len(), theirs.len());
    ours.iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs() / b.abs())
        .fold(0.0, f64::max)
}

/// The mean of the first and of the last five losses: the second below the first.
#[track_caller]
fn assert_learns(losses: &[f64], what: &str) {
    let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
    assert!(
        last < first - 0.1,
        "{what}: the loss falls ({first} -> {last}): {losses:?}"
    );
}

/// Recomputation alone, host activations, and host activations with the optimizer state and
/// gradients on the host: each keeps only where a tensor lives, so the per-step losses and the
/// final weights equal the plain run's bit for bit on the CPU (docs/guide.md, "What they change
/// in the numbers"), and the checkpoint names the levers that ran.
#[test]
fn recomputation_and_host_activations_train_a_decoder_exactly() {
    let t = job();
    let plain = t.clone().name("plain").run();
    assert_eq!(step_losses(&plain).len(), 26);
    assert_learns(&step_losses(&plain), "plain");
    let quiet = |o: &Outcome| {
        assert!(!o.stderr.contains("without it"), "{}", o.stderr);
        assert!(o.summary().precision.activation_checkpointing);
    };
    let recompute = t
        .clone()
        .name("recompute")
        .set("train.activation_checkpointing", true)
        .run();
    quiet(&recompute);
    assert_eq!(levers(&recompute), serde_json::json!(["recompute"]));
    let boundaries = t
        .clone()
        .name("host_activations")
        .set("memory.activations", "host")
        .run();
    quiet(&boundaries);
    assert_eq!(
        levers(&boundaries),
        serde_json::json!(["recompute", "host_activations"])
    );
    // The block boundaries wait in host memory: 16 tokens x 64 values x 4 samples per layer.
    let host = boundaries.summary().memory.peak_host_bytes.unwrap_or(0);
    assert!(host >= 16 * 64 * 4 * 4, "the boundaries rest on the host ({host} B)");
    let all = t
        .clone()
        .name("all_on_host")
        .set("memory.activations", "host")
        .set("memory.optimizer_state", "host")
        .set("memory.gradients", "host")
        .run();
    assert_eq!(
        levers(&all),
        serde_json::json!([
            "host_optimizer_state",
            "host_gradients",
            "recompute",
            "host_activations"
        ])
    );
    for o in [&recompute, &boundaries, &all] {
        assert_eq!(step_losses(o), step_losses(&plain), "{}: losses", o.out.display());
        assert_eq!(
            o.final_bytes(),
            plain.final_bytes(),
            "{}: final weights",
            o.out.display()
        );
    }
    // Recomputation keeps fewer activations at the step's peak.
    let peak = |o: &Outcome| o.summary().memory.peak_allocated_bytes.unwrap();
    assert!(
        peak(&recompute) < peak(&plain),
        "{} vs {}",
        peak(&recompute),
        peak(&plain)
    );
}

/// 8-bit AdamW state on the decoder (docs/internals.md, "8-bit optimizer state"): tensors of at
/// least 4096 values keep their moments as u8 codes with one fp32 scale per 256 values, the
/// rest fp32 moments, and summary.json counts exactly that. The first update is fp32 AdamW's, so
/// the first two losses equal the fp32 run's bit for bit; after that the quantized moments carry
/// over, and the losses stay within 2% of fp32's over the 26 steps (measured: 0.9% at most) while
/// the loss falls. With the state on the host it trains to the same bytes.
#[test]
fn eight_bit_state_trains_a_decoder_in_a_third_of_the_bytes() {
    let t = job();
    let fp32 = t.clone().name("fp32").run();
    let eight = t.clone().name("eight").set("train.optimizer_state_bits", 8).run();
    let (ours, theirs) = (step_losses(&eight), step_losses(&fp32));
    assert_eq!(ours[..2], theirs[..2], "the first update is fp32 AdamW's");
    assert_ne!(ours, theirs, "the quantized moments change later steps");
    let gap = largest_gap(&ours, &theirs);
    eprintln!("8-bit AdamW on a llama: losses within {gap:e} relative of fp32's over 26 steps");
    assert!(gap < 0.02, "{gap}: {ours:?} vs {theirs:?}");
    assert_learns(&ours, "8-bit");
    // Quantized: the embedding, lm_head, q, o, gate, up and down (k and v hold 2048 values).
    let per_layer = 2 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE;
    let quantized = (2 * VOCAB * HIDDEN + LAYERS * per_layer) as u64;
    let training = eight.summary().training.expect("a training section");
    let total = training.trainable_parameters;
    assert_eq!(
        training.optimizer_state_bytes,
        quantized * 2 + quantized / 256 * 2 * 4 + (total - quantized) * 8
    );
    let full = fp32
        .summary()
        .training
        .expect("a training section")
        .optimizer_state_bytes;
    assert_eq!(full, total * 8);
    assert!(training.optimizer_state_bytes * 3 < full, "{training:?}");
    let state = tensors(&eight.final_model().with_file_name("optimizer.safetensors"));
    let kind = |name: &str| state.iter().find(|(k, _)| k == name).map(|(_, v)| v.kind());
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert_eq!(kind(&format!("weight/exp_avg_q8/{q}")), Some(tch::Kind::Uint8));
    assert_eq!(kind(&format!("weight/exp_avg_sq_absmax/{q}")), Some(tch::Kind::Float));
    let k = "model.layers.0.self_attn.k_proj.weight";
    assert_eq!(kind(&format!("weight/exp_avg/{k}")), Some(tch::Kind::Float));
    assert_eq!(kind(&format!("weight/exp_avg_q8/{k}")), None);
    let hosted = t
        .clone()
        .name("eight_on_host")
        .set("train.optimizer_state_bits", 8)
        .set("memory.optimizer_state", "host")
        .run();
    assert_eq!(step_losses(&hosted), ours);
    assert_eq!(hosted.final_bytes(), eight.final_bytes());
}

/// A full fine-tune in bf16-mixed: the forward computes under bf16 autocast (the first loss
/// already differs from fp32's, by less than 1e-2 relative over the run), the loss falls, and
/// the weights and the optimizer state stay fp32 master copies (docs/guide.md's precision
/// table), in the checkpoint as in the summary's bill. Recomputation and the host levers keep
/// its losses bit for bit, under the same autocast.
#[test]
fn a_full_fine_tune_in_bf16_mixed_trains_with_fp32_master_weights() {
    let t = job();
    let fp32 = t.clone().name("fp32").run();
    let mixed = t.clone().name("mixed").set("train.precision", "bf16-mixed").run();
    let s = mixed.summary();
    assert_eq!(s.precision.mode, memtrain::spec::Precision::Bf16Mixed);
    let (ours, theirs) = (step_losses(&mixed), step_losses(&fp32));
    assert_ne!(ours[0], theirs[0], "the forward runs under bf16 autocast");
    let gap = largest_gap(&ours, &theirs);
    eprintln!("bf16-mixed llama full fine-tune: losses within {gap:e} relative of fp32's");
    assert!(gap < 1e-2, "{gap}");
    assert_learns(&ours, "bf16-mixed");
    let training = s.training.expect("a training section");
    assert_eq!(training.gradient_bytes, training.trainable_parameters * 4);
    assert_eq!(training.optimizer_state_bytes, training.trainable_parameters * 8);
    let model = tensors(&mixed.final_model());
    assert_eq!(model.len(), 3 + 9 * LAYERS as usize, "every weight");
    for (name, v) in &model {
        assert_eq!(v.kind(), tch::Kind::Float, "{name}: an fp32 master weight");
    }
    let state = tensors(&mixed.final_model().with_file_name("optimizer.safetensors"));
    for (name, v) in state.iter().filter(|(k, _)| !k.starts_with("rng/")) {
        assert_eq!(v.kind(), tch::Kind::Float, "{name}: fp32 optimizer state");
    }
    let levered = t
        .clone()
        .name("mixed_levered")
        .set("train.precision", "bf16-mixed")
        .set("memory.activations", "host")
        .set("memory.optimizer_state", "host")
        .set("memory.gradients", "host")
        .run();
    assert_eq!(step_losses(&levered), ours);
    assert_eq!(levered.final_bytes(), mixed.final_bytes());
}

/// An out-of-memory error in the third step's backward (a real allocation failure, through the
/// fault hook) backs off: from that step on the micro-batch is 2 with 2 accumulation steps,
/// every optimizer step still takes its 4 windows and the same 64 target tokens as the run
/// that never ran out, and the loss of each step (the mean over the group's tokens) is the same
/// to float rounding, the partial sums added in another order.
#[test]
fn a_backoff_keeps_the_tokens_of_every_optimizer_step() {
    let t = job();
    let plain = t.clone().name("plain").run();
    let backed = t
        .clone()
        .name("backed_off")
        .env("MEMTRAIN_FAULT_OOM_IN", "backward:3")
        .stderr_has("backing off: micro-batch 4 -> 2, accumulation 1 -> 2")
        .run();
    let ooms = backed.ooms();
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0].decision.action, "backoff");
    assert_eq!((ooms[0].micro_batch_before, ooms[0].accumulation_before), (4, 1));
    assert_eq!(ooms[0].batch_shape, [4, 16]);
    let s = backed.summary();
    assert_eq!(s.oom.of("backoffs"), 1);
    assert_eq!((s.batch.final_micro_batch, s.batch.final_accumulation_steps), (2, 2));
    assert_eq!(s.batch.effective_batch, 4);
    let (ours, theirs) = (backed.steps(), plain.steps());
    assert_eq!(ours.len(), theirs.len());
    for (a, b) in ours.iter().zip(&theirs) {
        let want = if a.step <= 2 { 4 } else { 2 };
        assert_eq!(a.micro_batch, want, "step {}", a.step);
        assert_eq!(a.samples, b.samples, "step {}: its windows", a.step);
        let tokens = |e: &StepEvent| e.language.expect("a language model's step").tokens;
        assert_eq!(tokens(a), tokens(b), "step {}: its tokens", a.step);
        assert_eq!(tokens(a), a.samples as u64 * 16, "step {}", a.step);
    }
    let tokens_seen = |o: &Outcome| o.steps().last().unwrap().language.unwrap().tokens_seen;
    assert_eq!(tokens_seen(&backed), tokens_seen(&plain));
    assert_close(&step_losses(&backed), &step_losses(&plain), 1e-6);
}

/// LoRA on a decoder whose base streams from host memory (`memory.parameters = "host"`): only
/// the adapters train, so only they have gradients and optimizer state (summary.json's bill),
/// and host memory holds the resting base and the adapters' gradients and state, never a
/// gradient of a frozen weight: its peak stays under the base plus the adapters' terms plus
/// 8 KiB, where one frozen decoder layer's gradients would be 144 KiB. The losses equal the
/// unstreamed LoRA run's bit for bit.
#[test]
fn a_streamed_lora_base_moves_no_gradient_of_a_frozen_weight() {
    let t = job()
        .set("model.lora.rank", 4)
        .set("model.lora.targets", vec!["q", "v"]);
    let resident = t.clone().name("resident").run();
    let streamed = t.clone().name("streamed").set("memory.parameters", "host").run();
    assert!(!streamed.stderr.contains("cannot stream"), "{}", streamed.stderr);
    assert_eq!(step_losses(&streamed), step_losses(&resident));
    // The checkpoint holds the adapters alone, and every B, which starts at zero, has trained.
    let saved = tensors(&streamed.final_model());
    assert_eq!(saved.len(), 4 * LAYERS as usize);
    for (name, v) in &saved {
        assert!(name.contains(".lora_"), "{name}");
        let moved = v.abs().max().double_value(&[]);
        assert!(moved > 0.0, "{name} trained");
    }
    // rank 4 on q (64 -> 64) and v (64 -> 32) of each layer.
    let adapters = (LAYERS * (4 * HIDDEN + HIDDEN * 4 + 4 * HIDDEN + 32 * 4)) as u64;
    let training = streamed.summary().training.expect("a training section");
    assert_eq!(training.trainable_parameters, adapters);
    assert_eq!(training.gradient_bytes, adapters * 4);
    assert_eq!(training.optimizer_state_bytes, adapters * 8);
    assert_eq!(resident.summary().training, Some(training.clone()));
    // The frozen output projection stays on the device; every other weight rests on the host.
    let head = (VOCAB * HIDDEN * 4) as u64;
    let resting = (training.trainable_parameters + training.frozen_parameters) * 4 - head;
    let host = streamed.summary().memory.peak_host_bytes.unwrap_or(0);
    let bound = resting + training.gradient_bytes + training.optimizer_state_bytes + (8 << 10);
    eprintln!("streamed LoRA llama: {host} B of host memory at the peak; the resting base is {resting} B");
    assert!(host >= resting, "the base rests on the host ({host} B < {resting} B)");
    assert!(
        host <= bound,
        "{host} B on the host, over {bound} B: a frozen weight's gradient"
    );
    let layer = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * 32 + 3 * HIDDEN * INTERMEDIATE) as u64 * 4;
    assert!(
        layer > 16 * (8 << 10),
        "one frozen layer's gradients ({layer} B) would break the bound"
    );
    assert_eq!(resident.summary().memory.peak_host_bytes, None);
}

/// `train.frozen_dtype = "bf16"` on a LoRA decoder in bf16-mixed keeps the frozen projections in
/// bf16, which autocast casts them to for every use anyway: the per-step losses equal the fp32
/// base's bit for bit. The token embedding stays fp32: its rows start the residual stream.
#[test]
fn a_lora_decoder_with_its_base_in_bf16_trains_as_with_its_base_in_fp32() {
    let t = job()
        .set("model.lora.rank", 4)
        .set("model.lora.targets", vec!["q", "v", "down"])
        .set("train.precision", "bf16-mixed");
    let wide = t.clone().name("wide").set("train.frozen_dtype", "fp32").run();
    let narrow = t.clone().name("narrow").set("train.frozen_dtype", "bf16").run();
    assert_eq!(step_losses(&wide).len(), 26);
    assert_eq!(step_losses(&wide), step_losses(&narrow), "the same losses bit for bit");
    let checked = t.command("check").set("train.frozen_dtype", "bf16").run().stdout;
    let model = checked.lines().find(|l| l.starts_with("model ")).unwrap();
    // Every frozen weight but the embedding (128 x 64) and the norms' 1-D ones is kept in bf16.
    assert!(model.contains("kept in bf16"), "{model}");
}
