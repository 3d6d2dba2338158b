//! Token data and mid-epoch checkpoints, driven through the binary: `check` says how a token set
//! is read and how many windows it has; `run` refuses token data that does not fit the model,
//! with the file (and the line) at fault; a run saved every N steps and killed mid-epoch resumes
//! with the same batches, its step losses those of a run never stopped, bit for bit.
//!
//! Most runs here have no language model: an mlp whose inputs are `seq_len` and whose classes are
//! the vocabulary takes the set's checks as a language model would (its data is refused before
//! any step); the windows and targets themselves are tested in the data module. A small llama
//! resumes from a checkpoint that lacks its token counts.
use std::path::Path;

use crate::common::*;

/// An mlp over `seq_len` inputs and `vocab` classes reading token data `[data]` (`extra`).
fn on_tokens(t: &Test, seq_len: i64, vocab: i64, extra: &str) -> Test {
    t.clone().spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = {seq_len}\nhidden = [8]\nnum_classes = {vocab}\n\
         [data]\nseq_len = {seq_len}\n{extra}\n\
         [train]\nepochs = 1\nbatch_size = 4\noptimizer = \"sgd\"\nlr = 0.1\n[log]\nprogress = \"off\"\n"
    )))
}

fn write_u16(path: &Path, ids: impl IntoIterator<Item = u16>) {
    let bytes: Vec<u8> = ids.into_iter().flat_map(u16::to_le_bytes).collect();
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn check_says_how_a_token_set_is_read_and_how_many_windows_it_has() {
    let t = Test::new();
    let bin = t.dir().join("train.bin");
    write_u16(&bin, (0..1000).map(|i| (i % 50) as u16));
    let extra = format!(
        "source = \"tokens\"\npath = \"{}\"\ntoken_dtype = \"uint16\"",
        bin.display()
    );
    let r = on_tokens(&t, 9, 64, &extra).command("check").run();
    assert!(
        r.stdout.contains("int64 token ids and targets")
            && r.stdout.contains(
                "the set is read in place through a memory map (token ids, int64 batches): 100 windows of 9 tokens"
            ),
        "{}",
        r.stdout
    );
    // jsonl: where its token cache will be, until a run writes it.
    let (data, tok) = (t.dir().join("d.jsonl"), t.dir().join("tokenizer.json"));
    std::fs::write(&data, "{\"text\": \"hello world\"}\n").unwrap();
    word_tokenizer(&tok, &["hello", "world"]);
    let extra = format!(
        "source = \"jsonl\"\npath = \"{}\"\ntokenizer = \"{}\"\ntext_field = \"text\"",
        data.display(),
        tok.display()
    );
    let r = on_tokens(&t, 2, 8, &extra).command("check").run();
    assert!(
        r.stdout.contains("not tokenized yet: the first run writes"),
        "{}",
        r.stdout
    );
    // A token source without seq_len is refused by the spec's checks.
    let r = t
        .clone()
        .spec(table(&format!(
            "[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 4\nhidden = [8]\nnum_classes = 64\n[data]\nsource = \"tokens\"\npath = \"{}\"\ntoken_dtype = \"uint16\"\n",
            bin.display()
        )))
        .command("check")
        .exit(2)
        .stderr_has("data.seq_len")
        .run();
    assert!(
        r.stderr.contains("is required when data.source is \"tokens\""),
        "{}",
        r.stderr
    );
}

#[test]
fn token_data_that_does_not_fit_the_model_is_refused_with_its_place() {
    let t = Test::new();
    let bin = t.dir().join("train.bin");
    write_u16(&bin, (0..400).map(|i| if i == 123 { 700 } else { (i % 50) as u16 }));
    let tokens = |seq_len: i64, vocab: i64| {
        let extra = format!(
            "source = \"tokens\"\npath = \"{}\"\ntoken_dtype = \"uint16\"",
            bin.display()
        );
        on_tokens(&t, seq_len, vocab, &extra)
            .name(&format!("t{seq_len}-{vocab}"))
            .exit(2)
    };
    tokens(7, 512)
        .stderr_has("the token at position 123 (counting from 0) has id 700, outside the model's vocabulary of 512 ids")
        .run();
    tokens(400, 1024)
        .stderr_has("holds 400 token(s), fewer than one window of data.seq_len + 1 = 401 tokens")
        .run();
    let (data, tok) = (t.dir().join("d.jsonl"), t.dir().join("tokenizer.json"));
    word_tokenizer(&tok, &["hello", "world", "again"]);
    let jsonl = |name: &str, lines: &str, vocab: i64| {
        std::fs::write(&data, lines).unwrap();
        let extra = format!(
            "source = \"jsonl\"\npath = \"{}\"\ntokenizer = \"{}\"\ntext_field = \"text\"",
            data.display(),
            tok.display()
        );
        on_tokens(&t, 2, vocab, &extra).name(name).exit(2)
    };
    let good = "{\"text\": \"hello world\"}\n\n{\"text\": \"again\"}\n";
    jsonl("field", &format!("{good}{{\"body\": \"hello\"}}\n"), 16)
        .stderr_has("line 4: has no field \"text\"")
        .run();
    jsonl("json", &format!("{good}{{\"text\": \"hello\"\n"), 16)
        .stderr_has("line 4: not valid JSON")
        .run();
    jsonl("vocab", good, 4)
        .stderr_has("has a vocabulary of 5 ids, more than the model's vocabulary of 4")
        .run();
    // Nothing of the refused files was cached.
    let cached = std::fs::read_dir(t.dir())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().contains(".tokens-"))
        .count();
    assert_eq!(cached, 0);
}

