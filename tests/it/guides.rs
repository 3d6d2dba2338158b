//! What a user meets walking the guides (README, docs/fine-tuning.md, docs/language-models.md)
//! with the mistakes a user makes: each refusal says what went wrong and how to mend it, in the
//! command where it belongs, and `check` refuses what `run` would.
use std::path::Path;

use crate::common::*;

const WORDS: [&str; 8] = ["one", "two", "three", "four", "five", "six", "seven", "eight"];

/// A supervised fine-tune as docs/language-models.md shows it, at a tiny size: a random llama
/// of 16 tokens on prompt/completion pairs.
fn sft(t: &Test) -> Test {
    let (data, tok) = (t.dir().join("sft.jsonl"), t.dir().join("tokenizer.json"));
    word_tokenizer(&tok, &WORDS);
    let line = serde_json::json!({"prompt": "one two three", "completion": "four five six"}).to_string();
    std::fs::write(&data, format!("{}\n", vec![line; 20].join("\n"))).unwrap();
    t.clone().name("sft").spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"llama\"\n\
         [model.llama]\nvocab_size = 16\nhidden_size = 16\nintermediate_size = 32\nnum_hidden_layers = 1\n\
         num_attention_heads = 2\nnum_key_value_heads = 2\nmax_position_embeddings = 16\n\
         [data]\nsource = \"jsonl\"\npath = \"{}\"\ntokenizer = \"{}\"\nprompt_field = \"prompt\"\n\
         completion_field = \"completion\"\nseq_len = 8\n\
         [train]\nepochs = 1\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.01\n[log]\nprogress = \"off\"\n",
        data.display(),
        tok.display()
    )))
}

#[test]
fn check_refuses_the_jsonl_set_run_would_refuse() {
    let t = sft(&Test::new());
    let check = || t.clone().command("check");
    check().run();
    // A tokenizer of another model: more ids than the model has rows.
    let big = t.dir().join("big.json");
    let many: Vec<String> = (0..20).map(|i| format!("w{i}")).collect();
    word_tokenizer(&big, &many.iter().map(String::as_str).collect::<Vec<_>>());
    check()
        .set("data.tokenizer", big.display().to_string())
        .exit(2)
        .stderr_has("has a vocabulary of 22 ids, more than the model's vocabulary of 16")
        .stderr_has("use the tokenizer the model was trained with")
        .run();
    check()
        .set("data.tokenizer", t.dir().join("sft.jsonl").display().to_string())
        .exit(2)
        .stderr_has("not a tokenizer.json")
        .run();
    check()
        .set("data.prompt_field", "question")
        .exit(2)
        .stderr_has("line 1: has no field \"question\"")
        .run();
    // Nothing of it was tokenized or written.
    let cached = std::fs::read_dir(t.dir())
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().contains(".tokens-"));
    assert!(!cached, "check wrote a token cache");
}

#[test]
fn a_language_model_run_ends_and_evaluates_in_its_own_terms() {
    let t = sft(&Test::new());
    let run = t.clone().stderr_has("done: 1 epochs, final train loss").run();
    let done = run.stderr.lines().find(|l| l.starts_with("done:")).unwrap();
    // Its epoch lines' figures: perplexities, not a token accuracy read as a class accuracy.
    assert!(
        done.contains(" ppl ") && done.contains("val loss") && !done.contains("acc"),
        "{done}"
    );
    let dir = run.out.display().to_string();
    let folder = t.dir().join("images");
    std::fs::create_dir_all(folder.join("cat")).unwrap();
    t.clone()
        .command("eval")
        .no_spec()
        .args(&[&dir, "--data", &folder.display().to_string()])
        .exit(2)
        .stderr_has("--data takes an image folder, and this run's model (llama) is a language model")
        .run();
    assert!(!run.out.join("eval.json").exists());
}

