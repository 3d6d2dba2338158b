//! The llama preset against Hugging Face: tiny random `LlamaForCausalLM` and `Qwen2ForCausalLM`
//! models built in Python (tests/py/llama_reference.py) and saved by `save_pretrained` load
//! through `model.init_from` with their sizes from `config.json`, and give transformers' logits;
//! `check` takes such a directory with no sizes in the spec; bad options are spec errors.
use std::path::Path;

use crate::common::*;

/// tests/py/llama_reference.py with `args` in `dir`; its JSON output.
#[track_caller]
pub fn llama_py(dir: &Path, args: &[&str]) -> serde_json::Value {
    let o = std::process::Command::new(python())
        .arg(repo().join("tests/py/llama_reference.py"))
        .args(args)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "llama_reference.py {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = String::from_utf8_lossy(&o.stdout);
    let last = text.lines().last().unwrap_or_default();
    serde_json::from_str(last.trim()).unwrap_or(serde_json::Value::Null)
}

/// `[model]` with the llama preset over `dir` and no sizes: validation fills them from its
/// config.json.
fn from_dir(dir: &Path, lora: &str) -> memtrain::spec::Model {
    let mut m = memtrain::spec::Model {
        preset: "llama".into(),
        init_from: Some(dir.to_path_buf()),
        ..Default::default()
    };
    if !lora.is_empty() {
        m.options.insert("lora".into(), toml::Value::Table(table(lora)));
    }
    let problems = memtrain::model::validate(&mut m, &Default::default());
    assert!(problems.is_empty(), "{problems:?}");
    m
}

/// The model of `m` with its `init_from` loaded: (variables, network).
#[track_caller]
fn loaded(m: &memtrain::spec::Model) -> (tch::nn::VarStore, memtrain::model::Built) {
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let built = memtrain::model::build(&vs.root(), m).unwrap();
    let load = memtrain::run::init_from(&vs, &built.head, m, m.init_from.as_ref().unwrap()).unwrap();
    let adapters = vs.variables().keys().filter(|n| n.contains(".lora_")).count() as u64;
    // Every tensor matched; only the adapters, which the checkpoint lacks, are made fresh.
    assert_eq!((load.created, load.dropped), (adapters, 0), "{load:?}");
    (vs, built)
}

/// Our logits on `ids`, and how far they are from `theirs` relative to the largest of theirs.
fn gap(built: &memtrain::model::Built, ids: &tch::Tensor, theirs: &tch::Tensor) -> (f64, f64) {
    let ours = tch::no_grad(|| {
        let hidden = built.net.forward_t(ids, false);
        memtrain::model::logits(built.net.as_ref(), &hidden)
    });
    assert_eq!(ours.size(), theirs.size());
    let gap = (&ours - theirs).abs().max().double_value(&[]);
    let scale = theirs.abs().max().double_value(&[]);
    assert!(scale > 0.1, "the logits are not trivially zero ({scale})");
    (gap, scale)
}

fn io(dir: &Path, name: &str) -> tch::Tensor {
    let io = tensors(&dir.join("io.safetensors"));
    io.iter().find(|(k, _)| k == name).unwrap().1.shallow_clone()
}

#[test]
fn logits_equal_transformers_for_each_flavour() {
    for (what, flags) in [
        ("grouped-query attention, untied", vec![]),
        ("tied embeddings, Llama 3 rope scaling", vec!["--tie", "--llama3"]),
        (
            "Qwen2: q/k/v biases, grouped-query attention",
            vec!["--kind", "qwen2", "--llama3"],
        ),
        (
            "attention_bias, one key/value head, head_dim given",
            vec!["--attention-bias", "--kv-heads", "1", "--head-dim", "16"],
        ),
        ("multi-head attention, tied", vec!["--kv-heads", "4", "--tie"]),
    ] {
        let t = Test::new();
        let mut args = vec!["make", "--out", "hf", "--io", "io.safetensors"];
        args.extend(flags);
        llama_py(t.dir(), &args);
        let m = from_dir(&t.dir().join("hf"), "");
        let (_vs, built) = loaded(&m);
        let (gap, scale) = gap(&built, &io(t.dir(), "ids"), &io(t.dir(), "logits"));
        eprintln!("{what}: logits differ from transformers' by at most {gap:e} (largest logit {scale})");
        assert!(gap <= 1e-5 * scale, "{what}: logits differ by {gap} (scale {scale})");
    }
}

