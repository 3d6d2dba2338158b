//! What each lever does to a language model's bill: the guide's 1B and 8B tables are what
//! `check` prints, and `check` counts an 8B model without holding it.
use crate::common::*;

/// A Llama-shaped job over a small token file: (hidden, intermediate, layers, tied, seq_len, cap).
fn llama(t: &Test, (hidden, inter, layers, tied, seq, cap): (i64, i64, i64, bool, i64, &str)) -> Test {
    let tokens = t.dir().join("tokens.bin");
    std::fs::write(&tokens, vec![0u8; 4 * 4 * (seq as usize + 1)]).unwrap();
    t.clone().command("check").spec(table(&format!(
        "[job]\nname = \"lm\"\n[model]\npreset = \"llama\"\n[model.llama]\nvocab_size = 128256\n\
         hidden_size = {hidden}\nintermediate_size = {inter}\nnum_hidden_layers = {layers}\n\
         num_attention_heads = 32\nnum_key_value_heads = 8\nmax_position_embeddings = 131072\n\
         tie_word_embeddings = {tied}\n[data]\nsource = \"tokens\"\npath = \"{}\"\ntoken_dtype = \"uint32\"\n\
         seq_len = {seq}\n[train]\nepochs = 1\nbatch_size = 1\noptimizer = \"adamw\"\n[memory]\nlimit = \"{cap}\"\n",
        tokens.display()
    )))
}

/// The five settings of each table, in its rows' order.
fn levers(t: Test, targets: &[&str]) -> [Test; 5] {
    let lora = |t: Test| {
        t.set("model.lora.rank", 16)
            .set("model.lora.alpha", 32.0)
            .set("model.lora.targets", targets.to_vec())
            .set("train.precision", "bf16-mixed")
            .set("train.frozen_dtype", "bf16")
    };
    [
        t.clone(),
        t.clone()
            .set("memory.optimizer_state", "host")
            .set("memory.gradients", "host"),
        t.clone().set("memory.parameters", "host"),
        lora(t.clone()),
        lora(t).set("memory.parameters", "host"),
    ]
}

/// `check`'s device and host static bytes: `device static    X (...); host Y`.
fn bill(stdout: &str) -> (String, String) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("device static"))
        .expect("check's device line");
    let device = line["device static".len()..]
        .trim_start()
        .split(" (")
        .next()
        .unwrap()
        .to_owned();
    let host = line.split("; host ").nth(1).unwrap_or("0").to_owned();
    (device, host)
}

/// A markdown table's rows after its header: (device, host) from the last two cells.
fn rows(text: &str) -> Vec<(String, String)> {
    text.lines()
        .skip_while(|l| !l.starts_with("| setting |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            (cells[cells.len() - 2].to_owned(), cells[cells.len() - 1].to_owned())
        })
        .collect()
}

#[test]
fn the_language_model_guides_lever_tables_are_what_check_prints() {
    let doc = std::fs::read_to_string(repo().join("docs/language-models.md")).unwrap();
    let (one, eight) = doc
        .split_once("The same on a Llama-3.1-8B shape")
        .expect("the 8B table");
    let t = Test::new();
    let one_b = levers(llama(&t, (2048, 8192, 16, true, 1024, "4GiB")), &["q", "k", "v", "o"]);
    let all = ["q", "k", "v", "o", "gate", "up", "down"];
    let eight_b = levers(llama(&t, (4096, 14336, 32, false, 2048, "12GiB")), &all);
    for (text, jobs) in [(one, one_b), (eight, eight_b)] {
        let outs: Vec<String> = jobs.into_iter().map(|j| j.run().stdout).collect();
        let printed: Vec<(String, String)> = outs.iter().map(|o| bill(o)).collect();
        assert_eq!(rows(text), printed);
        // A 128k vocabulary's logits go a chunk at a time, whatever the lever.
        for o in &outs {
            let loss = o
                .lines()
                .find(|l| l.starts_with("next-token loss"))
                .expect("check's loss line");
            assert!(
                loss.contains("tokens at a time") && loss.contains("not the whole"),
                "{loss}"
            );
        }
    }
}

/// `check` builds the model as shapes without values: an 8B model, whose fp32 initialisation
/// alone would be 32 GB, is counted within a 4 GiB address space.
#[test]
fn check_counts_an_8b_model_without_holding_it() {
    let t = Test::new();
    let job = llama(&t, (4096, 14336, 32, false, 2048, "12GiB"));
    let [.., streamed] = levers(job, &["q", "v"]);
    let out = streamed
        .launched_by("bash", &["-c", "ulimit -v 4194304 && exec \"$@\"", "bash"])
        .run();
    let model = out.stdout.lines().find(|l| l.starts_with("model ")).unwrap();
    assert!(model.contains("8030.26M frozen (the base under model.lora)"), "{model}");
    assert_eq!(bill(&out.stdout).0, "1002 MiB");
}

