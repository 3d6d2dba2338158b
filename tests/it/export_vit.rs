//! `memtrain export` of the vit preset with CLIP's options: a trained run, exported, loads
//! strictly in each library that can compute it, built with the constructor docs/commands.md
//! gives, and gives memtrain's logits; a library that cannot is refused with the reason.
use crate::common::*;
use std::path::Path;

const SIZES: &str =
    "image_size = 16\npatch_size = 8\nlayers = 2\nheads = 2\nhidden_dim = 16\nmlp_dim = 32\nnum_classes = 4\n";

/// OpenAI CLIP's vision tower with a projection, under a class head.
const CLIP: &str =
    "layer_norm_eps = 1e-5\nactivation = \"quick_gelu\"\npre_norm = true\npatch_bias = false\nprojection_dim = 12\n";

fn vit_export(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new(python())
        .arg(repo().join("tests/py/vit_export.py"))
        .args(args)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

fn vit_model(options: &str) -> memtrain::spec::Model {
    let mut model = memtrain::spec::Model {
        preset: "vit".into(),
        init_from: None,
        init_format: Default::default(),
        init_skip: vec![],
        options: Default::default(),
    };
    let table: toml::Table = toml::from_str(&format!("{SIZES}{options}")).unwrap();
    model.options.insert("vit".into(), toml::Value::Table(table));
    model
}

/// A base under memtrain's names with values spread over [-0.5, 0.5) (a hash of the position,
/// not torch's generator, which the tests running beside this one draw from too), with norms
/// away from one and a head away from zero, so that a norm, a bias or a head put in the wrong
/// place shows in the logits.
fn write_init(path: &Path, options: &str) {
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    memtrain::model::build(&vs.root(), &vit_model(options)).unwrap();
    let sorted: std::collections::BTreeMap<String, tch::Tensor> = vs.variables().into_iter().collect();
    let named: Vec<(String, tch::Tensor)> = sorted
        .into_iter()
        .enumerate()
        .map(|(i, (n, t))| {
            let at = tch::Tensor::arange(t.numel() as i64, (tch::Kind::Double, tch::Device::Cpu));
            let hash = ((at * 12.9898 + 78.233 * i as f64).sin() * 43758.5453).frac().abs() - 0.5;
            let noise = hash.to_kind(t.kind()).view(t.size().as_slice());
            let v = match n.contains("ln") && n.ends_with(".weight") {
                true => noise * 0.2 + 1.0,
                false => noise * 0.6,
            };
            (n, v)
        })
        .collect();
    tch::Tensor::write_safetensors(&named, path).unwrap();
}

/// A two-step run from `init` on 8 images; `lora` is a `[model.lora]` table or "".
fn spec(dir: &Path, name: &str, options: &str, lora: &str) -> toml::Table {
    let init = dir.join(format!("{name}-init.safetensors"));
    write_init(&init, options);
    table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n\
         [model]\npreset = \"vit\"\ninit_from = \"{init}\"\n\
         [model.vit]\n{SIZES}{options}{lora}\
         [data]\nsource = \"npz\"\npath = \"{data}\"\nval_path = \"{data}\"\n\
         [train]\nepochs = 1\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.01\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        init = init.display(),
        data = dir.join("d.npz").display(),
    ))
}

/// Trains the run `name`, with the data written on first use.
fn trained(t: &Test, name: &str, options: &str, lora: &str) -> std::path::PathBuf {
    let dir = t.dir().to_path_buf();
    if !dir.join("d.npz").exists() {
        vit_export(&dir, &["data", "--out", "d.npz"]);
    }
    t.clone().name(name).spec(spec(&dir, name, options, lora)).run().out
}

fn export(t: &Test, run_dir: &Path, format: &str, out: &Path) -> Test {
    t.clone().no_spec().command("export").args_replaced(&[
        run_dir.to_str().unwrap(),
        "--format",
        format,
        out.to_str().unwrap(),
    ])
}

/// Exports `run_dir` as `format`, loads it there and requires memtrain's own logits (adapters
/// unmerged, projection unfolded) within 1e-5 of the largest.
fn loads_with_memtrains_logits(t: &Test, run_dir: &Path, format: &str) {
    let dir = t.dir().to_path_buf();
    let name = run_dir.file_name().unwrap().to_str().unwrap().to_owned();
    let out = dir.join(format!("{name}-{format}"));
    let printed = export(t, run_dir, format, &out).run().stdout;
    let trained = memtrain::export::Trained::read(run_dir, None).unwrap();
    let options: memtrain::model::VitOptions = trained.spec.model.options["vit"].clone().try_into().unwrap();
    assert_eq!(
        printed.contains("the projection is folded into the head"),
        options.projection_dim > 0,
        "{printed}"
    );
    if format == "timm" {
        // The constructor export prints builds the model the file loads into, strictly.
        let call = printed
            .lines()
            .find_map(|l| l.strip_prefix("load it into timm's "))
            .unwrap_or_else(|| panic!("no timm constructor in {printed}"));
        let script = format!(
            "from functools import partial\nfrom torch import nn\nfrom safetensors.torch import load_file\n\
             from timm.models.vision_transformer import VisionTransformer\n\
             m = {call}\nm.load_state_dict(load_file({:?}))\n",
            out.join("model.safetensors").display().to_string()
        );
        let o = std::process::Command::new(python())
            .args(["-c", &script])
            .output()
            .unwrap();
        assert!(o.status.success(), "{call}: {}", String::from_utf8_lossy(&o.stderr));
    }
    let json = dir.join(format!("{name}-options.json"));
    std::fs::write(&json, serde_json::to_vec(&options).unwrap()).unwrap();
    let io = dir.join(format!("{name}-{format}-io.safetensors"));
    let args = [
        "load",
        out.to_str().unwrap(),
        "--format",
        format,
        "--options",
        json.to_str().unwrap(),
        "--data",
        "d.npz",
        "--out",
        io.to_str().unwrap(),
    ];
    vit_export(&dir, &args);
    let io = tensors(&io);
    let get = |n: &str| io.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let ours = tch::no_grad(|| trained.built.net.forward_t(&get("x"), false));
    let theirs = get("logits");
    let gap = (&ours - &theirs).abs().max().double_value(&[]);
    let scale = theirs.abs().max().double_value(&[]);
    eprintln!("{name} as {format}: logits differ by at most {gap:e} (largest {scale})");
    assert!(
        scale > 0.1,
        "{name} {format}: the logits are not trivially zero ({scale})"
    );
    assert!(
        gap <= 1e-5 * scale,
        "{name} {format}: logits differ by {gap} (scale {scale})"
    );
}