/// A job on the llama preset (`[model]` body `model`), for `check`.
fn llama_job(t: &Test, model: &str) -> Test {
    t.clone()
        .spec(table(&format!(
            "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\n{model}\n[train]\nepochs = 1\nbatch_size = 2\n"
        )))
        .command("check")
}

#[test]
fn check_takes_a_hugging_face_directorys_sizes_and_names_a_contradiction() {
    let t = Test::new();
    llama_py(t.dir(), &["make", "--out", "hf", "--kind", "qwen2", "--llama3"]);
    let hf = t.dir().join("hf");
    let job = llama_job(&t, &format!("preset = \"llama\"\ninit_from = \"{}\"", hf.display()));
    let c = job.clone().run();
    for line in [
        "vocab_size = 96",
        "hidden_size = 32",
        "intermediate_size = 48",
        "num_hidden_layers = 2",
        "num_key_value_heads = 2",
        "max_position_embeddings = 256",
        "qkv_bias = true",
        "rope_theta = 5000.0",
        "[model.llama.rope_scaling]",
        "original_max_position_embeddings = 64",
        "0 created, 0 dropped",
        "(huggingface names)",
    ] {
        assert!(c.stdout.contains(line), "{line}: {}", c.stdout);
    }
    job.set("model.llama.num_hidden_layers", 3)
        .exit(2)
        .stderr_has("model.llama.num_hidden_layers is 3, but the checkpoint's")
        .stderr_has("config.json says num_hidden_layers = 2")
        .run();
}

#[test]
fn bad_options_are_spec_errors_that_say_why() {
    let t = Test::new();
    let job = llama_job(&t, "preset = \"llama\"");
    job.clone().run();
    for (key, value, says) in [
        (
            "seq_len",
            4096,
            "model.llama.seq_len 4096 is beyond the model's 512 positions (max_position_embeddings)",
        ),
        (
            "num_attention_heads",
            5,
            "model.llama.hidden_size must be a multiple of num_attention_heads (5)",
        ),
        (
            "num_key_value_heads",
            3,
            "model.llama.num_key_value_heads must divide num_attention_heads (4)",
        ),
    ] {
        job.clone()
            .set(&format!("model.llama.{key}"), value)
            .exit(2)
            .stderr_has(says)
            .run();
    }
}

#[test]
fn a_sharded_directory_loads_and_an_index_naming_a_missing_shard_is_refused() {
    let t = Test::new();
    llama_py(
        t.dir(),
        &["make", "--out", "hf", "--shards", "3", "--io", "io.safetensors"],
    );
    let hf = t.dir().join("hf");
    let index: serde_json::Value = json(&hf.join("model.safetensors.index.json"));
    let mut shards: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(|v| v.as_str())
        .collect();
    shards.sort();
    shards.dedup();
    assert!(shards.len() > 1, "{shards:?}");
    let (_vs, built) = loaded(&from_dir(&hf, ""));
    let (gap, scale) = gap(&built, &io(t.dir(), "ids"), &io(t.dir(), "logits"));
    assert!(gap <= 1e-5 * scale, "sharded: logits differ by {gap} (scale {scale})");

    std::fs::remove_file(hf.join(shards[1])).unwrap();
    llama_job(&t, &format!("preset = \"llama\"\ninit_from = \"{}\"", hf.display()))
        .exit(2)
        .stderr_has("model.init_from")
        .stderr_has(&format!(
            "names the shard {}, which does not exist",
            hf.join(shards[1]).display()
        ))
        .run();
}

/// A run of the llama preset over `hf` with LoRA adapters (`lora`, with random B so they
/// change the logits) as `memtrain run` leaves one: its resolved spec and a checkpoint holding
/// the adapters. Returns the run directory, the checkpoint, and memtrain's adapted logits.
fn adapted_run(t: &Test, hf: &Path, lora: &str) -> (std::path::PathBuf, std::path::PathBuf, tch::Tensor) {
    let m = from_dir(hf, lora);
    let (vs, built) = loaded(&m);
    let mut adapters = vec![];
    tch::no_grad(|| {
        for (name, var) in vs.variables() {
            if name.ends_with("lora_B.weight") {
                var.shallow_clone().copy_(&(tch::Tensor::randn_like(&var) * 0.1));
            }
            if name.contains(".lora_") {
                adapters.push((name, var.detach().copy()));
            }
        }
    });
    assert!(!adapters.is_empty());
    let ids = io(t.dir(), "ids");
    let ours = tch::no_grad(|| memtrain::model::logits(built.net.as_ref(), &built.net.forward_t(&ids, false)));
    let run = t.dir().join("run");
    let ck = run.join("checkpoints").join("epoch-1");
    std::fs::create_dir_all(&ck).unwrap();
    memtrain::checkpoint::write_safetensors(&ck.join("model.safetensors"), &adapters).unwrap();
    let spec = format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"llama\"\ninit_from = \"{}\"\n[model.lora]\n{lora}\n",
        hf.display()
    );
    std::fs::write(run.join("config.resolved.toml"), spec).unwrap();
    (run, ck, ours)
}

