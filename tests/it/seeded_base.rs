//! A LoRA run without `model.init_from` trains over its seeded draw of the base, and its
//! checkpoints keep only what trains: `eval`, `generate` and `export` draw that base again as the
//! run drew it, in the run's dtype, with `train.frozen_dtype`'s bf16 base, and compute as the run
//! did. Shown against the run's own records: its validation loss (eval, bit for bit), the tokens
//! its validation counted right (generate's greedy continuation), and transformers' loss on the
//! merged export.
use std::path::Path;

use crate::common::*;

/// The repeated pattern the decoder learns: ids 2..=9 and then 1.
const PATTERN: [u16; 9] = [2, 3, 4, 5, 6, 7, 8, 9, 1];

fn token_file(path: &Path, repeats: usize) {
    let bytes: Vec<u8> = PATTERN
        .iter()
        .cycle()
        .take(PATTERN.len() * repeats)
        .flat_map(|t| t.to_le_bytes())
        .collect();
    std::fs::write(path, bytes).unwrap();
}

/// A two-layer llama of 16 tokens with rank-4 adapters and no `init_from`, 3 epochs on the
/// pattern, validated on 4 windows of it (the first of which starts at id 2); `train` adds to
/// `[train]`.
fn lora_run(t: &Test, name: &str, train: &str) -> Outcome {
    let (data, val) = (t.dir().join("train.bin"), t.dir().join("val.bin"));
    token_file(&data, 60);
    token_file(&val, 8);
    t.clone()
        .name(name)
        .spec(table(&format!(
            "[job]\nthreads = 2\ndevice = \"cpu\"\nseed = 5\n[model]\npreset = \"llama\"\n\
             [model.llama]\nvocab_size = 16\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\n\
             num_attention_heads = 4\nnum_key_value_heads = 2\nmax_position_embeddings = 64\n\
             [model.lora]\nrank = 4\ntargets = [\"q\", \"v\", \"o\", \"gate\", \"down\"]\n\
             [data]\nsource = \"tokens\"\npath = \"{}\"\nval_path = \"{}\"\ntoken_dtype = \"uint16\"\nseq_len = 16\n\
             [train]\nepochs = 3\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.01\n{train}\
             [log]\nprogress = \"off\"\n",
            data.display(),
            val.display()
        )))
        .run()
}

/// `eval` of the run: its loss equals the run's last validation loss bit for bit (the same
/// micro-batches, summed in the same order).
fn eval_equals_validation(t: &Test, run: &Outcome) -> f64 {
    let last = run.epochs().pop().expect("an epoch record");
    assert_eq!(last.val_acc, Some(1.0), "the run learned the pattern: {last:?}");
    let json = run.out.join("eval.json");
    t.clone()
        .command("eval")
        .no_spec()
        .args(&[run.out.to_str().unwrap()])
        .run();
    let r: memtrain::eval::EvalReport = typed(&json);
    assert_eq!(
        Some(r.loss),
        last.val_loss,
        "eval draws the base the run trained over, and computes as its validation did"
    );
    r.loss
}

/// `generate`'s greedy continuation of id 2: the pattern, which the run's validation counted
/// right token for token from that same start (its first window), so it is what the trained
/// model predicts, computed as in training.
fn generate_continues_the_pattern(t: &Test, run: &Outcome) -> String {
    let o = t
        .clone()
        .command("generate")
        .no_spec()
        .args(&[
            run.out.to_str().unwrap(),
            "--prompt-ids",
            "2",
            "--max-new-tokens",
            "16",
            "--ignore-eos",
        ])
        .run();
    let want: Vec<String> = PATTERN.iter().cycle().skip(1).take(16).map(u16::to_string).collect();
    assert_eq!(o.stdout.trim(), format!("2 | {}", want.join(" ")));
    o.stderr
}

/// `export` of the run as a Hugging Face directory, `exported` beside it.
fn exported(t: &Test, run: &Outcome) -> std::path::PathBuf {
    let out = t.dir().join("exported");
    t.clone()
        .command("export")
        .no_spec()
        .args(&[
            run.out.to_str().unwrap(),
            "--format",
            "huggingface",
            out.to_str().unwrap(),
        ])
        .run();
    out
}

#[test]
fn a_lora_run_over_a_seeded_base_evaluates_generates_and_exports_as_it_trained() {
    let t = Test::new();
    let run = lora_run(&t, "fp32", "");
    let loss = eval_equals_validation(&t, &run);
    generate_continues_the_pattern(&t, &run);

    // The export merges the adapters into that base: transformers' loss on the validation
    // windows is eval's.
    exported(&t, &run);
    let ids: Vec<i64> = PATTERN.iter().cycle().take(4 * 17).map(|&i| i64::from(i)).collect();
    let windows = tch::Tensor::from_slice(&ids).view([4, 17]);
    let io = t.dir().join("io.safetensors");
    tch::Tensor::write_safetensors(&[("ids", windows.narrow(1, 0, 16).contiguous())], &io).unwrap();
    crate::llama::llama_py(t.dir(), &["logits", "--dir", "exported", "--io", "io.safetensors"]);
    let theirs = tensors(&io).into_iter().find(|(n, _)| n == "theirs").unwrap().1;
    let theirs_loss = theirs
        .view([-1, 16])
        .cross_entropy_for_logits(&windows.narrow(1, 1, 16).reshape([-1]))
        .double_value(&[]);
    assert!(
        (theirs_loss - loss).abs() < 1e-5,
        "transformers on the export: {theirs_loss}, eval: {loss}"
    );
}

/// bf16-mixed with the base kept in bf16 (`train.frozen_dtype`): eval and generate keep it so
/// too, as their log says with the run's own figure, and compute under the run's autocast.
#[test]
fn a_bf16_base_stays_bf16_in_eval_and_generate() {
    let t = Test::new();
    let run = lora_run(&t, "bf16", "precision = \"bf16-mixed\"\nfrozen_dtype = \"bf16\"\n");
    let kept = |stderr: &str| {
        stderr
            .lines()
            .find(|l| l.contains("kept in bf16"))
            .map(|l| l.trim().to_owned())
            .unwrap_or_else(|| panic!("no line on the bf16 base in\n{stderr}"))
    };
    let trained = kept(&run.stderr);
    eval_equals_validation(&t, &run);
    let generated = generate_continues_the_pattern(&t, &run);
    assert_eq!(
        kept(&generated),
        trained,
        "the same weights kept in bf16 as in training"
    );
    // The export widens the bf16 base (exactly) and merges the adapters in fp32: an adapted
    // weight holds values no bf16 holds, which a merge into the bf16 weight would have rounded.
    let out = exported(&t, &run);
    let exported = tensors(&out.join("model.safetensors"));
    assert!(
        exported.iter().all(|(_, t)| t.kind() == tch::Kind::Float),
        "written in fp32"
    );
    let (_, q) = exported
        .iter()
        .find(|(n, _)| n == "model.layers.0.self_attn.q_proj.weight")
        .expect("an adapted projection");
    let rounded = q.to_kind(tch::Kind::BFloat16).to_kind(tch::Kind::Float);
    assert!(!rounded.equal(q), "the merged update survives in fp32");
}