#[test]
fn a_run_killed_mid_epoch_resumes_from_its_step_checkpoint_with_the_same_batches() {
    // Digits: 45 steps an epoch; a checkpoint every 20 steps, the last before the kill at 60,
    // mid-way through the second epoch.
    let t = Test::new()
        .set("log.every_steps", 1)
        .set("train.epochs", 2)
        .set("checkpoint.every_steps", 20);
    let straight = t.clone().name("straight").run();
    let saved: Vec<(String, i64)> = straight
        .checkpoints()
        .iter()
        .map(|c| (c.reason.clone(), c.step))
        .collect();
    let want = [
        ("steps", 20),
        ("steps", 40),
        ("epoch", 45),
        ("steps", 60),
        ("steps", 80),
        ("epoch", 90),
    ];
    assert_eq!(saved, want.map(|(r, s)| (r.to_owned(), s)));
    let mut running = t
        .clone()
        .name("killed")
        .env("MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP", "67")
        .exit(-1)
        .spawn();
    running.await_stderr("fault: waiting for a signal at step 67");
    // SAFETY: our own child, still running (it waits for a signal).
    unsafe { libc::kill(running.pid(), libc::SIGKILL) };
    let killed = running.finish();
    killed.resume().stderr_has("step-000000060").run();
    // Every step record, the ones a resumed session redid too (the typed reader drops those).
    let losses = |o: &Outcome| -> Vec<(i64, serde_json::Value)> {
        let text = std::fs::read_to_string(o.out.join("metrics.jsonl")).unwrap();
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["type"] == "step")
            .map(|e| (e["step"].as_i64().unwrap(), e["loss"].clone()))
            .collect()
    };
    let whole: std::collections::HashMap<i64, serde_json::Value> = losses(&straight).into_iter().collect();
    assert_eq!(whole.len(), 90);
    let again = losses(&killed);
    // Steps 61 to 67 ran twice, before the kill and after the resume: the same losses both times.
    assert_eq!(again.len(), 90 + 7);
    for (step, loss) in &again {
        assert_eq!(Some(loss), whole.get(step), "step {step}");
    }
    assert_eq!(straight.final_bytes(), killed.final_bytes());
}

