//! Other libraries' checkpoints through `model.init_from`: torchvision, timm, Hugging Face and
//! open_clip models built small and random in Python (tests/py/checkpoints.py), loaded into the
//! presets, whose logits then equal the Python model's; a head for another class count created
//! fresh and counted in summary.json; `check` showing and refusing what `run` would; pickles
//! refused with a conversion that works; and the load's host memory bounded by one tensor.
use std::path::{Path, PathBuf};

use crate::common::*;
use toml::Value;

/// tests/py/checkpoints.py with `args` in `dir`; its JSON output.
#[track_caller]
fn checkpoints(dir: &Path, args: &[&str]) -> serde_json::Value {
    let o = std::process::Command::new(python())
        .arg(repo().join("tests/py/checkpoints.py"))
        .args(args)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "checkpoints.py {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(text.trim()).unwrap_or(serde_json::Value::Null)
}

/// The tiny ViT the script builds (image 32, patch 8, 2 layers, 2 heads, width 16, MLP 24), as
/// `[model.vit]` options with `extra` lines.
fn vit_options(classes: i64, extra: &str) -> String {
    format!(
        "image_size = 32\npatch_size = 8\nlayers = 2\nheads = 2\nhidden_dim = 16\nmlp_dim = 24\nnum_classes = {classes}\n{extra}"
    )
}

fn model(preset: &str, options: &str) -> memtrain::spec::Model {
    let mut m = memtrain::spec::Model {
        preset: preset.into(),
        ..Default::default()
    };
    m.options.insert(preset.into(), Value::Table(table(options)));
    m
}

/// `kind` made by the script at `out` with its input and logits, loaded into `m` through
/// `model.init_from`; memtrain's logits on the same input equal Python's within 1e-5.
#[track_caller]
fn same_logits(kind: &str, out: &str, m: &memtrain::spec::Model, extra: &[&str]) -> memtrain::records::InitLoad {
    let t = Test::new();
    let dir = t.dir();
    let mut args = vec!["make", kind, "--out", out, "--io", "io.safetensors"];
    args.extend_from_slice(extra);
    checkpoints(dir, &args);
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let built = memtrain::model::build(&vs.root(), m).unwrap();
    let load = memtrain::run::init_from(&vs, &built.head, m, &dir.join(out)).unwrap();
    let io = tensors(&dir.join("io.safetensors"));
    let get = |n: &str| io.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let theirs = get("logits");
    let ours = tch::no_grad(|| built.net.forward_t(&get("x"), false));
    assert_eq!(ours.size(), theirs.size());
    let gap = (&ours - &theirs).abs().max().double_value(&[]);
    let scale = theirs.abs().max().double_value(&[]);
    eprintln!("{kind}: logits differ by at most {gap:e} (largest {scale}); {load:?}");
    assert!(scale > 0.1, "the logits are not trivially zero ({scale})");
    assert!(
        gap <= 1e-5 * scale.max(1.0),
        "{kind}: logits differ by {gap} (scale {scale})"
    );
    load
}

#[test]
fn torchvision_vit_and_resnet_load_and_give_their_logits() {
    let l = same_logits(
        "torchvision-vit",
        "m.safetensors",
        &model("vit", &vit_options(5, "")),
        &[],
    );
    assert_eq!((l.format.as_str(), l.created, l.dropped), ("torchvision", 0, 0));
    let resnet = model("resnet18", "num_classes = 5\nimage_size = 32");
    let l = same_logits("torchvision-resnet", "m.safetensors", &resnet, &[]);
    assert_eq!((l.format.as_str(), l.created, l.dropped), ("torchvision", 0, 0));
}

#[test]
fn timm_vit_and_resnet_load_and_give_their_logits() {
    let l = same_logits("timm-vit", "m.safetensors", &model("vit", &vit_options(5, "")), &[]);
    assert_eq!((l.format.as_str(), l.created, l.dropped), ("timm", 0, 0));
    let resnet = model("resnet18", "num_classes = 5\nimage_size = 32");
    let l = same_logits("timm-resnet", "m.safetensors", &resnet, &[]);
    assert_eq!((l.created, l.dropped), (0, 0));
}

