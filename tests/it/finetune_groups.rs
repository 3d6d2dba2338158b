//! Frozen parameters and parameter groups through the built binary: frozen tensors stay as
//! they were and cost no gradient or optimizer state (in the records and in `check`), groups
//! train as PyTorch's param groups do (bit for bit on the CPU), `layer_decay` and `no_decay`
//! give timm's scales and decays, BatchNorm's frozen statistics and gradual unfreezing.
use std::path::Path;

use crate::common::*;

/// A resnet18 job on 16×16 images from PyTorch's initial weights: `n` training samples.
fn resnet_job(dir: &Path, n: &str, extra: &str) -> String {
    torchvision_init(dir, "resnet18", "4");
    for (file, n, seed) in [("d.npz", n, "0"), ("v.npz", "4", "1")] {
        let args = [
            "data",
            "--out",
            file,
            "--n",
            n,
            "--shape",
            "3,16,16",
            "--classes",
            "4",
            "--seed",
            seed,
        ];
        reference(dir, &args);
    }
    format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\ninit_from = \"{init}\"\npreset = \"resnet18\"\n\
         [model.resnet18]\nnum_classes = 4\nimage_size = 16\n\
         [data]\nsource = \"npz\"\npath = \"{d}\"\nval_path = \"{v}\"\n\
         [train]\nepochs = 1\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.01\nweight_decay = 0.01\n{extra}\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        init = dir.join("init.safetensors").display(),
        d = dir.join("d.npz").display(),
        v = dir.join("v.npz").display(),
    )
}

fn tensor<'a>(all: &'a [(String, tch::Tensor)], name: &str) -> &'a tch::Tensor {
    &all.iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
        .1
}

fn same_bits(a: &tch::Tensor, b: &tch::Tensor) -> bool {
    a.size() == b.size() && a.to_kind(tch::Kind::Float).equal(&b.to_kind(tch::Kind::Float))
}

const BACKBONE: &str = "freeze = [\"conv1.*\", \"bn1.*\", \"layer1.*\", \"layer2.*\"]";

fn frozen_name(n: &str) -> bool {
    ["conv1.", "bn1.", "layer1.", "layer2."]
        .iter()
        .any(|p| n.starts_with(p))
}

/// The frozen tensors are the initial weights bit for bit after training (their BatchNorm
/// statistics too, with `freeze_batchnorm_stats`'s default); the others moved. summary.json's
/// gradient and optimizer-state bytes fall by the frozen share of the weights, and `check`'s
/// estimate does too.
#[test]
fn frozen_parameters_stay_and_cost_no_gradient_or_state() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let full = t.clone().name("full").spec(table(&resnet_job(&dir, "8", ""))).run();
    let frozen = Test::new()
        .name("frozen")
        .spec(table(&resnet_job(&dir, "8", BACKBONE)))
        .run();
    let init = tensors(&dir.join("init.safetensors"));
    let ours = tensors(&frozen.final_model());
    let mut kept = 0;
    for (name, t0) in &init {
        let moved = !same_bits(t0, tensor(&ours, name));
        if frozen_name(name) && !name.ends_with("num_batches_tracked") {
            assert!(!moved, "{name} is frozen and changed");
            kept += 1;
        } else if name == "fc.weight" || name.starts_with("layer4.") && name.ends_with("conv1.weight") {
            assert!(moved, "{name} trains and did not change");
        }
    }
    assert!(kept > 20, "{kept} frozen tensors compared");
    let (f, u) = (full.summary().training.unwrap(), frozen.summary().training.unwrap());
    let weights: u64 = init
        .iter()
        .filter(|(n, _)| !n.contains("running_") && !n.ends_with("tracked"))
        .map(|(_, t)| t.numel() as u64)
        .sum();
    let frozen_weights: u64 = init
        .iter()
        .filter(|(n, _)| frozen_name(n) && !n.contains("running_") && !n.ends_with("tracked"))
        .map(|(_, t)| t.numel() as u64)
        .sum();
    assert_eq!(u.frozen_parameters, frozen_weights);
    assert_eq!(f.trainable_parameters, weights);
    let share = frozen_weights as f64 / weights as f64;
    for (what, a, b) in [
        ("gradient", f.gradient_bytes, u.gradient_bytes),
        ("optimizer state", f.optimizer_state_bytes, u.optimizer_state_bytes),
    ] {
        let fell = (a - b) as f64 / a as f64;
        assert!(
            (fell - share).abs() <= 0.01,
            "{what} bytes fell by {fell}, the frozen share is {share}"
        );
    }
    let check = |extra: &str| {
        let r = Test::new()
            .command("check")
            .spec(table(&resnet_job(&dir, "8", extra)))
            .run();
        let line = |key: &str| -> String {
            let l = r
                .stdout
                .lines()
                .find(|l| l.starts_with(key) && !l.contains('='))
                .unwrap_or_else(|| panic!("no {key} line: {}", r.stdout));
            let rest = l[key.len()..].trim_start();
            rest.split_whitespace().take(2).collect::<Vec<_>>().join(" ")
        };
        (
            line("gradients"),
            line("optimizer state"),
            line("parameters"),
            r.stdout.clone(),
        )
    };
    let (g_full, s_full, p_full, _) = check("");
    let (g_frozen, s_frozen, p_frozen, out) = check(BACKBONE);
    let bytes = |s: &str| memtrain::spec::schema::ByteSize::parse(&s.replace(' ', "")).unwrap().0 as f64;
    for (what, a, b) in [
        ("gradients", &g_full, &g_frozen),
        ("optimizer state", &s_full, &s_frozen),
    ] {
        let fell = (bytes(a) - bytes(b)) / bytes(a);
        assert!(
            (fell - share).abs() <= 0.01,
            "check's {what} fell by {fell} ({a} to {b}), the frozen share is {share}: {out}"
        );
    }
    assert_eq!(p_full, p_frozen, "the frozen weights are still parameters: {out}");
    assert!(out.contains("frozen (train.freeze)"), "{out}");
}