#[test]
fn export_writes_a_directory_transformers_loads_with_the_adapters_merged() {
    for (flags, architecture) in [
        (vec!["--kind", "qwen2"], "Qwen2ForCausalLM"),
        (vec!["--tie", "--llama3"], "LlamaForCausalLM"),
    ] {
        let t = Test::new();
        let mut args = vec!["make", "--out", "hf", "--io", "io.safetensors"];
        args.extend(flags);
        llama_py(t.dir(), &args);
        let lora = "rank = 2\ntargets = [\"q\", \"v\", \"o\", \"gate\", \"down\"]";
        let (run, ck, ours) = adapted_run(&t, &t.dir().join("hf"), lora);
        let out = t.dir().join("exported");
        t.clone()
            .no_spec()
            .command("export")
            .args_replaced(&[
                run.to_str().unwrap(),
                "--checkpoint",
                ck.to_str().unwrap(),
                "--format",
                "huggingface",
                out.to_str().unwrap(),
            ])
            .run();
        let info = llama_py(t.dir(), &["logits", "--dir", "exported", "--io", "io.safetensors"]);
        assert_eq!(info["architectures"], serde_json::json!([architecture]), "{info}");
        let theirs = io(t.dir(), "theirs");
        let before = io(t.dir(), "logits");
        let moved = (&ours - &before).abs().max().double_value(&[]);
        assert!(moved > 1e-3, "the adapters change the logits ({moved})");
        let gap = (&ours - &theirs).abs().max().double_value(&[]);
        let scale = theirs.abs().max().double_value(&[]);
        eprintln!("{architecture} exported: transformers' logits differ from memtrain's adapted ones by {gap:e} (largest {scale})");
        assert!(gap <= 1e-5 * scale, "{architecture}: {gap} (scale {scale})");
        t.clone()
            .no_spec()
            .command("export")
            .args_replaced(&[
                run.to_str().unwrap(),
                "--checkpoint",
                ck.to_str().unwrap(),
                "--format",
                "timm",
                "x",
            ])
            .exit(2)
            .stderr_has("timm cannot hold this model")
            .run();
    }
}

/// A token file of 4000 ids in a noisy pattern (train.bin, uint16) and its first 100 (val.bin) in
/// `dir`: something to learn and to miss.
fn pattern_files(dir: &Path) {
    let ids: Vec<u8> = (0..4000u32)
        .flat_map(|i| (((i * 7 + (i * i) % 13) % 96) as u16).to_le_bytes())
        .collect();
    std::fs::write(dir.join("train.bin"), &ids).unwrap();
    std::fs::write(dir.join("val.bin"), &ids[..200]).unwrap();
}

/// The plain PyTorch loop's 20 per-step losses over `hf` in `dir` (`command`: `train`, or
/// `lora-train` with its flags), as the specs below train: windows of 24, groups of 4, seed 5,
/// AdamW at `lr` with weight decay 0.01.
fn python_losses(dir: &Path, command: &[&str], lr: &str) -> Vec<f64> {
    let mut args = command.to_vec();
    args.extend([
        "--dir",
        "hf",
        "--data",
        "train.bin",
        "--seq-len",
        "24",
        "--batch",
        "4",
        "--steps",
        "20",
    ]);
    args.extend(["--lr", lr, "--weight-decay", "0.01", "--seed", "5"]);
    let py = llama_py(dir, &args);
    floats(&py["losses"])
}