#[test]
fn a_hugging_face_vit_directory_loads_with_query_key_and_value_joined() {
    // Hugging Face ViT's LayerNorm epsilon is 1e-12; its config.json says so.
    let m = model("vit", &vit_options(5, "layer_norm_eps = 1e-12"));
    let l = same_logits("hf-vit", "hf", &m, &["--eps", "1e-12"]);
    assert_eq!((l.format.as_str(), l.created, l.dropped), ("huggingface", 0, 0));
}

#[test]
fn clip_vision_towers_load_from_hugging_face_and_open_clip_names() {
    // CLIPVisionModelWithProjection's image embeddings: the projection is the last layer, so the
    // head is left out of the comparison by a projection-width identity head.
    let clip =
        "layer_norm_eps = 1e-5\nactivation = \"quick_gelu\"\npre_norm = true\npatch_bias = false\nprojection_dim = 12";
    let m = model("vit", &vit_options(12, clip));
    for (kind, out, format) in [
        ("hf-clip", "hf", "huggingface"),
        ("open-clip", "m.safetensors", "open_clip"),
    ] {
        let l = same_logits_through_projection(kind, out, &m);
        assert_eq!(l.format, format);
        assert_eq!(l.created, 2, "CLIP has no head: heads.head.{{weight,bias}} are created");
    }
}

/// `same_logits` for a CLIP tower, whose Python output is the projection's: memtrain's head is
/// set to the identity after the load (it was created fresh), so the logits are the projection.
#[track_caller]
fn same_logits_through_projection(kind: &str, out: &str, m: &memtrain::spec::Model) -> memtrain::records::InitLoad {
    let t = Test::new();
    let dir = t.dir();
    checkpoints(dir, &["make", kind, "--out", out, "--io", "io.safetensors"]);
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let built = memtrain::model::build(&vs.root(), m).unwrap();
    let load = memtrain::run::init_from(&vs, &built.head, m, &dir.join(out)).unwrap();
    let vars = vs.variables();
    tch::no_grad(|| {
        vars["heads.head.weight"]
            .shallow_clone()
            .copy_(&tch::Tensor::eye(12, (tch::Kind::Float, tch::Device::Cpu)));
        let _ = vars["heads.head.bias"].shallow_clone().zero_();
    });
    let io = tensors(&dir.join("io.safetensors"));
    let get = |n: &str| io.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let theirs = get("logits");
    let ours = tch::no_grad(|| built.net.forward_t(&get("x"), false));
    let gap = (&ours - &theirs).abs().max().double_value(&[]);
    let scale = theirs.abs().max().double_value(&[]);
    eprintln!("{kind}: image embeddings differ by at most {gap:e} (largest {scale}); {load:?}");
    assert!(scale > 0.1);
    assert!(
        gap <= 1e-5 * scale.max(1.0),
        "{kind}: embeddings differ by {gap} (scale {scale})"
    );
    load
}

#[test]
fn a_sharded_checkpoint_loads_through_its_index_or_its_directory() {
    let m = model("vit", &vit_options(5, ""));
    for out in ["shards/model.safetensors.index.json", "shards"] {
        let l = same_logits("torchvision-vit", out, &m, &["--shards", "3"]);
        assert_eq!((l.created, l.dropped), (0, 0));
    }
}

/// A job on random `size`×`size` images of `classes` classes for the `[model]` body.
fn job_on(t: &Test, model: &str, size: i64, classes: &str) -> Test {
    let shape = format!("3,{size},{size}");
    for (out, n) in [("d.npz", "12"), ("v.npz", "4")] {
        reference(
            t.dir(),
            &["data", "--out", out, "--n", n, "--shape", &shape, "--classes", classes],
        );
    }
    t.clone().spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\n{model}\n\
         [data]\nsource = \"npz\"\npath = \"{}\"\nval_path = \"{}\"\n\
         [train]\nepochs = 1\nbatch_size = 4\noptimizer = \"sgd\"\nlr = 0.01\n[log]\nevery_steps = 1\nprogress = \"off\"\n",
        t.dir().join("d.npz").display(),
        t.dir().join("v.npz").display()
    )))
}

