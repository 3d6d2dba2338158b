//! The llama preset against Hugging Face: tiny random `LlamaForCausalLM` and `Qwen2ForCausalLM`
//! models built in Python (tests/py/llama_reference.py) and saved by `save_pretrained` load
//! through `model.init_from` with their sizes from `config.json`, and give transformers' logits;
//! `check` takes such a directory with no sizes in the spec; bad options are spec errors.
use std::path::Path;

use crate::common::*;

/// tests/py/llama_reference.py with `args` in `dir`; its JSON output.
#[track_caller]
fn llama_py(dir: &Path, args: &[&str]) -> serde_json::Value {
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
fn loaded(m: &memtrain::spec::Model) -> (tch::nn::VarStore, memtrain::model::Built) {
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let built = memtrain::model::build(&vs.root(), m).unwrap();
    let load = memtrain::run::init_from(&vs, &built.head, m, m.init_from.as_ref().unwrap()).unwrap();
    assert_eq!((load.created, load.dropped), (0, 0), "every tensor matched: {load:?}");
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
    llama_py(t.dir(), &["make", "--out", "hf", "--shards", "3", "--io", "io.safetensors"]);
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
        .stderr_has(&format!("names the shard {}, which does not exist", hf.join(shards[1]).display()))
        .run();
}