/// A full fine-tune of a tiny `LlamaForCausalLM` on a token file: memtrain's 20 per-step losses
/// (the next-token loss in chunks, AdamW) equal a plain PyTorch loop's around the same
/// transformers model, same windows in the same order, within 1e-6 relative; the summed
/// cross-entropy is added up in another order, so not bit for bit.
#[test]
fn a_full_fine_tune_trains_as_a_plain_pytorch_loop_does() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    llama_py(&dir, &["make", "--out", "hf", "--kv-heads", "2"]);
    // 96-token vocabulary: a pattern with noise, so there is something to learn and to miss.
    pattern_files(&dir);
    let spec = format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 5\n[model]\npreset = \"llama\"\ninit_from = \"{hf}\"\n\
         [data]\nsource = \"tokens\"\npath = \"{d}/train.bin\"\nval_path = \"{d}/val.bin\"\ntoken_dtype = \"uint16\"\nseq_len = 24\n\
         [train]\nepochs = 1\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.002\nweight_decay = 0.01\noptimizer_impl = \"single\"\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        hf = dir.join("hf").display(),
        d = dir.display()
    );
    let r = t.spec(table(&spec)).arg("--max-steps").arg("20").run();
    let ours = step_losses(&r);
    let theirs = python_losses(&dir, &["train"], "0.002");
    assert_eq!(ours.len(), 20);
    assert!(theirs[19] < theirs[0], "the loop learns: {theirs:?}");
    assert_close(&ours, &theirs, 1e-6);
}

/// `memory.parameters = "host"` on a LoRA llama: the decoder layers stream from host memory and
/// the frozen output projection (the embedding, when tied) stays on the device; the per-step
/// losses equal the unstreamed run's bit for bit on the CPU (the same optimizer implementation).
/// A full fine-tune streams too (tests/it/llama_stream.rs).
#[test]
fn a_lora_decoder_streams_its_layers_and_keeps_its_frozen_head() {
    for tie in [false, true] {
        let t = Test::new();
        let dir = t.dir().to_path_buf();
        let mut args = vec!["make", "--out", "hf"];
        if tie {
            args.push("--tie");
        }
        llama_py(&dir, &args);
        pattern_files(&dir);
        let spec = table(&format!(
            "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"llama\"\ninit_from = \"{}\"\n\
             [model.lora]\nrank = 4\ntargets = [\"q\", \"v\", \"down\"]\n\
             [data]\nsource = \"tokens\"\npath = \"{}\"\ntoken_dtype = \"uint16\"\nseq_len = 16\n\
             [train]\nepochs = 1\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.003\noptimizer_impl = \"fused\"\n\
             [log]\nevery_steps = 1\nprogress = \"off\"\n",
            dir.join("hf").display(),
            dir.join("train.bin").display()
        ));
        let plain = t
            .clone()
            .name("plain")
            .spec(spec.clone())
            .arg("--max-steps")
            .arg("8")
            .run();
        let streamed = t
            .clone()
            .name("streamed")
            .spec(spec.clone())
            .set("memory.parameters", "host")
            .arg("--max-steps")
            .arg("8")
            .run();
        assert!(
            !streamed.stderr.contains("cannot stream"),
            "tie {tie}: {}",
            streamed.stderr
        );
        // check counts the output projection on the device: 96 x 32 fp32 values.
        let checked = t
            .clone()
            .command("check")
            .spec(spec.clone())
            .set("memory.parameters", "host")
            .run()
            .stdout;
        let line = checked.lines().find(|l| l.starts_with("device static")).unwrap();
        assert!(line.starts_with("device static    12.00 KiB"), "tie {tie}: {line}");
        // The base rests in host memory: only the streamed run has any there.
        assert_eq!(plain.summary().memory.peak_host_bytes, None);
        let host = streamed.summary().memory.peak_host_bytes.unwrap_or(0);
        assert!(host > 20_000, "tie {tie}: the layers rest on the host ({host} B)");
        assert_eq!(step_losses(&plain).len(), 8);
        assert_eq!(
            step_losses(&plain),
            step_losses(&streamed),
            "tie {tie}: streamed equals plain"
        );
    }
}

/// LoRA on a tiny `LlamaForCausalLM`: peft's adapters (rank 4 on q_proj and v_proj, both A and
/// B random) go through `model.init_from` with the base, and 20 AdamW steps on a token file give
/// peft's per-step losses within 1e-5 relative, the same windows in the same order.
#[test]
fn lora_trains_a_decoder_as_peft_does() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    llama_py(&dir, &["make", "--out", "hf", "--kv-heads", "2"]);
    llama_py(&dir, &["lora-init", "--dir", "hf", "--out", "init.safetensors"]);
    pattern_files(&dir);
    let spec = format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 5\n[model]\npreset = \"llama\"\ninit_from = \"{d}/init.safetensors\"\n\
         [model.llama]\nvocab_size = 96\nhidden_size = 32\nintermediate_size = 48\nnum_hidden_layers = 2\n\
         num_attention_heads = 4\nnum_key_value_heads = 2\nmax_position_embeddings = 256\nrms_norm_eps = 1e-5\nrope_theta = 5000.0\n\
         [model.lora]\nrank = 4\nalpha = 8.0\ntargets = [\"q\", \"v\"]\n\
         [data]\nsource = \"tokens\"\npath = \"{d}/train.bin\"\nval_path = \"{d}/val.bin\"\ntoken_dtype = \"uint16\"\nseq_len = 24\n\
         [train]\nepochs = 1\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.01\nweight_decay = 0.01\noptimizer_impl = \"single\"\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        d = dir.display()
    );
    let r = t.spec(table(&spec)).arg("--max-steps").arg("20").run();
    let ours = step_losses(&r);
    let theirs = python_losses(&dir, &["lora-train", "--init", "init.safetensors"], "0.01");
    assert_eq!(ours.len(), 20);
    assert!((theirs[19] - theirs[0]).abs() > 1e-3, "the adapters train: {theirs:?}");
    assert_close(&ours, &theirs, 1e-5);
}