#[test]
fn a_1000_class_checkpoint_fine_tunes_on_3_classes_with_a_new_head() {
    let t = Test::new();
    let info = checkpoints(
        t.dir(),
        &["make", "timm-vit", "--out", "m.safetensors", "--classes", "1000"],
    );
    let names = info["names"].as_array().unwrap().len() as u64;
    let init = t.dir().join("m.safetensors");
    let body = format!(
        "preset = \"vit\"\ninit_from = \"{}\"\n[model.vit]\n{}",
        init.display(),
        vit_options(3, "")
    );
    let job = job_on(&t, &body, 32, "3");
    // check shows the plan from the header alone.
    let c = job.clone().name("check").command("check").run();
    assert!(c.stdout.contains("2 created"), "{}", c.stdout);
    assert!(c.stdout.contains("heads.head.bias, heads.head.weight"), "{}", c.stdout);
    let r = job
        .clone()
        .name("run")
        .stderr_has("created (initialised as built)")
        .run();
    let s = r.summary();
    assert_eq!(s.status, memtrain::records::Status::Completed);
    let init = s.init.expect("summary.json says what init_from loaded");
    assert_eq!(init.format, "timm");
    assert_eq!(
        (init.kept, init.created, init.dropped, init.missing),
        (names - 2, 2, 2, 0)
    );
    assert!(r.steps().iter().all(|st| st.loss.is_finite()));

    // init_skip leaves more as built: the last block's MLP too.
    let skip = job
        .name("skip")
        .set(
            "model.init_skip",
            Value::Array(vec![Value::from("encoder.layers.encoder_layer_1.mlp.*")]),
        )
        .run();
    let init = skip.summary().init.unwrap();
    assert_eq!((init.kept, init.created, init.dropped), (names - 6, 6, 6));
}

/// A body tensor of another shape, or missing from the file: `check` and `run` refuse alike,
/// `check` at the spec's `init_from` line, and nothing is written.
#[test]
fn check_refuses_a_mis_shaped_tensor_outside_the_head_at_init_froms_line() {
    let t = Test::new();
    checkpoints(t.dir(), &["make", "torchvision-vit", "--out", "m.safetensors"]);
    let body = format!(
        "preset = \"vit\"\ninit_from = \"{}\"\n[model.vit]\n{}",
        t.dir().join("m.safetensors").display(),
        vit_options(5, "").replace("mlp_dim = 24", "mlp_dim = 32")
    );
    let job = job_on(&t, &body, 32, "5");
    let c = job.clone().command("check").exit(2).run();
    // At init_from's line in the spec file, with the tensor and both shapes.
    let spec = std::fs::read_to_string(c.test.spec_path()).unwrap();
    let line = 1 + spec.lines().position(|l| l.starts_with("init_from")).unwrap();
    let at = format!(
        ".toml:{line}:1: model.init_from {}",
        t.dir().join("m.safetensors").display()
    );
    assert!(c.stderr.contains(&at), "{at}: {}", c.stderr);
    assert!(
        c.stderr
            .contains("encoder.layers.encoder_layer_0.mlp.0.bias: file [24], model [32]"),
        "{}",
        c.stderr
    );
    job.name("run")
        .exit(2)
        .stderr_has("encoder.layers.encoder_layer_0.mlp.0.bias: file [24], model [32]")
        .run();
    assert!(!t.dir().join("run").exists(), "the refused run wrote nothing");

    // A tensor of the body missing from the file: an error in both, naming it, nothing written.
    let mut all = tensors(&t.dir().join("m.safetensors"));
    all.retain(|(n, _)| n != "encoder.ln.weight");
    tch::Tensor::write_safetensors(&all, t.dir().join("short.safetensors")).unwrap();
    let body = format!(
        "preset = \"vit\"\ninit_from = \"{}\"\n[model.vit]\n{}",
        t.dir().join("short.safetensors").display(),
        vit_options(5, "")
    );
    let missing = "missing (in the model, not in the file): encoder.ln.weight";
    for command in ["check", "run"] {
        let o = job_on(&t, &body, 32, "5")
            .name(&format!("short-{command}"))
            .command(command)
            .exit(2)
            .stderr_has(missing)
            .run();
        assert!(!o.out.exists(), "{command} wrote {}", o.out.display());
    }
}