/// A pattern that matches nothing and a freeze of everything are spec errors, in `check` and
/// in `run`.
#[test]
fn freeze_patterns_that_miss_or_take_everything_are_refused() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    for command in ["check", "run"] {
        Test::new()
            .command(command)
            .spec(table(&resnet_job(&dir, "8", "freeze = [\"backbone.*\"]")))
            .exit(2)
            .stderr_has("\"backbone.*\" matches no parameter")
            .stderr_has("conv1.weight")
            .run();
        Test::new()
            .command(command)
            .spec(table(&resnet_job(&dir, "8", "freeze = [\"*\"]")))
            .exit(2)
            .stderr_has("nothing to train")
            .run();
    }
}

/// `freeze_batchnorm_stats = false`: a frozen BatchNorm keeps training its statistics (its
/// weight and bias still stay); with the default they stay too.
#[test]
fn frozen_batchnorm_statistics_follow_the_option() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let kept = Test::new()
        .name("kept")
        .spec(table(&resnet_job(&dir, "8", BACKBONE)))
        .run();
    let extra = format!("{BACKBONE}\nfreeze_batchnorm_stats = false");
    let trained = Test::new()
        .name("trained")
        .spec(table(&resnet_job(&dir, "8", &extra)))
        .run();
    let init = tensors(&dir.join("init.safetensors"));
    let (k, tr) = (tensors(&kept.final_model()), tensors(&trained.final_model()));
    let stat = "layer1.0.bn1.running_mean";
    assert!(
        same_bits(tensor(&init, stat), tensor(&k, stat)),
        "kept statistics changed"
    );
    assert!(
        !same_bits(tensor(&init, stat), tensor(&tr, stat)),
        "trained statistics did not change"
    );
    let w = "layer1.0.bn1.weight";
    assert!(
        same_bits(tensor(&init, w), tensor(&tr, w)),
        "a frozen BatchNorm weight changed"
    );
}