#[test]
fn a_run_directory_given_for_a_spec_says_how_to_resume_it() {
    let t = Test::new().name("digits").set("train.epochs", 1);
    let run = t.clone().run();
    let dir = run.out.display().to_string();
    for command in ["check", "run"] {
        t.clone()
            .command(command)
            .no_spec()
            .arg(&dir)
            .exit(2)
            .stderr_has("cannot read spec file")
            .stderr_has(&format!("it is a run directory: give the job spec (TOML), and continue the run with `memtrain run SPEC --resume {dir}`"))
            .run();
    }
}

/// An mlp run's checkpoint, as a base to fine-tune from.
fn mlp_checkpoint(t: &Test) -> std::path::PathBuf {
    t.clone().name("base").set("train.epochs", 1).run().final_model()
}

#[test]
fn a_run_directory_given_as_init_from_names_its_checkpoints() {
    let t = Test::new();
    let base = mlp_checkpoint(&t);
    let run_dir = base.parent().and_then(Path::parent).and_then(Path::parent).unwrap();
    t.clone()
        .command("check")
        .set("model.init_from", run_dir.display().to_string())
        .exit(2)
        .stderr_has(&format!(
            "it is a run directory: name one of its checkpoints, {}/checkpoints/step-N/model.safetensors",
            run_dir.display()
        ))
        .run();
    t.clone()
        .command("check")
        .set("model.init_from", base.display().to_string())
        .run();
}

#[test]
fn lora_targets_that_match_nothing_are_not_blamed_on_init_from() {
    let t = Test::new();
    let base = mlp_checkpoint(&t);
    let r = t
        .clone()
        .command("check")
        .set("model.init_from", base.display().to_string())
        .set(
            "model.lora",
            toml::Value::Table(table("rank = 2\ntargets = [\"nope\"]")),
        )
        .exit(2)
        .stderr_has("model.lora.targets (nope) matches none")
        .run();
    assert!(!r.stderr.contains("model.init_from"), "{}", r.stderr);
}

#[test]
fn a_format_that_cannot_hold_the_model_names_the_one_that_can_once() {
    let t = Test::new().name("digits").set("train.epochs", 1);
    let run = t.clone().run();
    let out = t.dir().join("exported");
    let r = export(&t, &run.out, "timm", &out)
        .exit(2)
        .stderr_has(
            "timm cannot hold this model: it has no multilayer perceptron of this shape; export it as torchvision",
        )
        .run();
    assert!(!r.stderr.contains("another format"), "{}", r.stderr);
    assert!(!out.exists());
}

/// A tiny tied `LlamaForCausalLM` as transformers' older files hold it: `config.json` and a
/// pickled state dict whose head shares the embedding's memory.
const PICKLED_LLAMA: &str = r#"
import json, os, sys, torch
d = sys.argv[1]
os.makedirs(d)
json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8,
           "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
           "hidden_act": "silu"}, open(f"{d}/config.json", "w"))
g = torch.Generator().manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g)
sd = {"model.embed_tokens.weight": r(16, 8), "model.norm.weight": torch.ones(8)}
sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
p = "model.layers.0."
for n in ["q", "k", "v", "o"]:
    sd[f"{p}self_attn.{n}_proj.weight"] = r(8, 8)
sd[f"{p}mlp.gate_proj.weight"] = r(16, 8)
sd[f"{p}mlp.up_proj.weight"] = r(16, 8)
sd[f"{p}mlp.down_proj.weight"] = r(8, 16)
sd[f"{p}input_layernorm.weight"] = torch.ones(8)
sd[f"{p}post_attention_layernorm.weight"] = torch.ones(8)
torch.save(sd, f"{d}/pytorch_model.bin")
"#;