#[test]
fn a_pickle_is_refused_with_a_conversion_that_works() {
    let t = Test::new();
    checkpoints(t.dir(), &["make", "torchvision-vit", "--out", "m.safetensors"]);
    let o = std::process::Command::new(python())
        .args([
            "-c",
            "import torch; from safetensors.torch import load_file; torch.save(load_file('m.safetensors'), 'm.pth')",
        ])
        .current_dir(t.dir())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_file(t.dir().join("m.safetensors")).unwrap();
    let body = |f: &str| {
        format!(
            "preset = \"vit\"\ninit_from = \"{}\"\n[model.vit]\n{}",
            t.dir().join(f).display(),
            vit_options(5, "")
        )
    };
    let r = job_on(&t, &body("m.pth"), 32, "5")
        .exit(2)
        .stderr_has("loading a pickle can run any code it holds")
        .run();
    // The error's own line converts the file.
    let line = r
        .stderr
        .lines()
        .find(|l| l.trim_start().starts_with("python -c"))
        .unwrap();
    let code = line.trim_start().strip_prefix("python -c ").unwrap().trim_matches('"');
    // The spec reference's conversion is this line (its paths the file's own there), so the venv
    // that runs it runs the docs' too.
    let docs = std::fs::read_to_string(repo().join("docs/spec.md")).unwrap();
    let generic = line.trim_start().replace(&format!("{}/", t.dir().display()), "");
    assert!(
        docs.contains(&generic),
        "docs/spec.md lacks the error's conversion: {generic}"
    );
    let o = std::process::Command::new(python())
        .args(["-c", code])
        .current_dir(t.dir())
        .output()
        .unwrap();
    assert!(o.status.success(), "{code}: {}", String::from_utf8_lossy(&o.stderr));
    let r = job_on(&t, &body("m.safetensors"), 32, "5").name("converted").run();
    let init = r.summary().init.unwrap();
    assert_eq!((init.created, init.dropped, init.missing), (0, 0, 0));
}

#[test]
fn a_hugging_face_config_gives_the_sizes_and_a_contradicting_spec_is_named() {
    let t = Test::new();
    checkpoints(t.dir(), &["make", "hf-vit", "--out", "hf", "--eps", "1e-12"]);
    let hf = t.dir().join("hf");
    let body = format!(
        "preset = \"vit\"\ninit_from = \"{}\"\n[model.vit]\nnum_classes = 5",
        hf.display()
    );
    let job = job_on(&t, &body, 32, "5");
    let c = job.clone().command("check").run();
    for line in [
        "hidden_dim = 16",
        "layers = 2",
        "mlp_dim = 24",
        "layer_norm_eps = 0.000000000001",
        "0 created, 0 dropped",
    ] {
        assert!(c.stdout.contains(line), "{line}: {}", c.stdout);
    }
    job.set("model.vit.layers", 3)
        .command("check")
        .exit(2)
        .stderr_has("model.vit.layers is 3, but the checkpoint's")
        .stderr_has("config.json says num_hidden_layers = 2")
        .run();
}