#[test]
fn every_minutes_saves_within_the_epoch() {
    // A mark of 0.6 ms passes between any two steps: each step saves, none waits for the epoch.
    let r = Test::new()
        .set("train.epochs", 1)
        .set("checkpoint.every_epochs", 0)
        .set("checkpoint.every_minutes", 0.00001)
        .run();
    let saved: Vec<(String, i64)> = r.checkpoints().iter().map(|c| (c.reason.clone(), c.step)).collect();
    assert!(saved.len() >= 10, "{saved:?}");
    assert!(
        saved[..saved.len() - 1]
            .iter()
            .all(|(why, s)| why == "minutes" && *s < 45),
        "{saved:?}"
    );
    assert_eq!(saved.last().unwrap(), &("epoch".to_owned(), 45));
}

/// A language model's run killed mid-epoch and resumed from a checkpoint written before tokens
/// were counted (its state has neither count): the resumed run derives both from the windows it
/// trained on, so its epoch loss (the token mean) and its token counts are those of a run never
/// stopped.
#[test]
fn a_resume_from_a_checkpoint_without_token_counts_derives_them() {
    let t = Test::new();
    let (data, tok) = (t.dir().join("pairs.jsonl"), t.dir().join("tokenizer.json"));
    let words = ["one", "two", "three", "four", "five", "six", "seven", "eight"];
    word_tokenizer(&tok, &words);
    // Completions of 1 to 7 words: windows of 2 to 8 counted targets.
    let lines: Vec<String> = (0..64)
        .map(|i| {
            let completion = words[1..=1 + i % 7].join(" ");
            serde_json::json!({ "prompt": words[0], "completion": completion }).to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    // 51 training windows, 13 steps an epoch; a checkpoint every 5 steps, the last before the
    // kill at step 20 at step 15, two steps into the second epoch.
    let t = t
        .spec(table(&format!(
            "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"llama\"\n\
             [model.llama]\nvocab_size = 16\nhidden_size = 16\nintermediate_size = 32\nnum_hidden_layers = 1\n\
             num_attention_heads = 2\nnum_key_value_heads = 1\nmax_position_embeddings = 16\n\
             [data]\nsource = \"jsonl\"\npath = \"{}\"\ntokenizer = \"{}\"\nprompt_field = \"prompt\"\n\
             completion_field = \"completion\"\nseq_len = 10\n\
             [train]\nepochs = 2\nbatch_size = 4\noptimizer = \"adamw\"\nlr = 0.01\n\
             [checkpoint]\nevery_steps = 5\n[log]\nevery_steps = 1\nprogress = \"off\"\n",
            data.display(),
            tok.display()
        )))
        .clone();
    let straight = t.clone().name("straight").run();
    let mut running = t
        .clone()
        .name("killed")
        .env("MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP", "20")
        .exit(-1)
        .spawn();
    running.await_stderr("fault: waiting for a signal at step 20");
    // SAFETY: our own child, still running (it waits for a signal).
    unsafe { libc::kill(running.pid(), libc::SIGKILL) };
    let killed = running.finish();
    let latest = memtrain::checkpoint::Store::latest_in(&killed.out).unwrap();
    assert!(latest.ends_with("step-000000015"), "{}", latest.display());
    let state = latest.join("state.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert!(json["epoch_tokens"].as_u64().unwrap() > 0);
    let fields = json.as_object_mut().unwrap();
    fields.remove("epoch_tokens");
    fields.remove("tokens_seen");
    std::fs::write(&state, json.to_string()).unwrap();
    let resumed = killed.resume().run();

    let tokens = |o: &Outcome| -> Vec<u64> {
        o.epochs()
            .iter()
            .map(|e| e.result.language.expect("a language model's epoch").tokens_seen)
            .collect()
    };
    assert_eq!(tokens(&resumed), tokens(&straight));
    let (a, b) = (&straight.epochs()[1].result, &resumed.epochs()[1].result);
    assert!(
        (a.train_loss - b.train_loss).abs() <= 1e-9 * a.train_loss,
        "the second epoch's token mean: {} straight, {} resumed",
        a.train_loss,
        b.train_loss
    );
    let last = |o: &Outcome| o.steps().last().unwrap().language.unwrap().tokens_seen;
    assert_eq!(last(&resumed), last(&straight));
    // The same windows after the resume: every step's loss, and the weights, bit for bit.
    assert_eq!(step_losses(&resumed), step_losses(&straight));
    assert_eq!(resumed.final_bytes(), straight.final_bytes());
}

/// A token file's run killed (SIGKILL) mid-epoch resumes from its last step checkpoint with the
/// windows the run that was never stopped trained on: the same per-step losses, the redone steps
/// included, and the same weights, bit for bit; each step's record carries its tokens, their
/// running count and the loss's perplexity.
#[test]
fn a_token_run_killed_mid_epoch_resumes_with_the_same_windows() {
    let t = Test::new();
    let path = t.dir().join("train.bin");
    pattern(&path, 4000);
    // 144 training windows of 25 tokens, 4 a step: 36 steps; a checkpoint every 10.
    let job = llama_on_tokens(&t, &path, 24).set("checkpoint.every_steps", 10);
    let straight = job.clone().name("straight").run();
    let mut running = job
        .clone()
        .name("killed")
        .env("MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP", "25")
        .exit(-1)
        .spawn();
    running.await_stderr("fault: waiting for a signal at step 25");
    // SAFETY: our own child, still running (it waits for a signal).
    unsafe { libc::kill(running.pid(), libc::SIGKILL) };
    let killed = running.finish();
    let resumed = killed.resume().stderr_has("step-000000020").run();
    let all = |o: &Outcome| -> Vec<(i64, f64)> {
        let text = std::fs::read_to_string(o.out.join("metrics.jsonl")).unwrap();
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["type"] == "step")
            .map(|e| (e["step"].as_i64().unwrap(), e["loss"].as_f64().unwrap()))
            .collect()
    };
    let whole: std::collections::HashMap<i64, f64> = all(&straight).into_iter().collect();
    assert_eq!(whole.len(), 36);
    let again = all(&resumed);
    // Steps 21 to 25 ran before the kill and again after the resume.
    assert_eq!(again.len(), 36 + 5, "{again:?}");
    for (step, loss) in &again {
        assert_eq!(
            whole.get(step).map(|l| l.to_bits()),
            Some(loss.to_bits()),
            "step {step}"
        );
    }
    assert_eq!(straight.final_bytes(), resumed.final_bytes());
    let steps = straight.steps();
    let mut seen = 0;
    for s in &steps {
        let lm = s.language.expect("a language model's step");
        let e = s.loss.exp();
        assert!(
            (lm.perplexity - e).abs() <= 1e-12 * e,
            "step {}: {} vs exp(loss) {e}",
            s.step,
            lm.perplexity
        );
        assert!(lm.tokens_per_s > 0.0, "step {}", s.step);
        assert_eq!(lm.tokens, 4 * 24, "step {}", s.step);
        seen += 4 * 24;
        assert_eq!(lm.tokens_seen, seen, "step {}", s.step);
    }
}

/// A tiny llama over the token file `path` in windows of `seq_len`, micro-batch 2, every step
/// recorded.
fn llama_on_tokens(t: &Test, path: &Path, seq_len: i64) -> Test {
    t.clone().spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 4\n[model]\npreset = \"llama\"\n\
         [model.llama]\nvocab_size = 128\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\n\
         num_attention_heads = 4\nnum_key_value_heads = 2\nseq_len = {seq_len}\n\
         [data]\nsource = \"tokens\"\npath = \"{}\"\ntoken_dtype = \"uint16\"\nseq_len = {seq_len}\nval_fraction = 0.1\n\
         [train]\nepochs = 1\nbatch_size = 2\naccumulation_steps = 2\noptimizer = \"adamw\"\nlr = 0.003\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        path.display()
    )))
}