#[test]
fn a_pickled_model_directory_converts_with_the_line_the_error_prints() {
    let t = Test::new();
    let hf = t.dir().join("hf");
    let made = std::process::Command::new(python())
        .args(["-c", PICKLED_LLAMA])
        .arg(&hf)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let check = |from: &Path| {
        t.clone()
            .command("check")
            .spec(table(&format!(
                "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"llama\"\ninit_from = \"{}\"\n[train]\nbatch_size = 2\n",
                from.display()
            )))
    };
    let refused = check(&hf)
        .exit(2)
        .stderr_has("pytorch_model.bin is a PyTorch pickle")
        .run();
    // The printed line, run as printed from memtrain's working directory (not the model's):
    // it names the files by the paths given, and clones the tied head out of the embedding's
    // memory, which save_file would refuse.
    let line = refused
        .stderr
        .lines()
        .find_map(|l| l.trim().strip_prefix("python -c "))
        .expect("the conversion line");
    let converted = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("\"$PY\" -c {line}"))
        .env("PY", python())
        .env("OMP_NUM_THREADS", "1")
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        converted.status.success(),
        "{line}: {}",
        String::from_utf8_lossy(&converted.stderr)
    );
    let ok = check(&hf).run();
    assert!(
        ok.stdout.contains("1 dropped"),
        "the tied head is left out: {}",
        ok.stdout
    );
    // The file alone names no sizes: the error says the directory has them.
    check(&hf.join("model.safetensors"))
        .exit(2)
        .stderr_has(&format!(
            "init_from = \"{}\", the directory, takes them from its config.json",
            hf.display()
        ))
        .run();
}

#[test]
fn a_prompt_that_fills_its_window_trains_nothing_and_poisons_nothing() {
    let t = sft(&Test::new());
    // Nine prompt tokens fill a window of seq_len 8 (+1): the completion is cut off whole.
    let long = serde_json::json!({"prompt": "one two three four five six seven eight one", "completion": "two"});
    let short = serde_json::json!({"prompt": "one two", "completion": "three four"});
    let mixed = t.dir().join("mixed.jsonl");
    let lines: Vec<String> = (0..12)
        .map(|i| if i % 2 == 0 { &long } else { &short }.to_string())
        .collect();
    std::fs::write(&mixed, lines.join("\n")).unwrap();
    // One pair a step: a step whose pair carries no loss divides nothing by its zero tokens.
    let run = t
        .clone()
        .set("data.path", mixed.display().to_string())
        .set("train.batch_size", 1)
        .stderr_has("6 of 12 pairs have no completion token within data.seq_len = 8 tokens")
        .run();
    let last = run.summary().last.expect("an epoch ended");
    assert!(last.train_loss.is_finite(), "{:?}", last.train_loss);
    for (name, w) in tensors(&run.final_model()) {
        assert!(w.isfinite().all().int64_value(&[]) == 1, "{name} is not finite");
    }
    let only_long = t.dir().join("long.jsonl");
    std::fs::write(&only_long, vec![long.to_string(); 6].join("\n")).unwrap();
    t.clone()
        .name("long")
        .set("data.path", only_long.display().to_string())
        .exit(2)
        .stderr_has("no pair has a completion token within data.seq_len = 8 tokens")
        .run();
}

#[test]
fn fit_tries_a_frozen_bf16_base_in_the_one_precision_it_runs_in() {
    // docs/language-models.md's levers on the digits MLP: a frozen layer kept in bf16 under
    // bf16-mixed, which no fp32 probe may run.
    let t = Test::new()
        .set("train.precision", "bf16-mixed")
        .set("train.frozen_dtype", "bf16")
        .set("train.freeze", toml::Value::Array(vec!["fc0.*".into()]))
        .command("fit");
    let limit = ["--limit", "64MiB", "--steps", "2", "--checkpointing", "off"];
    let o = t.clone().args(&limit).run();
    assert!(
        o.stdout.contains("recommendation: precision bf16-mixed"),
        "{}",
        o.stdout
    );
    assert!(!o.stderr.contains("probe  fp32"), "{}", o.stderr);
    t.clone()
        .args(&limit)
        .args(&["--precision", "fp32"])
        .exit(2)
        .stderr_has("--precision fp32: train.frozen_dtype = \"bf16\" keeps the frozen weights in bf16")
        .run();
}