/// The mlp with a frozen first layer, two parameter groups, `no_decay` and a warmup, trained by
/// `optimizer` (spec keys and the reference's arguments) in `implementation`: memtrain's run,
/// once its per-step losses and final weights are checked against PyTorch's with the same
/// param groups (bit for bit).
fn groups_case(optimizer: (&str, &[&str]), implementation: &str) -> Outcome {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let init = [
        "mlp",
        "--inputs",
        "64",
        "--hidden",
        "64,32",
        "--classes",
        "4",
        "--out",
        "init.safetensors",
    ];
    reference(&dir, &init);
    for (file, n, seed) in [("d.npz", "96", "0"), ("v.npz", "4", "1")] {
        let args = [
            "data",
            "--out",
            file,
            "--n",
            n,
            "--shape",
            "64",
            "--classes",
            "4",
            "--seed",
            seed,
        ];
        reference(&dir, &args);
    }
    let spec = format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\ninit_from = \"{init}\"\npreset = \"mlp\"\n\
         [model.mlp]\ninputs = 64\nhidden = [64, 32]\nnum_classes = 4\n\
         [data]\nsource = \"npz\"\npath = \"{d}\"\nval_path = \"{v}\"\n\
         [train]\nepochs = 1\nbatch_size = 2\naccumulation_steps = 2\ngrad_clip_norm = 1.0\n\
         {optimizer}\noptimizer_impl = \"{implementation}\"\nwarmup_steps = 5\n\
         freeze = [\"fc0.*\"]\nno_decay = true\n\
         [[train.param_groups]]\nmatch = [\"fc2.*\"]\nlr_scale = 10.0\n\
         [[train.param_groups]]\nmatch = [\"fc1.weight\"]\nlr_scale = 0.5\nweight_decay = 0.1\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        init = dir.join("init.safetensors").display(),
        d = dir.join("d.npz").display(),
        v = dir.join("v.npz").display(),
        optimizer = optimizer.0,
    );
    let r = t.spec(table(&spec)).run();
    // The same groups for PyTorch, first match wins: fc2's bias without decay (no_decay), fc2's
    // weight at the default decay, fc1's weight at its own, fc1's bias without decay.
    let groups = r#"[[["fc2.bias"], 10.0, 0.0], [["fc2.weight"], 10.0, null], [["fc1.weight"], 0.5, 0.1], [["fc1.bias"], 1.0, 0.0]]"#;
    let mut args = vec![
        "train",
        "--model",
        "mlp:init.safetensors",
        "--train",
        "d.npz",
        "--epochs",
        "1",
        "--batch-size",
        "2",
        "--accumulation-steps",
        "2",
        "--clip",
        "1.0",
        "--seed",
        "3",
        "--impl",
        implementation,
        "--warmup",
        "5",
        "--freeze",
        "fc0.*",
        "--groups",
        groups,
    ];
    args.extend_from_slice(optimizer.1);
    let py: serde_json::Value = serde_json::from_str(&reference(&dir, &args)).unwrap();
    let theirs: Vec<f64> = floats(&py["losses"]);
    let ours = step_losses(&r);
    assert_eq!(ours.len(), 24);
    assert_close(&ours, &theirs, 1e-6);
    let finals = tensors(&r.final_model());
    for (name, want) in py["params"].as_object().unwrap() {
        let got = Vec::<f32>::try_from(&tensor(&finals, name).flatten(0, -1)).unwrap();
        let want: Vec<f32> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "{implementation} {}: {differ} of {name}'s values differ from PyTorch's",
            optimizer.0
        );
    }
    r
}

const ADAMW: (&str, &[&str]) = (
    "optimizer = \"adamw\"\nlr = 0.003\nweight_decay = 0.01",
    &["--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01"],
);

/// AdamW with the groups, bit for bit; the summary, the run's start and `memtrain report` list
/// the groups.
#[test]
fn parameter_groups_match_pytorch_param_groups_bit_for_bit() {
    let r = groups_case(ADAMW, "single");
    let training = r.summary().training.unwrap();
    let scale_of = |n: &str| {
        training
            .groups
            .iter()
            .find(|g| g.name == n)
            .map(|g| (g.lr_scale, g.weight_decay, g.parameters))
    };
    assert_eq!(scale_of("param_groups[0]"), Some((10.0, 0.01, 32 * 4)));
    assert_eq!(scale_of("param_groups[0], no_decay"), Some((10.0, 0.0, 4)));
    assert_eq!(scale_of("param_groups[1]"), Some((0.5, 0.1, 64 * 32)));
    assert_eq!(scale_of("no_decay"), Some((1.0, 0.0, 32)));
    assert_eq!(training.frozen_parameters, 64 * 64 + 64);
    // The run says its groups as it starts, and `memtrain report` lists them.
    for text in [
        &r.stderr,
        &Test::new()
            .no_spec()
            .command("report")
            .arg(r.out.to_str().unwrap())
            .run()
            .stdout,
    ] {
        assert!(
            text.contains("group param_groups[1]: 2048 parameters in 1 tensors"),
            "{text}"
        );
        assert!(text.contains("lr x0.5, weight decay 0.1"), "{text}");
        assert!(text.contains("frozen: "), "{text}");
    }
}