/// The guide's three TOML blocks (the model, the data, the training), put together as one job
/// over a tiny Hugging Face directory, its tokenizer and a jsonl file of prompts and
/// completions: `check` takes it and says what the loss holds at a time, and `run` trains it;
/// section 4's `generate` and `export` commands then run as written. Only what a model this
/// small needs is overridden: its window.
#[test]
fn the_language_model_guides_blocks_make_a_job_that_checks_and_trains() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let made = std::process::Command::new(python())
        .arg(repo().join("tests/py/llama_reference.py"))
        .args(["make", "--out"])
        .arg(dir.join("SmolLM2-135M"))
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let words = ["what", "is", "two", "plus", "four", "six", "three", "one"];
    let mut vocab = serde_json::json!({"<unk>": 0, "</s>": 1});
    for (i, w) in words.iter().enumerate() {
        vocab[*w] = serde_json::json!(i + 2);
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("SmolLM2-135M/tokenizer.json"), tokenizer.to_string()).unwrap();
    let pairs: Vec<String> = (0..32)
        .map(|i| {
            let (q, a) = [("what is two plus four", "six"), ("what is one plus two", "three")][i % 2];
            serde_json::json!({"prompt": q, "completion": a}).to_string()
        })
        .collect();
    std::fs::write(dir.join("sft.jsonl"), pairs.join("\n") + "\n").unwrap();

    let guide = std::fs::read_to_string(repo().join("docs/language-models.md")).unwrap();
    let blocks: Vec<&str> = guide
        .split("```toml\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap())
        .collect();
    assert_eq!(
        blocks.len(),
        3,
        "the guide's TOML blocks: the model, the data, the training"
    );
    // Its paths name files beside the job; the tests run from the repository.
    let spec = format!(
        "[job]\nname = \"sft\"\ndevice = \"cpu\"\nthreads = 2\n{}\n{}\n{}",
        blocks[0], blocks[2], blocks[1]
    )
    .replace("\"SmolLM2-135M", &format!("\"{}/SmolLM2-135M", dir.display()))
    .replace("\"sft.jsonl\"", &format!("\"{}\"", dir.join("sft.jsonl").display()));
    let job = t
        .clone()
        .name("sft")
        .spec_text(&spec)
        .args(&["--set", "data.seq_len=16"]);
    let checked = job.clone().command("check").run();
    let chunk = checked
        .stdout
        .lines()
        .find(|l| l.starts_with("next-token loss"))
        .unwrap_or_else(|| panic!("check names the loss's chunk:\n{}", checked.stdout));
    // 4 windows of 16 tokens, 96 entries of vocabulary each: one chunk holds them all.
    assert!(
        chunk.contains("the micro-batch's 64 tokens in one chunk: 24.00 KiB of fp32 logits"),
        "{chunk}"
    );
    let trained = job
        .clone()
        .args(&["--max-steps", "2", "--set", "log.every_steps=1"])
        .run();
    let losses: Vec<f64> = trained.steps().iter().map(|s| s.loss).collect();
    assert_eq!(losses.len(), 2, "{losses:?}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");

    // Section 4's commands, as the guide writes them, on the job trained through.
    let run = job.name("guide").run();
    let section: &str = guide.split("## 4.").nth(1).expect("the guide's section 4");
    let commands: Vec<&str> = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("section 4's commands")
        .lines()
        .collect();
    assert_eq!(commands.len(), 3, "{commands:?}");
    for line in commands {
        let line = line.split(" # ").next().unwrap().trim();
        // Quoted words are one argument.
        let mut args: Vec<String> = vec![];
        for (i, part) in line.split('"').enumerate() {
            match i % 2 {
                1 => args.push(part.to_owned()),
                _ => args.extend(part.split_whitespace().map(str::to_owned)),
            }
        }
        let args: Vec<String> = args
            .into_iter()
            .skip(1)
            .map(|a| match a.as_str() {
                "runs/sft" => run.out.display().to_string(),
                "sft-merged" => dir.join("sft-merged").display().to_string(),
                _ => a,
            })
            .collect();
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = t.clone().command(argv[0]).no_spec().args(&argv[1..]).run();
        // The tiny tokenizer knows none of the prompt's words: it prints them as <unk>.
        if argv[0] == "generate" {
            assert!(o.stdout.starts_with("<unk>"), "{line}: {}", o.stdout);
        }
    }
    assert!(dir.join("sft-merged/config.json").is_file());
}
