//! LoRA against peft: the same base and initial adapters (written by peft and passed through
//! `model.init_from`), the same batches, the same AdamW: the same per-step losses, and a base
//! that does not move.
use crate::common::*;

fn lora_reference(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new(python())
        .arg(repo().join("tests/py/lora_reference.py"))
        .args(args)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// A tiny Hugging Face ViT's sizes as the vit preset's options, with adapters on the query and
/// value parts of every block's in-projection and the head trained beside them (peft's
/// `target_modules=["q_proj", "v_proj"]`, `modules_to_save=["classifier"]`).
fn spec(dir: &std::path::Path) -> String {
    format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n\
         [model]\npreset = \"vit\"\ninit_from = \"{init}\"\n\
         [model.vit]\nimage_size = 16\npatch_size = 8\nlayers = 2\nheads = 2\nhidden_dim = 16\n\
         mlp_dim = 32\nnum_classes = 4\nlayer_norm_eps = 1e-12\n\
         [model.lora]\nrank = 4\nalpha = 8.0\ntargets = [\"in_proj_q\", \"in_proj_v\"]\nextras = [\"heads.head\"]\n\
         [data]\nsource = \"npz\"\npath = \"{data}\"\nval_path = \"{data}\"\n\
         [train]\nepochs = 2\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.001\nweight_decay = 0.01\n\
         optimizer_impl = \"single\"\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        init = dir.join("init.safetensors").display(),
        data = dir.join("d.npz").display(),
    )
}

#[test]
fn lora_trains_as_peft_does_and_leaves_the_base_unchanged() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    lora_reference(&dir, &["init", "--out", "init.safetensors", "--data", "d.npz"]);
    let r = t.spec(table(&spec(&dir))).run();
    let py: serde_json::Value = serde_json::from_str(&lora_reference(
        &dir,
        &["train", "--init", "init.safetensors", "--data", "d.npz"],
    ))
    .unwrap();
    assert_eq!(py["base_unchanged"], true, "peft keeps its base");
    let theirs: Vec<f64> = floats(&py["losses"]);
    let ours = step_losses(&r);
    assert_eq!(ours.len(), 20);
    assert_close(&ours, &theirs, 1e-5);

    // The checkpoint keeps what trains, the adapters and the head, and names the base.
    let init = tensors(&dir.join("init.safetensors"));
    let kept = tensors(&r.final_model());
    let trains = |n: &str| n.contains(".lora_") || n.starts_with("heads.head.");
    let want: Vec<&str> = init.iter().map(|(n, _)| n.as_str()).filter(|n| trains(n)).collect();
    let got: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(got, want, "the checkpoint holds the trained tensors only");
    let numel: i64 = kept.iter().map(|(_, t)| t.numel() as i64).sum();
    assert_eq!(
        numel,
        py["trainable"].as_i64().unwrap(),
        "the same tensors train on both sides"
    );
    for (name, after) in &kept {
        let (_, before) = init.iter().find(|(n, _)| n == name).unwrap();
        // B starts random here (peft's init_lora_weights=False), so every trained tensor moves.
        assert!(!before.equal(after), "{name} trained");
    }
    let ck = r.final_model().parent().unwrap().to_path_buf();
    let base: serde_json::Value = serde_json::from_slice(&std::fs::read(ck.join("base.json")).unwrap()).unwrap();
    assert_eq!(
        base["bytes"].as_u64().unwrap(),
        std::fs::metadata(dir.join("init.safetensors")).unwrap().len()
    );
}

/// A checkpoint of adapters resumes over the same base, exactly, and is refused over another.
#[test]
fn a_lora_resume_needs_the_base_it_was_trained_on() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    lora_reference(&dir, &["init", "--out", "init.safetensors", "--data", "d.npz"]);
    let t = t.spec(table(&spec(&dir)));
    let straight = t.clone().name("straight").run();
    let part = t.clone().name("part").set("train.epochs", 1).run();
    // Another base (one value changed): refused, naming both files' contents.
    let other = tensors(&dir.join("init.safetensors"));
    let _ = other[0].1.get(0).fill_(0.5);
    let other_path = dir.join("other.safetensors");
    tch::Tensor::write_safetensors(&other, &other_path).unwrap();
    let r = part
        .resume()
        .args(&[
            "--set",
            "train.epochs=2",
            "--set",
            &format!("model.init_from={}", other_path.display()),
        ])
        .exit(2)
        .run();
    assert!(
        r.stderr.contains("holds adapters trained over the base"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("resume with the base it was trained on"),
        "{}",
        r.stderr
    );
    // The same base: the second epoch ends where one run of two epochs ends.
    part.resume().args(&["--set", "train.epochs=2"]).run();
    assert_eq!(
        straight.final_bytes(),
        part.final_bytes(),
        "adapters differ after resume"
    );
}