#[test]
fn a_hugging_face_directory_runs_with_its_configs_sizes_and_pythons_loss() {
    let t = Test::new();
    let hf = t.dir().join("hf");
    let body = format!(
        "preset = \"vit\"\ninit_from = \"{}\"\n[model.vit]\nnum_classes = 5",
        hf.display()
    );
    // The sizes, the LayerNorm epsilon (1e-12) among them, come from config.json alone.
    let job = job_on(&t, &body, 32, "5").set("train.lr", 1e-12);
    let v = t.dir().join("v.npz");
    let py = checkpoints(
        t.dir(),
        &[
            "make",
            "hf-vit",
            "--out",
            "hf",
            "--eps",
            "1e-12",
            "--val",
            v.to_str().unwrap(),
        ],
    );
    let theirs = py["val_loss"].as_f64().unwrap();
    let r = job.run();
    let s = r.summary();
    let ours = s.last.as_ref().and_then(|e| e.val_loss).unwrap();
    eprintln!("validation loss: memtrain {ours}, transformers {theirs}");
    assert!((ours - theirs).abs() <= 1e-5 * theirs.abs(), "{ours} vs {theirs}");
    let init = s.init.unwrap();
    assert_eq!(
        (init.format.as_str(), init.created, init.dropped),
        ("huggingface", 0, 0)
    );
}

#[test]
fn position_embeddings_at_another_image_size_are_resampled_as_timm_does() {
    let t = Test::new();
    checkpoints(
        t.dir(),
        &["resample", "--from", "4", "--to", "6", "--out", "r.safetensors"],
    );
    let r = tensors(&t.dir().join("r.safetensors"));
    let get = |n: &str| r.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let ours = memtrain::weights::resample_pos_embed(&get("pos"), 4, 6).unwrap();
    let theirs = get("resampled");
    assert_eq!(ours.size(), theirs.size());
    let gap = (&ours - &theirs).abs().max().double_value(&[]);
    eprintln!("resampled position embeddings differ from timm's by at most {gap:e}");
    assert!(gap <= 1e-5, "{gap}");

    // A 32×32 checkpoint fine-tuned at 48×48: the run says so and counts it.
    checkpoints(t.dir(), &["make", "timm-vit", "--out", "m.safetensors"]);
    let body = format!(
        "preset = \"vit\"\ninit_from = \"{}\"\n[model.vit]\n{}",
        t.dir().join("m.safetensors").display(),
        vit_options(5, "").replace("image_size = 32", "image_size = 48")
    );
    let run = job_on(&t, &body, 48, "5").stderr_has("from a 4×4 grid to 6×6").run();
    assert_eq!(run.summary().init.unwrap().resampled, 1);
}

#[test]
fn loading_holds_one_tensor_of_host_memory_at_a_time() {
    // An MLP of 12 layers of 1024×1024: a 50 MiB checkpoint of 4 MiB tensors.
    let t = Test::new();
    let mlp = "preset = \"mlp\"\n[model.mlp]\ninputs = 1024\nhidden = [1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024]\nnum_classes = 4";
    let spec = |init: Option<PathBuf>| {
        let init = init
            .map(|p| format!("init_from = \"{}\"\n", p.display()))
            .unwrap_or_default();
        table(&format!(
            "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\n{init}{mlp}\n\
             [data]\nsource = \"synthetic\"\nsamples = 16\n[train]\nepochs = 1\nbatch_size = 8\noptimizer = \"sgd\"\nlr = 0.01\n\
             [log]\nprogress = \"off\"\n"
        ))
    };
    let first = t.clone().name("first").spec(spec(None)).run();
    let file = first.final_model();
    let size = std::fs::metadata(&file).unwrap().len();
    let warm = t.clone().name("warm").spec(spec(Some(file))).run();
    let init = warm.summary().init.unwrap();
    let largest = init.largest_tensor_bytes;
    eprintln!(
        "a {} MiB checkpoint (largest tensor {} MiB) loaded holding at most {} MiB of host memory",
        size >> 20,
        largest >> 20,
        init.peak_host_bytes >> 20
    );
    assert_eq!(largest, 4 << 20);
    assert!(size > 40 << 20);
    assert!(
        init.peak_host_bytes <= largest + (4 << 20),
        "the load held {} bytes, over one tensor ({largest}) and 4 MiB",
        init.peak_host_bytes
    );
    assert!(
        init.peak_host_bytes >= largest / 2,
        "the reading sees the tensor held: {}",
        init.peak_host_bytes
    );
}