/// The timm export of the run `name` (CLIP's options) read back as `model.init_from` (`norm_pre`
/// as `ln_pre`), into the preset without a projection (the export folded it into the head):
/// every tensor matched, and timm's logits.
fn reads_back(dir: &Path, name: &str) {
    let model = vit_model(&CLIP.replace("projection_dim = 12", "projection_dim = 0"));
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let built = memtrain::model::build(&vs.root(), &model).unwrap();
    let file = dir.join(format!("{name}-timm/model.safetensors"));
    let load = memtrain::run::init_from(&vs, &built.head, &model, &file).unwrap();
    assert_eq!((load.created, load.dropped), (0, 0), "every tensor matched: {load:?}");
    let io = tensors(&dir.join(format!("{name}-timm-io.safetensors")));
    let get = |n: &str| io.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let ours = tch::no_grad(|| built.net.forward_t(&get("x"), false));
    let theirs = get("logits");
    let gap = (&ours - &theirs).abs().max().double_value(&[]);
    let scale = theirs.abs().max().double_value(&[]);
    assert!(gap <= 1e-5 * scale, "read back: logits differ by {gap} (scale {scale})");
}

/// A CLIP vision tower fine-tuned with a class head (`pre_norm`, no patch bias, quick_gelu,
/// LayerNorm's 1e-5, a projection) is timm's `vit_*_clip_quickgelu_*` with `num_classes`, the
/// projection folded into the head; LoRA's adapters, the projection's among them, are merged
/// first. torchvision and transformers have no such classifier: refused, saying why, nothing
/// written.
#[test]
fn a_clip_vision_tower_with_a_class_head_exports_to_timm() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let clip = trained(&t, "clip", CLIP, "");
    loads_with_memtrains_logits(&t, &clip, "timm");
    reads_back(&dir, "clip");
    let lora =
        "[model.lora]\nrank = 4\nalpha = 8.0\ntargets = [\"in_proj_q\", \"in_proj_v\", \"mlp.0\", \"projection\"]\n\
                extras = [\"heads.head\"]\n";
    let adapted = trained(&t, "clip-lora", CLIP, lora);
    loads_with_memtrains_logits(&t, &adapted, "timm");
    let no = dir.join("no");
    export(&t, &clip, "torchvision", &no)
        .exit(2)
        .stderr_has(
            "torchvision cannot hold this model: torchvision's VisionTransformer has no LayerNorm before the first block (pre_norm); export it as timm",
        )
        .run();
    export(&t, &clip, "huggingface", &no)
        .exit(2)
        .stderr_has("huggingface cannot hold this model: no transformers image classifier has a LayerNorm before the first block (pre_norm)")
        .stderr_has("CLIPForImageClassification's head reads the mean of the patch tokens")
        .run();
    assert!(!no.exists(), "a refused export writes nothing");
}

/// Each CLIP option where the libraries differ: without `pre_norm`, quick_gelu and a projection
/// load in timm and transformers (torchvision's ViT has the exact GELU only); a missing patch
/// bias and a projection load in torchvision too; `pre_norm` with a patch bias loads in timm,
/// whose pre-norm ViT has none, with the bias in the patches' position embeddings.
#[test]
fn each_library_holds_the_clip_options_it_can_compute() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let quick = trained(
        &t,
        "quick",
        "layer_norm_eps = 1e-5\nactivation = \"quick_gelu\"\npatch_bias = false\nprojection_dim = 12\n",
        "",
    );
    for format in ["timm", "huggingface"] {
        loads_with_memtrains_logits(&t, &quick, format);
    }
    export(&t, &quick, "torchvision", &dir.join("no"))
        .exit(2)
        .stderr_has("torchvision's VisionTransformer computes the exact GELU, not quick_gelu")
        .run();
    let projected = trained(&t, "projected", "patch_bias = false\nprojection_dim = 12\n", "");
    loads_with_memtrains_logits(&t, &projected, "torchvision");
    let biased = trained(&t, "biased", "pre_norm = true\n", "");
    loads_with_memtrains_logits(&t, &biased, "timm");
    assert!(!dir.join("no").exists());
}