/// `eval` and `export` read a LoRA run's base from its `model.init_from`: once that file has
/// changed they refuse, saying where to put the base back, and write nothing.
#[test]
fn eval_and_export_refuse_a_lora_run_whose_base_changed() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    lora_reference(&dir, &["init", "--out", "init.safetensors", "--data", "d.npz"]);
    let run = t.spec(table(&spec(&dir))).set("train.epochs", 1).run();
    let base = tensors(&dir.join("init.safetensors"));
    let _ = base[0].1.get(0).fill_(0.5);
    tch::Tensor::write_safetensors(&base, dir.join("init.safetensors")).unwrap();
    let out = run.out.to_str().unwrap().to_owned();
    let merged = dir.join("merged");
    for (command, args, written) in [
        ("eval", vec![out.as_str()], run.out.join("eval.json")),
        (
            "export",
            // Hugging Face holds this ViT (its LayerNorm epsilon is 1e-12); the base is what is refused.
            vec![out.as_str(), "--format", "huggingface", merged.to_str().unwrap()],
            merged.clone(),
        ),
    ] {
        let r = Test::new()
            .no_spec()
            .command(command)
            .args_replaced(&args)
            .exit(2)
            .run();
        assert!(
            r.stderr.contains("put the base it was trained on back at"),
            "{command}: {}",
            r.stderr
        );
        assert!(!written.exists(), "{command} wrote {}", written.display());
    }
}

/// Targets that match no layer are refused before training, with the names that would match.
#[test]
fn lora_targets_that_match_nothing_are_refused_with_the_layer_names() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    lora_reference(&dir, &["init", "--out", "init.safetensors", "--data", "d.npz"]);
    let text = spec(&dir).replace("[\"in_proj_q\", \"in_proj_v\"]", "[\"query\"]");
    let r = t.spec(table(&text)).exit(2).run();
    assert!(
        r.stderr
            .contains("model.lora.targets (query) matches none of the vit preset's linear layers"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("its layers are self_attention.in_proj_q, self_attention.in_proj_k"),
        "{}",
        r.stderr
    );
    assert!(!dir.join("run").exists(), "nothing is written for a refused spec");
}

/// A LoRA run exported in each format loads in that library (strictly: every name and shape),
/// and its logits are memtrain's own with the adapters merged. Bad input writes nothing.
#[test]
fn export_merges_the_adapters_and_each_library_loads_it() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    lora_reference(&dir, &["init", "--out", "init.safetensors", "--data", "d.npz"]);
    // torchvision's ViT fixes LayerNorm's epsilon at 1e-6.
    let text = spec(&dir).replace("epochs = 2", "epochs = 1");
    let r = t
        .clone()
        .spec(table(&text.replace("layer_norm_eps = 1e-12", "layer_norm_eps = 1e-6")))
        .run();
    let run_dir = r.out.to_str().unwrap().to_owned();
    // memtrain's logits, adapters unmerged, from the run as trained.
    let trained = memtrain::export::Trained::read(&r.out, None).unwrap();
    let export = |format: &str, out: &str| {
        t.clone().no_spec().command("export").args_replaced(&[
            &run_dir,
            "--format",
            format,
            dir.join(out).to_str().unwrap(),
        ])
    };
    for format in ["huggingface", "timm", "torchvision"] {
        let out = format!("{format}-out");
        export(format, &out).run();
        let io = format!("{format}-io.safetensors");
        lora_reference(
            &dir,
            &["load", &out, "--format", format, "--data", "d.npz", "--out", &io],
        );
        let io = tensors(&dir.join(&io));
        let get = |n: &str| io.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
        let ours = tch::no_grad(|| trained.built.net.forward_t(&get("x"), false));
        let theirs = get("logits");
        let gap = (&ours - &theirs).abs().max().double_value(&[]);
        let scale = theirs.abs().max().double_value(&[]);
        assert!(scale > 0.1, "{format}: the logits are not trivially zero ({scale})");
        assert!(gap <= 1e-5 * scale, "{format}: logits differ by {gap} (scale {scale})");
    }
    // A format that cannot hold the model: refused, saying why, nothing written.
    let hf = t.clone().name("hf-eps").spec(table(&text)).run();
    t.clone()
        .no_spec()
        .command("export")
        .args_replaced(&[
            hf.out.to_str().unwrap(),
            "--format",
            "torchvision",
            dir.join("no").to_str().unwrap(),
        ])
        .exit(2)
        .stderr_has("torchvision cannot hold this model: torchvision's ViT fixes layer_norm_eps at 1e-6")
        .run();
    assert!(!dir.join("no").exists());
    // eval reads the base and the adapters as export does, and gives the run's own figures.
    let json = dir.join("eval.json");
    t.clone()
        .no_spec()
        .command("eval")
        .args_replaced(&[&run_dir, "--json", json.to_str().unwrap()])
        .run();
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let last = r.summary().last.expect("a final epoch");
    assert_eq!(
        report["accuracy"].as_f64(),
        last.val_acc,
        "eval's accuracy is the run's"
    );
    let (loss, run_loss) = (report["loss"].as_f64().unwrap(), last.val_loss.unwrap());
    assert!(
        (loss - run_loss).abs() <= 1e-5 * run_loss.abs().max(1.0),
        "{loss} vs {run_loss}"
    );
    // OUT exists: refused, the existing directory untouched.
    export("timm", "timm-out").exit(2).stderr_has("already exists").run();
    // The base changed since the run: refused, nothing written.
    let changed = tensors(&dir.join("init.safetensors"));
    let _ = changed[0].1.get(0).fill_(0.25);
    tch::Tensor::write_safetensors(&changed, dir.join("init.safetensors")).unwrap();
    export("timm", "after-change")
        .exit(2)
        .stderr_has("holds adapters trained over the base")
        .run();
    assert!(!dir.join("after-change").exists());
}