/// `n` token ids below 128 in a noisy pattern, as uint16.
fn pattern(path: &Path, n: u32) {
    write_u16(path, (0..n as u64).map(|i| ((i * 7 + i * i % 13) % 128) as u16));
}

/// A training run on a 64 MiB token file, eight times the run's 8 MiB cap on CPU tensor memory
/// (`memory.limit`): the file is read in place, so the run trains under the cap, and its
/// anonymous memory (`RssAnon`, polled while it runs; the page cache's copy of the file is not
/// the process's to keep) grows by less than an eighth of the file over the same run on 128 KiB
/// of tokens: what grows is the 24 bytes a window of the epoch's order (130K windows, 3 MiB).
#[test]
fn a_token_file_many_times_the_host_bound_trains_under_it() {
    let t = Test::new();
    const TOKENS: u32 = 32 << 20;
    let (big, small) = (t.dir().join("big.bin"), t.dir().join("small.bin"));
    pattern(&big, TOKENS);
    pattern(&small, 64 << 10);
    let cap = 8u64 << 20;
    let run = |path: &Path, name: &str| {
        let running = llama_on_tokens(&t, path, 256)
            .name(name)
            .set("memory.limit", "8MiB")
            .arg("--max-steps")
            .arg("6")
            .spawn();
        let peak = crate::data::peak_rss_anon(running.pid());
        let out = running.finish();
        (out, peak.join().unwrap())
    };
    let (small_run, base) = run(&small, "small");
    let (big_run, mapped) = run(&big, "big");
    let file = 2 * TOKENS as u64;
    eprintln!(
        "peak RssAnon: {} MiB on 128 KiB of tokens, {} MiB on {} MiB",
        base >> 20,
        mapped >> 20,
        file >> 20
    );
    assert!(
        mapped < base + file / 8,
        "a {} MiB token file added {} MiB of anonymous memory",
        file >> 20,
        mapped.saturating_sub(base) >> 20
    );
    let start = &big_run.starts()[0];
    assert_eq!(start.train_samples + start.val_samples, (TOKENS / 257) as i64);
    for o in [&small_run, &big_run] {
        let s = o.summary();
        assert_eq!(s.status, Status::StepLimit);
        assert_eq!(s.memory.cap.as_ref().map(|c| c.bytes), Some(cap));
        let peak = s.memory.peak_allocated_bytes.unwrap();
        assert!(peak <= cap, "{peak} B of tensors under the {cap} B cap");
        assert!(o.ooms().is_empty());
        let losses = step_losses(o);
        assert_eq!(losses.len(), 6);
        assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    }
}

