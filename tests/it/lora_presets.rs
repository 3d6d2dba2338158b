//! LoRA on the resnet18 preset (its convolutions and fc) and the mlp preset (its linear layers)
//! against peft on torchvision's resnet18 and an equal MLP: the same base and initial adapters
//! (written by peft and passed through `model.init_from`), the same batches, the same AdamW: the
//! same per-step losses. The merged export loads in torchvision and gives memtrain's logits and
//! peft's `merge_and_unload()`.
use std::path::Path;

use crate::common::*;

fn reference(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new(python())
        .arg(repo().join("tests/py/lora_presets_reference.py"))
        .args(args)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// peft's run from `init.safetensors`: its per-step losses and its trainable count, after
/// checking that it kept its base.
fn peft_train(dir: &Path, model: &str, extra: &[&str]) -> (Vec<f64>, i64) {
    let mut args = vec![
        "train",
        "--model",
        model,
        "--init",
        "init.safetensors",
        "--data",
        "d.npz",
    ];
    args.extend(extra);
    let py: serde_json::Value = serde_json::from_str(&reference(dir, &args)).unwrap();
    assert_eq!(py["base_unchanged"], true, "peft keeps its base");
    let losses = floats(&py["losses"]);
    (losses, py["trainable"].as_i64().unwrap())
}

const JOB: &str = "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n";
const TRAIN: &str = "[train]\nepochs = 2\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.001\nweight_decay = 0.01\n\
                     optimizer_impl = \"single\"\n[log]\nevery_steps = 1\nprogress = \"off\"\n";

fn data(dir: &Path) -> String {
    let d = dir.join("d.npz");
    format!(
        "[data]\nsource = \"npz\"\npath = \"{0}\"\nval_path = \"{0}\"\n",
        d.display()
    )
}

/// torchvision's resnet18 at 16 px with 4 classes; adapters of rank 4 on the stem's and every
/// block's conv1, the blocks' conv2, the downsampling convolutions and fc.
fn resnet_spec(dir: &Path) -> String {
    format!(
        "{JOB}[model]\npreset = \"resnet18\"\ninit_from = \"{init}\"\n\
         [model.resnet18]\nimage_size = 16\nnum_classes = 4\n\
         [model.lora]\nrank = 4\nalpha = 8.0\ntargets = [\"conv1\", \"layer*.conv2\", \"downsample.0\", \"fc\"]\n\
         {data}{TRAIN}",
        init = dir.join("init.safetensors").display(),
        data = data(dir),
    )
}

/// memtrain's mlp (12 → 16 → 16 → 4) with adapters on fc0 and fc1 and fc2 trained whole (peft's
/// `modules_to_save`).
fn mlp_spec(dir: &Path) -> String {
    format!(
        "{JOB}[model]\npreset = \"mlp\"\ninit_from = \"{init}\"\n\
         [model.mlp]\ninputs = 12\nhidden = [16, 16]\nnum_classes = 4\n\
         [model.lora]\nrank = 4\nalpha = 8.0\ntargets = [\"fc0\", \"fc1\"]\nextras = [\"fc2\"]\n\
         {data}{TRAIN}",
        init = dir.join("init.safetensors").display(),
        data = data(dir),
    )
}

fn init(dir: &Path, model: &str) {
    reference(
        dir,
        &["init", "--model", model, "--out", "init.safetensors", "--data", "d.npz"],
    );
}

fn is_buffer(name: &str) -> bool {
    name.contains(".running_") || name.ends_with(".num_batches_tracked")
}

/// Each tensor of `ours` within `rel` (of its largest value) of the tensor of that name in
/// `theirs`.
fn assert_tensors_close(ours: &[(String, tch::Tensor)], theirs: &[(String, tch::Tensor)], rel: f64) {
    for (name, a) in ours {
        let (_, b) = theirs
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("peft has no {name}"));
        let (a, b) = (a.to_kind(tch::Kind::Double), b.to_kind(tch::Kind::Double));
        let gap = (&a - &b).abs().max().double_value(&[]);
        let scale = b.abs().max().double_value(&[]).max(1e-12);
        assert!(
            gap <= rel * scale,
            "{name}: differs from peft's by {gap} (scale {scale})"
        );
    }
}