/// docs/fine-tuning.md's worked example, its LoRA twin and its frozen variant pass `check` as
/// written, over a small Hugging Face CLIP vision tower saved in the directory the example
/// names and an image folder at its paths: the page's TOML stays in step with the spec.
#[test]
fn the_fine_tuning_pages_examples_check() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let script = "import os, numpy as np\n\
        from PIL import Image\n\
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection\n\
        cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,\n\
            image_size=224, patch_size=32, projection_dim=16, hidden_act='quick_gelu', layer_norm_eps=1e-5)\n\
        CLIPVisionModelWithProjection(cfg).save_pretrained('clip-vit-b32')\n\
        rng = np.random.default_rng(0)\n\
        for split in ('train', 'val'):\n\
        \x20   for c in ('audi', 'bmw', 'ford'):\n\
        \x20       os.makedirs(f'cars/{split}/{c}')\n\
        \x20       for i in range(2):\n\
        \x20           Image.fromarray((rng.random((24, 32, 3)) * 255).astype('uint8')).save(f'cars/{split}/{c}/{i}.png')\n";
    let out = std::process::Command::new(python())
        .args(["-c", script])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let page = std::fs::read_to_string(repo().join("docs/fine-tuning.md")).unwrap();
    let blocks: Vec<&str> = page
        .split("```toml\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap())
        .collect();
    assert_eq!(
        blocks.len(),
        3,
        "the page's TOML blocks: the job, its LoRA table, the freezing"
    );
    let frozen = blocks[0].replace(
        "[train]\n",
        &format!(
            "[train]\n{}",
            blocks[2]
                .split("\n\n[[")
                .next()
                .unwrap()
                .trim_start_matches("[train]\n")
        ),
    ) + "\n[[train.param_groups]]\nmatch = [\"heads.*\"]\nlr_scale = 10.0\n";
    for (name, text, says) in [
        ("full.toml", blocks[0].to_owned(), "2 created"),
        ("lora.toml", format!("{}\n{}", blocks[0], blocks[1]), "10 created"),
        ("frozen.toml", frozen, "2 created"),
    ] {
        // Paths are relative to the current directory, which the example takes to hold them.
        let text = text
            .replace(
                "\"clip-vit-b32\"",
                &format!("\"{}\"", dir.join("clip-vit-b32").display()),
            )
            .replace("\"cars/", &format!("\"{}/cars/", dir.display()));
        std::fs::write(dir.join(name), text).unwrap();
        let r = Test::new()
            .command("check")
            .no_spec()
            .args(&[dir.join(name).to_str().unwrap()])
            .run();
        let all = format!("{}{}", r.stdout, r.stderr);
        assert!(all.contains("(huggingface names)"), "{name}: {all}");
        assert!(all.contains(says), "{name} should say {says}: {all}");
    }
}