/// Token data through the loader: its batches depend on the seed, the epoch and the windows'
/// indices alone, so no prefetch, a deep prefetch over two threads and the default train to the
/// same per-step losses and weights, bit for bit; `check` says what the loader holds.
#[test]
fn token_batches_are_the_same_whatever_the_loader_does() {
    let t = Test::new();
    let path = t.dir().join("train.bin");
    pattern(&path, 4000);
    let job = llama_on_tokens(&t, &path, 24);
    let default = job.clone().name("default").run();
    assert!(step_losses(&default).len() >= 30);
    for (prefetch, workers) in [(0, 1), (4, 2), (1, 3)] {
        let other = job
            .clone()
            .name(&format!("p{prefetch}w{workers}"))
            .set("data.prefetch", prefetch)
            .set("data.workers", workers)
            .run();
        let what = format!("prefetch {prefetch}, workers {workers}");
        assert_eq!(step_losses(&other), step_losses(&default), "{what}");
        assert_eq!(other.final_bytes(), default.final_bytes(), "{what}");
    }
    let checked = job
        .clone()
        .command("check")
        .set("data.prefetch", 4)
        .set("data.workers", 2)
        .run()
        .stdout;
    let line = checked.lines().find(|l| l.starts_with("data loader")).unwrap();
    assert!(
        line.starts_with("data loader      7 micro-batch(es) of 2 × 24 int64 token ids and targets")
            && line.contains("2 thread(s) (data.workers)"),
        "{line}"
    );
}