/// Exports `run_dir`'s last checkpoint as torchvision's model, loads it there strictly, and checks
/// its logits against memtrain's (adapters unmerged) and peft's merge of the same base and
/// adapters.
fn export_loads_in_torchvision(t: &Test, run_dir: &Path, model: &str) {
    let dir = t.dir().to_path_buf();
    let out = dir.join(format!("{model}-torchvision"));
    let trained = final_model(run_dir);
    let ck = trained.parent().unwrap();
    t.clone()
        .no_spec()
        .command("export")
        .args_replaced(&[
            run_dir.to_str().unwrap(),
            "--format",
            "torchvision",
            out.to_str().unwrap(),
            "--checkpoint",
            ck.to_str().unwrap(),
        ])
        .run();
    let io = dir.join(format!("{model}-io.safetensors"));
    reference(
        &dir,
        &[
            "load",
            out.to_str().unwrap(),
            "--model",
            model,
            "--data",
            "d.npz",
            "--out",
            io.to_str().unwrap(),
            "--init",
            "init.safetensors",
            "--trained",
            trained.to_str().unwrap(),
        ],
    );
    let io = tensors(&io);
    let get = |n: &str| io.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let ours = {
        let read = memtrain::export::Trained::read(run_dir, Some(ck)).unwrap();
        tch::no_grad(|| read.built.net.forward_t(&get("x"), false))
    };
    for key in ["logits", "peft_logits"] {
        let theirs = get(key);
        let gap = (&ours - &theirs).abs().max().double_value(&[]);
        let scale = theirs.abs().max().double_value(&[]);
        assert!(
            scale > 0.1,
            "{model} {key}: the logits are not trivially zero ({scale})"
        );
        assert!(
            gap <= 1e-5 * scale,
            "{model} {key}: logits differ by {gap} (scale {scale})"
        );
    }
    let weight_gap = get("weight_gap").double_value(&[0]);
    assert!(
        weight_gap <= 1e-6,
        "{model}: merged weights differ from peft's by {weight_gap} relative"
    );
}

#[test]
fn mlp_lora_trains_as_peft_does_and_exports_merged() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    init(&dir, "mlp");
    let r = t.clone().spec(table(&mlp_spec(&dir))).run();
    let (theirs, trainable) = peft_train(&dir, "mlp", &[]);
    let ours = step_losses(&r);
    assert_eq!(ours.len(), 20);
    assert_close(&ours, &theirs, 1e-5);
    let kept = tensors(&r.final_model());
    let got: Vec<&String> = kept.iter().map(|(n, _)| n).collect();
    let init_names: Vec<String> = tensors(&dir.join("init.safetensors"))
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let want: Vec<&String> = init_names
        .iter()
        .filter(|n| n.contains(".lora_") || n.starts_with("fc2."))
        .collect();
    assert_eq!(got, want, "the checkpoint holds the adapters and fc2");
    let numel: i64 = kept.iter().map(|(_, t)| t.numel() as i64).sum();
    assert_eq!(numel, trainable, "the same tensors train on both sides");
    export_loads_in_torchvision(&t, &r.out, "mlp");
    // The mlp has no timm or Hugging Face counterpart: refused, nothing written.
    t.clone()
        .no_spec()
        .command("export")
        .args_replaced(&[
            r.out.to_str().unwrap(),
            "--format",
            "timm",
            dir.join("no").to_str().unwrap(),
        ])
        .exit(2)
        .stderr_has("timm cannot hold this model")
        .run();
    assert!(!dir.join("no").exists());
}