/// The adapters of a ViT-L/16 (rank 16 on every block's attention and MLP linears) and its head
/// are under 5% of the model, which is what its checkpoints hold; `check` counts the rest as
/// frozen. Unfreezing the base with `train.unfreeze_at_epoch` is refused.
#[test]
fn a_vit_l16_lora_trains_under_5_percent_of_the_model() {
    let t = Test::new();
    let spec = "[model]\npreset = \"vit\"\n[model.vit]\nlayers = 24\nheads = 16\nhidden_dim = 1024\nmlp_dim = 4096\nnum_classes = 10\n\
                [model.lora]\nrank = 16\nalpha = 32.0\ntargets = [\"in_proj_q\", \"in_proj_k\", \"in_proj_v\", \"out_proj\", \"mlp.0\", \"mlp.3\"]\n\
                extras = [\"heads.head\"]\n[data]\nsource = \"synthetic\"\nsamples = 8\n";
    let r = t.clone().command("check").spec_text(spec).run();
    let line = r
        .stdout
        .lines()
        .find(|l| l.starts_with("model "))
        .expect("check's model line");
    // "model            vit: 7.09M parameters + 303.3M frozen (the base under model.lora)"
    let count = |s: &str| -> f64 {
        let n: f64 = s.trim_end_matches(['K', 'M']).parse().unwrap();
        n * if s.ends_with('M') { 1e6 } else { 1e3 }
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let trained = count(words[2]);
    let frozen = count(words[5]);
    assert!(line.contains("frozen (the base under model.lora)"), "{line}");
    let share = trained / (trained + frozen);
    eprintln!("{line}: {:.2}% trains", share * 100.0);
    assert!(share < 0.05, "{line}");
    let bad = format!("{spec}[train]\nepochs = 3\nfreeze = [\"conv_proj.*\"]\nunfreeze_at_epoch = 2\n");
    t.command("check")
        .spec_text(&bad)
        .exit(2)
        .stderr_has("would unfreeze the base that [model.lora] keeps frozen")
        .run();
}

/// The files themselves: a ViT-L/16 LoRA run (rank 16 on every block's attention and MLP
/// linears, the head trained) of one step on 32 px images, whose weights are ViT-L/16's but for
/// the position embedding's rows. Its checkpoint's weights file is under 5% of the full model's
/// as `export` writes it (measured: 2.3%), and the whole checkpoint, the adapters' AdamW state
/// with them, under 5% of a full fine-tune's, which holds the weights and AdamW's two moments of
/// each.
#[test]
fn a_vit_l16_lora_checkpoint_is_under_5_percent_of_the_full_one() {
    let t = Test::new();
    let spec = "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\npreset = \"vit\"\n\
                [model.vit]\nimage_size = 32\npatch_size = 16\nlayers = 24\nheads = 16\nhidden_dim = 1024\nmlp_dim = 4096\nnum_classes = 10\n\
                [model.lora]\nrank = 16\nalpha = 32.0\ntargets = [\"in_proj_q\", \"in_proj_k\", \"in_proj_v\", \"out_proj\", \"mlp.0\", \"mlp.3\"]\n\
                extras = [\"heads.head\"]\n[data]\nsource = \"synthetic\"\nsamples = 4\nval_fraction = 0.5\n\
                [train]\nepochs = 1\nbatch_size = 2\noptimizer = \"adamw\"\nlr = 1e-4\n[log]\nprogress = \"off\"\n";
    let r = t.clone().spec_text(spec).run();
    let weights = r.final_model();
    let checkpoint = weights.parent().unwrap();
    let size = |p: &std::path::Path| std::fs::metadata(p).unwrap().len();
    let lora = size(&weights);
    let all: u64 = std::fs::read_dir(checkpoint)
        .unwrap()
        .map(|e| size(&e.unwrap().path()))
        .sum();
    let out = t.dir().join("full");
    t.clone()
        .no_spec()
        .command("export")
        .args_replaced(&[
            r.out.to_str().unwrap(),
            "--format",
            "torchvision",
            out.to_str().unwrap(),
        ])
        .run();
    let full = size(&out.join("model.safetensors"));
    eprintln!(
        "LoRA checkpoint: weights {lora} B, all {all} B; the full model's weights {full} B ({:.2}%)",
        100.0 * lora as f64 / full as f64
    );
    assert!(full > 1_200_000_000, "ViT-L/16's 304M weights in fp32: {full} B");
    assert!(
        20 * lora < full,
        "the LoRA weights, {lora} B, are not under 5% of {full} B"
    );
    assert!(
        20 * all < 3 * full,
        "the LoRA checkpoint, {all} B, is not under 5% of a full AdamW fine-tune's {} B",
        3 * full
    );
}

/// `train.frozen_dtype = "bf16"` in a bf16-mixed LoRA run: the frozen linear and convolution
/// weights are stored in bf16, which bf16-mixed autocast casts them to for every use anyway, so
/// the run computes the same losses bit for bit with at least those weights' fp32 halves less at
/// its peak, and `check` counts them at 2 bytes. Outside bf16-mixed, or with nothing frozen, the
/// key is refused with what to change.
#[test]
fn a_frozen_base_in_bf16_trains_the_same_in_less_memory() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    lora_reference(&dir, &["init", "--out", "init.safetensors", "--data", "d.npz"]);
    let base = table(&spec(&dir));
    let run = |dtype: &str| {
        Test::new()
            .spec(base.clone())
            .set("train.precision", "bf16-mixed")
            .set("train.frozen_dtype", dtype)
            .set("train.epochs", 1)
            .run()
    };
    let (wide, narrow) = (run("fp32"), run("bf16"));
    let (a, b) = (step_losses(&wide), step_losses(&narrow));
    assert_eq!(a.len(), 10);
    assert_eq!(a, b, "the same losses bit for bit");
    // The base's linear and convolution weights: every frozen `*.weight` of 2+ dimensions.
    let low: i64 = tensors(&dir.join("init.safetensors"))
        .iter()
        .filter(|(n, t)| n.ends_with(".weight") && t.dim() >= 2 && !n.contains(".lora_") && !n.starts_with("heads."))
        .map(|(_, t)| t.numel() as i64)
        .sum();
    assert!(low > 1000, "the base has weights to keep in bf16 ({low})");
    let peak = |o: &Outcome| o.summary().memory.peak_allocated_bytes.expect("a counted CPU peak") as i64;
    let (pw, pn) = (peak(&wide), peak(&narrow));
    assert!(
        pw - pn >= 2 * low,
        "peak {pw} B with the base in fp32, {pn} B in bf16: at least {} B apart",
        2 * low
    );

    let checked = |dtype: &str| {
        Test::new()
            .command("check")
            .spec(base.clone())
            .set("train.precision", "bf16-mixed")
            .set("train.frozen_dtype", dtype)
            .run()
            .stdout
    };
    let (cw, cn) = (checked("fp32"), checked("bf16"));
    assert!(cn.contains("kept in bf16"), "{cn}");
    assert!(!cw.contains("kept in bf16"), "{cw}");
    let params = |s: &str| s.lines().find(|l| l.starts_with("parameters  ")).unwrap().to_owned();
    assert_ne!(params(&cw), params(&cn), "check counts them at 2 bytes");

    // Refused: under fp32 (it would change what the run computes), and with nothing frozen.
    Test::new()
        .spec(base.clone())
        .set("train.frozen_dtype", "bf16")
        .exit(2)
        .stderr_has("train.frozen_dtype")
        .stderr_has("set train.precision = \"bf16-mixed\"")
        .run();
    let mut plain = base.clone();
    plain["model"].as_table_mut().unwrap().remove("lora");
    Test::new()
        .spec(plain)
        .set("train.precision", "bf16-mixed")
        .set("train.frozen_dtype", "bf16")
        .exit(2)
        .stderr_has("has no frozen weights to keep")
        .run();
}