/// SGD with momentum and Adam too, and the foreach and fused implementations, which run each
/// group's update with its own numbers (as PyTorch's do per param group).
#[test]
fn parameter_groups_match_pytorch_in_every_optimizer_and_implementation() {
    let sgd: (&str, &[&str]) = (
        "optimizer = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nweight_decay = 0.0005",
        &[
            "--optimizer",
            "sgd",
            "--lr",
            "0.05",
            "--momentum",
            "0.9",
            "--weight-decay",
            "0.0005",
        ],
    );
    let adam: (&str, &[&str]) = (
        "optimizer = \"adam\"\nlr = 0.003\nweight_decay = 0.01",
        &["--optimizer", "adam", "--lr", "0.003", "--weight-decay", "0.01"],
    );
    for (optimizer, implementation) in [(sgd, "single"), (sgd, "fused"), (adam, "foreach"), (ADAMW, "fused")] {
        groups_case(optimizer, implementation);
    }
}

/// `layer_decay` and `no_decay` on the vit preset against timm's `param_groups_layer_decay` and
/// `param_groups_weight_decay` on a timm VisionTransformer of the same size, names mapped.
#[test]
fn layer_decay_and_no_decay_are_timms() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let py = python_json(&dir, TIMM_GROUPS);
    let model: memtrain::spec::schema::Model = toml::from_str(
        "preset = \"vit\"\n[vit]\nimage_size = 32\npatch_size = 8\nlayers = 3\nheads = 2\nhidden_dim = 8\nmlp_dim = 16\nnum_classes = 5",
    )
    .unwrap();
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let built = memtrain::model::build(&vs.root(), &model).unwrap();
    let infos = memtrain::model::param_infos(&vs, built.net.as_ref());
    let train = memtrain::spec::schema::Train {
        layer_decay: Some(0.75),
        no_decay: true,
        weight_decay: 0.05,
        ..Default::default()
    };
    let groups = memtrain::optim::Groups::resolve(&train, &infos).unwrap();
    let timm = py.as_object().unwrap();
    assert_eq!(timm.len(), infos.len(), "the same parameters: {timm:?}");
    for (p, g) in infos.iter().zip(&groups.of) {
        let setting = &groups.settings[g.unwrap()];
        let want = &timm[&p.name];
        assert_eq!(setting.lr_scale, want[0].as_f64().unwrap(), "{}'s lr scale", p.name);
        assert_eq!(
            setting.weight_decay,
            want[1].as_f64().unwrap(),
            "{}'s layer-decay weight decay",
            p.name
        );
        // param_groups_weight_decay's rule (with the ViT's no_weight_decay() set).
        assert_eq!(
            memtrain::optim::excluded_from_decay(p),
            want[2].as_bool().unwrap(),
            "{}'s no_decay",
            p.name
        );
    }
}