/// With `train.freeze_batchnorm_stats = false` the frozen BatchNorm layers normalize by the batch
/// and their running statistics follow it, as under peft (which leaves them in training mode):
/// the same losses, the same trained adapters and statistics, which the checkpoint keeps, so a
/// resume and the merged export carry them.
#[test]
fn resnet_lora_with_batch_statistics_trains_as_peft_does() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    init(&dir, "resnet");
    let t = t
        .spec(table(&resnet_spec(&dir)))
        .set("train.freeze_batchnorm_stats", false);
    let r = t.clone().name("straight").run();
    let (theirs, trainable) = peft_train(&dir, "resnet", &["--out", "peft.safetensors"]);
    let ours = step_losses(&r);
    assert_eq!(ours.len(), 20);
    assert_close(&ours, &theirs, 1e-5);

    // The checkpoint: the adapters and every BatchNorm's running statistics, as peft ends them.
    let kept = tensors(&r.final_model());
    let init_names: Vec<String> = tensors(&dir.join("init.safetensors"))
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let want: Vec<&String> = init_names
        .iter()
        .filter(|n| n.contains(".lora_") || is_buffer(n))
        .collect();
    let got: Vec<&String> = kept.iter().map(|(n, _)| n).collect();
    assert_eq!(
        got, want,
        "the checkpoint holds the adapters and the running statistics"
    );
    let numel: i64 = kept
        .iter()
        .filter(|(n, _)| !is_buffer(n))
        .map(|(_, t)| t.numel() as i64)
        .sum();
    assert_eq!(numel, trainable, "the same tensors train on both sides");
    assert!(kept
        .iter()
        .any(|(n, t)| n == "layer4.1.bn2.num_batches_tracked" && t.int64_value(&[]) == 20));
    assert_tensors_close(&kept, &tensors(&dir.join("peft.safetensors")), 1e-4);

    // Stopped after one epoch and resumed: the statistics come back with the adapters.
    let part = t.clone().name("part").set("train.epochs", 1).run();
    part.resume().args(&["--set", "train.epochs=2"]).run();
    assert_eq!(
        r.final_bytes(),
        part.final_bytes(),
        "a resumed run ends where a straight one does"
    );

    export_loads_in_torchvision(&t, &r.out, "resnet");
}

/// By default (`train.freeze_batchnorm_stats = true`) the frozen BatchNorm layers run as in eval
/// mode: the same losses as peft with its BatchNorm modules put in eval mode, and running
/// statistics that end as loaded.
#[test]
fn resnet_lora_keeps_batchnorm_frozen_by_default() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    init(&dir, "resnet");
    let r = t.clone().spec(table(&resnet_spec(&dir))).run();
    let (theirs, _) = peft_train(&dir, "resnet", &["--bn-eval"]);
    assert_close(&step_losses(&r), &theirs, 1e-5);
    let init = tensors(&dir.join("init.safetensors"));
    for (name, after) in tensors(&r.final_model()).iter().filter(|(n, _)| is_buffer(n)) {
        let (_, before) = init.iter().find(|(n, _)| n == name).unwrap();
        assert!(before.equal(after), "{name} stays as loaded");
    }
}

/// Targets that match none of the ResNet's layers are refused before training, with the layers'
/// short names.
#[test]
fn resnet_lora_targets_that_match_nothing_name_the_convolutions() {
    let t = Test::new();
    let spec = "[model]\npreset = \"resnet18\"\n[model.resnet18]\nimage_size = 16\nnum_classes = 4\n\
                [model.lora]\ntargets = [\"conv\"]\n[data]\nsource = \"synthetic\"\nsamples = 8\n";
    t.spec_text(spec)
        .exit(2)
        .stderr_has("model.lora.targets (conv) matches none of the resnet18 preset's convolutions and linear layers")
        .stderr_has("its layers are conv1, conv2, downsample.0, fc (a plain name matches a layer whose name ends with it, as layer1.0.conv1 ends with conv1)")
        .run();
}