/// Frozen weights kept in bf16 on the device (no streaming) are part of the model's bill: a cap
/// that holds the fp32 draw but not a frozen weight's bf16 copy beside it ends the run as
/// building the model does, with exit 3 and what to change; the same cap holds the fp32 model.
#[test]
fn a_bf16_frozen_copy_over_the_cap_ends_as_building_the_model() {
    // fc0's 1 MiB of fp32 weight, frozen, needs 512 KiB more for its bf16 copy.
    let t = Test::new()
        .spec(table(
            "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 256\nhidden = [1024]\n\
             num_classes = 4\n[data]\nsamples = 40\nval_fraction = 0.2\n[train]\nepochs = 1\nbatch_size = 8\n\
             optimizer = \"adam\"\nlr = 0.01\nprecision = \"bf16-mixed\"\nfreeze = [\"fc0.*\"]\n\
             [log]\nprogress = \"off\"\n[memory]\nlimit = \"1300KiB\"\n",
        ))
        .exit(3);
    let wide = t.clone().name("wide").set("train.frozen_dtype", "fp32").run();
    assert!(!wide.stderr.contains("while building the model"), "{}", wide.stderr);
    t.name("narrow")
        .set("train.frozen_dtype", "bf16")
        .stderr_has("out of memory while building the model (its parameters are")
        .stderr_has("with the frozen weights in bf16")
        .stderr_has("under the 1.27 MiB cap")
        .stderr_has("To fix: raise memory.limit")
        .run();
}