/// Prompt/completion pairs train on their completions alone: a full fine-tune on 8 pairs of a
/// jsonl file, a whole group a step, gives per-step losses equal to a plain PyTorch loop's whose
/// labels are -100 over each prompt (Hugging Face's convention) within 1e-6 relative, over 6
/// steps: the prompt adds nothing to the loss, nor (the later steps follow from the earlier
/// steps' gradients) to the gradients. Each step counts the completion's targets only; counting
/// the prompt's too would give another loss.
#[test]
fn prompt_tokens_carry_no_loss_and_no_gradient_through_a_run() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    llama_py(&dir, &["make", "--out", "hf", "--kv-heads", "2"]);
    let words: Vec<String> = (0..40).map(|i| format!("w{i}")).collect();
    let mut vocab = serde_json::json!({"<unk>": 0, "</s>": 1});
    for (i, w) in words.iter().enumerate() {
        vocab[w.as_str()] = serde_json::json!(i + 2);
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    // Prompts of 2 to 6 words, completions of 1 to 4: some windows padded, one cut short.
    let pair = |i: usize| {
        let prompt = (0..2 + i % 5)
            .map(|k| words[(i * 7 + k * 3) % 40].as_str())
            .collect::<Vec<_>>();
        let completion = (0..1 + i % 4)
            .map(|k| words[(i * 5 + k) % 40].as_str())
            .collect::<Vec<_>>();
        serde_json::json!({"prompt": prompt.join(" "), "completion": completion.join(" ")}).to_string()
    };
    let lines: Vec<String> = (0..8).map(pair).collect();
    std::fs::write(dir.join("pairs.jsonl"), lines.join("\n") + "\n").unwrap();
    std::fs::write(dir.join("val.jsonl"), pair(9) + "\n").unwrap();
    let spec = format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 5\n[model]\npreset = \"llama\"\ninit_from = \"{hf}\"\n\
         [data]\nsource = \"jsonl\"\npath = \"{d}/pairs.jsonl\"\nval_path = \"{d}/val.jsonl\"\ntokenizer = \"{d}/tokenizer.json\"\n\
         prompt_field = \"prompt\"\ncompletion_field = \"completion\"\nseq_len = 8\n\
         [train]\nepochs = 6\nbatch_size = 8\noptimizer = \"adamw\"\nlr = 0.002\nweight_decay = 0.01\noptimizer_impl = \"single\"\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        hf = dir.join("hf").display(),
        d = dir.display()
    );
    let r = t.spec(table(&spec)).run();
    let py = llama_py(
        &dir,
        &[
            "pairs-train",
            "--dir",
            "hf",
            "--tokenizer",
            "tokenizer.json",
            "--eos",
            "1",
            "--data",
            "pairs.jsonl",
            "--seq-len",
            "8",
            "--batch",
            "8",
            "--steps",
            "6",
            "--lr",
            "0.002",
            "--weight-decay",
            "0.01",
            "--seed",
            "5",
        ],
    );
    let theirs: Vec<f64> = floats(&py["losses"]);
    let ours = step_losses(&r);
    assert_eq!(ours.len(), 6);
    assert!(theirs[5] < theirs[0], "the loop learns: {theirs:?}");
    assert_close(&ours, &theirs, 1e-6);
    let unmasked = py["unmasked"].as_f64().unwrap();
    assert!(
        // A hundred times the tolerance: a random model's losses are all near ln(96).
        (unmasked - ours[0]).abs() > 1e-4 * ours[0],
        "counting the prompt's targets changes the loss ({unmasked} vs {})",
        ours[0]
    );
    let counted = py["counted"].as_u64().unwrap();
    for s in r.steps() {
        assert_eq!(s.language.unwrap().tokens, counted, "step {}", s.step);
    }
}