#[test]
fn check_refuses_an_image_folder_run_would_refuse() {
    let t = Test::new();
    let (train, val) = (t.dir().join("train"), t.dir().join("val"));
    for class in ["cat", "dog"] {
        std::fs::create_dir_all(train.join(class)).unwrap();
        std::fs::create_dir_all(val.join(class)).unwrap();
        // check lists the folders; it decodes nothing.
        std::fs::write(val.join(class).join("1.png"), b"").unwrap();
    }
    std::fs::write(train.join("cat").join("1.jpg"), b"").unwrap();
    std::fs::write(train.join("dog").join("notes.txt"), b"").unwrap();
    let check = t.clone().command("check").spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"resnet18\"\n\
         [data]\nsource = \"imagefolder\"\npath = \"{}\"\nval_path = \"{}\"\nimage_size = 32\n[train]\nbatch_size = 2\n",
        train.display(),
        val.display()
    )));
    check
        .clone()
        .exit(2)
        .stderr_has("class directory dog has no .jpg, .jpeg or .png files")
        .run();
    std::fs::write(train.join("dog").join("1.PNG"), b"").unwrap();
    check.clone().run();
    std::fs::create_dir_all(val.join("fish")).unwrap();
    check
        .exit(2)
        .stderr_has("has classes [\"cat\", \"dog\", \"fish\"] but data.path has [\"cat\", \"dog\"]")
        .run();
}

/// A LoRA run of the digits MLP over an earlier run's weights.
fn lora_run(t: &Test) -> Outcome {
    let base = mlp_checkpoint(t);
    t.clone()
        .name("lora")
        .set("train.epochs", 1)
        .set("model.init_from", base.display().to_string())
        .set("model.lora", toml::Value::Table(table("rank = 2\ntargets = [\"fc0\"]")))
        .stderr_has("created (initialised as built)")
        .run()
}

#[test]
fn export_refuses_a_format_before_it_reads_the_base() {
    let t = Test::new();
    let run = lora_run(&t);
    let out = t.dir().join("exported");
    let r = export(&t, &run.out, "huggingface", &out)
        .exit(2)
        .stderr_has("huggingface cannot hold this model")
        .run();
    assert!(
        !r.stderr.contains("model.init_from"),
        "the base was read first: {}",
        r.stderr
    );
    assert!(!out.exists());
}

#[test]
fn eval_of_a_lora_run_does_not_call_its_trained_adapters_created() {
    let t = Test::new();
    let run = lora_run(&t);
    let e = t
        .clone()
        .command("eval")
        .no_spec()
        .arg(&run.out.display().to_string())
        .stderr_has("tensors of the base read; the checkpoint's weights go over them")
        .run();
    assert!(!e.stderr.contains("created (initialised as built)"), "{}", e.stderr);
}

#[test]
fn a_run_is_evaluated_from_another_directory_than_it_ran_in() {
    // The data named relative to where the run starts (the repository, for the tests).
    let t = Test::new()
        .name("digits")
        .set("train.epochs", 1)
        .set("data.path", "data/digits.npz");
    let run = t.clone().run();
    let resolved = std::fs::read_to_string(run.out.join("config.resolved.toml")).unwrap();
    assert!(resolved.contains(&format!("path = \"{}\"", digits())), "{resolved}");
    let e = std::process::Command::new(env!("CARGO_BIN_EXE_memtrain"))
        .args(["eval", &run.out.display().to_string()])
        .current_dir(t.dir())
        .env("MEMTRAIN_RUNS_DIR", t.dir().join("registry"))
        .output()
        .unwrap();
    assert!(e.status.success(), "{}", String::from_utf8_lossy(&e.stderr));
}

/// `memtrain export RUN --format FORMAT OUT`.
fn export(t: &Test, run: &Path, format: &str, out: &Path) -> Test {
    t.clone().command("export").no_spec().args(&[
        &run.display().to_string(),
        "--format",
        format,
        &out.display().to_string(),
    ])
}