/// For each timm parameter under memtrain's name: [lr_scale, weight_decay] from
/// param_groups_layer_decay and whether param_groups_weight_decay leaves it undecayed.
const TIMM_GROUPS: &str = r#"
import json, re, torch
from timm.models.vision_transformer import VisionTransformer
from timm.optim._param_groups import param_groups_layer_decay, param_groups_weight_decay
m = VisionTransformer(img_size=32, patch_size=8, embed_dim=8, depth=3, num_heads=2, mlp_ratio=2.0, num_classes=5)
nwd = m.no_weight_decay()
def name(n):
    for a, b in [(r"^cls_token$", "class_token"), (r"^pos_embed$", "encoder.pos_embedding"),
                 (r"^patch_embed\.proj\.", "conv_proj."), (r"^norm\.", "encoder.ln."), (r"^head\.", "heads.head."),
                 (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.encoder_layer_\1.ln_1."),
                 (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.encoder_layer_\1.ln_2."),
                 (r"^blocks\.(\d+)\.attn\.qkv\.weight$", r"encoder.layers.encoder_layer_\1.self_attention.in_proj_weight"),
                 (r"^blocks\.(\d+)\.attn\.qkv\.bias$", r"encoder.layers.encoder_layer_\1.self_attention.in_proj_bias"),
                 (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.encoder_layer_\1.self_attention.out_proj."),
                 (r"^blocks\.(\d+)\.mlp\.fc1\.", r"encoder.layers.encoder_layer_\1.mlp.0."),
                 (r"^blocks\.(\d+)\.mlp\.fc2\.", r"encoder.layers.encoder_layer_\1.mlp.3.")]:
        if re.search(a, n):
            return re.sub(a, b, n)
    raise SystemExit("unmapped " + n)
ids = {id(p): n for n, p in m.named_parameters()}
out = {}
for g in param_groups_layer_decay(m, weight_decay=0.05, no_weight_decay_list=nwd, layer_decay=0.75):
    for p in g["params"]:
        out[name(ids[id(p)])] = [g["lr_scale"], g["weight_decay"], False]
for g in param_groups_weight_decay(m, weight_decay=0.05, no_weight_decay_list=nwd):
    for p in g["params"]:
        out[name(ids[id(p)])][2] = g["weight_decay"] == 0.0
print(json.dumps(out))
"#;

fn python_json(dir: &Path, code: &str) -> serde_json::Value {
    let o = std::process::Command::new(python())
        .arg("-c")
        .arg(code)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// `unfreeze_at_epoch = 2`: the frozen layer is unchanged after epoch 1 and trains in epoch 2;
/// a run stopped in epoch 2 and resumed ends bit-identical to the run that went through.
#[test]
fn gradual_unfreezing_is_exact_across_a_resume() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let extra = "unfreeze_at_epoch = 2\nfreeze = [\"conv1.*\", \"bn1.*\", \"layer1.*\"]";
    let spec = table(&resnet_job(&dir, "8", extra).replace("epochs = 1", "epochs = 2"));
    let through = t.clone().name("through").spec(spec.clone()).run();
    let init = tensors(&dir.join("init.safetensors"));
    let epoch1 = through.out.join("checkpoints");
    let mut dirs: Vec<_> = std::fs::read_dir(&epoch1)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")))
        .collect();
    dirs.sort();
    let first = tensors(&dirs[0].join("model.safetensors"));
    let last = tensors(&through.final_model());
    let w = "layer1.0.conv1.weight";
    assert!(same_bits(tensor(&init, w), tensor(&first, w)), "frozen in epoch 1");
    assert!(!same_bits(tensor(&init, w), tensor(&last, w)), "trains in epoch 2");
    let s = through.summary().training.unwrap();
    assert_eq!(s.frozen_parameters, 0);
    assert!(s.groups.iter().any(|g| g.start_step == 2), "{s:?}");
    let stopped = Test::new()
        .name("stopped")
        .spec(spec)
        .interrupt_after_step(3)
        .exit(130)
        .run();
    assert_eq!(
        stopped.final_state()["unfrozen_at"],
        2,
        "the checkpoint says when they started"
    );
    let resumed = stopped.resume().run();
    for (name, t) in &last {
        assert!(
            same_bits(t, tensor(&tensors(&resumed.final_model()), name)),
            "{name} differs after the resume"
        );
    }
}

/// The host levers with frozen parameters: optimizer state, gradients and streamed parameters
/// in host memory train to the same bits as on the device, keep the frozen tensors, and hold no
/// state for them.
#[test]
fn host_levers_train_frozen_models_exactly() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    // "auto" would be fused for state on the host, which rounds otherwise than "single".
    let extra = format!("{BACKBONE}\noptimizer_impl = \"single\"");
    let device = t
        .clone()
        .name("device")
        .spec(table(&resnet_job(&dir, "8", &extra)))
        .run();
    let want = tensors(&device.final_model());
    let bytes = device.summary().training.unwrap();
    for (name, memory) in [
        ("state", "optimizer_state = \"host\""),
        ("grads", "optimizer_state = \"host\"\ngradients = \"host\""),
        ("params", "parameters = \"host\""),
        // Checkpointing: the frozen stem's blocks start no backward of their own.
        ("acts", "activations = \"host\""),
    ] {
        let spec = resnet_job(&dir, "8", &extra).replace("[log]", &format!("[memory]\n{memory}\n[log]"));
        let r = Test::new().name(name).spec(table(&spec)).run();
        let got = tensors(&r.final_model());
        for (n, w) in &want {
            assert!(
                same_bits(w, tensor(&got, n)),
                "{memory}: {n} differs from the device run's"
            );
        }
        let b = r.summary().training.unwrap();
        assert_eq!(b.optimizer_state_bytes, bytes.optimizer_state_bytes, "{memory}");
        assert_eq!(b.gradient_bytes, bytes.gradient_bytes, "{memory}");
    }
}

/// `fit` measures the frozen model's smaller bill: at the same micro-batch its probe's peak is
/// lower by about the frozen weights' gradients and AdamW state (3 × 4 bytes a weight).
#[test]
fn fit_sees_the_frozen_models_smaller_footprint() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let peaks = |name: &str, extra: &str| -> Vec<(i64, u64)> {
        let args = [
            "--limit",
            "4GiB",
            "--precision",
            "fp32",
            "--checkpointing",
            "off",
            "--steps",
            "2",
            "--json",
        ];
        let o = Test::new()
            .name(name)
            .command("fit")
            .spec(table(&resnet_job(&dir, "8", extra)))
            .args(&args)
            .run();
        let r: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
        r["probes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["fits"] == true)
            .map(|p| (p["micro_batch"].as_i64().unwrap(), p["peak_bytes"].as_u64().unwrap()))
            .collect()
    };
    let full = peaks("full", "");
    let frozen = peaks("frozen", "freeze = [\"layer4.*\"]");
    let init = tensors(&dir.join("init.safetensors"));
    let layer4: u64 = init
        .iter()
        .filter(|(n, _)| n.starts_with("layer4.") && !n.contains("running_") && !n.ends_with("tracked"))
        .map(|(_, t)| t.numel() as u64)
        .sum();
    let (b, p_full) = *full.last().expect("a probe fits");
    let p_frozen = frozen
        .iter()
        .find(|(m, _)| *m == b)
        .expect("the same micro-batch probed")
        .1;
    let saved = p_full as f64 - p_frozen as f64;
    let want = (layer4 * 12) as f64;
    assert!(
        saved > 0.9 * want,
        "fit's peak fell by {saved} bytes at micro-batch {b}, the frozen gradients and state are {want}"
    );
}

/// Data-parallel: two ranks train a model with a frozen layer and a parameter group as one
/// process does (the gradient reducer holds only what trains), with the optimizer state
/// sharded or not, and the frozen layer stays as it started.
#[test]
fn two_ranks_train_frozen_layers_and_groups_as_one_process_does() {
    for shard in [false, true] {
        let t = Test::new()
            .set("train.epochs", 1)
            .set("train.batch_size", 64)
            .set("train.accumulation_steps", 2)
            .set("train.shard_optimizer_state", shard)
            .set("train.freeze", toml::Value::Array(vec!["fc0.weight".into()]))
            .set("train.weight_decay", 0.01)
            .set("train.no_decay", true);
        let one = t.clone().name("one").run();
        let two = t.clone().name("two").args(&["--nproc", "2"]).run();
        let (a, b) = (step_losses(&one), step_losses(&two));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6 * x.abs(), "shard {shard}: {x} vs {y}");
        }
        let (ta, tb) = (tensors(&one.final_model()), tensors(&two.final_model()));
        for (n, x) in &ta {
            let gap = (x - tensor(&tb, n)).abs().max().double_value(&[]);
            assert!(gap <= 1e-6, "shard {shard}: {n} differs by {gap}");
        }
        assert_eq!(two.summary().training.unwrap().frozen_parameters, 64 * 32);
    }
}
