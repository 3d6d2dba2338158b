//! `memtrain generate`: a small decoder trained on a jsonl file of one repeated sentence, with a
//! word-level tokenizer, continues a prompt with the rest of the sentence and stops at its
//! end-of-text token; what it cannot do is refused with exit 2.

use crate::common::*;

const SENTENCE: &str = "one two three four five six seven eight";

/// The sentence's jsonl file (300 copies) and its tokenizer, in `t`'s directory.
fn sentence_files(t: &Test) -> (std::path::PathBuf, std::path::PathBuf) {
    let (data, tok) = (t.dir().join("d.jsonl"), t.dir().join("tokenizer.json"));
    word_tokenizer(&tok, &SENTENCE.split(' ').collect::<Vec<_>>());
    let line = serde_json::json!({ "text": SENTENCE }).to_string();
    std::fs::write(&data, format!("{}\n", vec![line; 300].join("\n"))).unwrap();
    (data, tok)
}

/// A llama of 16 tokens trained for 3 epochs on 300 copies of the sentence.
fn trained(t: &Test) -> Outcome {
    let (data, tok) = sentence_files(t);
    t.clone()
        .name("lm")
        .spec(table(&format!(
            "[job]\nthreads = 2\ndevice = \"cpu\"\n[model]\npreset = \"llama\"\n\
             [model.llama]\nvocab_size = 16\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\n\
             num_attention_heads = 4\nnum_key_value_heads = 2\nmax_position_embeddings = 64\n\
             [data]\nsource = \"jsonl\"\npath = \"{}\"\ntokenizer = \"{}\"\ntext_field = \"text\"\nseq_len = 16\n\
             [train]\nepochs = 3\nbatch_size = 8\noptimizer = \"adamw\"\nlr = 0.01\n[log]\nprogress = \"off\"\n",
            data.display(),
            tok.display()
        )))
        .run()
}

fn generate(t: &Test, args: &[&str]) -> Test {
    t.clone().command("generate").no_spec().args(args)
}

#[test]
fn a_trained_decoder_continues_its_sentence_and_stops_at_the_end() {
    let t = Test::new();
    let run = trained(&t);
    let dir = run.out.display().to_string();
    // A language model's outputs are its vocabulary: the run keeps no class list, and eval
    // reports its token mean without one.
    assert!(!run.out.join("classes.json").exists());
    let e = t.clone().command("eval").no_spec().args(&[&dir]).run();
    assert!(e.stdout.contains("perplexity"), "{}", e.stdout);
    let o = generate(&t, &[&dir, "--prompt", "three four", "--max-new-tokens", "10"]).run();
    assert_eq!(
        o.stdout.trim(),
        "three four five six seven eight",
        "greedy decoding through the cache continues the sentence and stops at </s>"
    );
    // Token ids in, past the end-of-text token with --ignore-eos (the tokenizer writes it: this
    // one does not mark it special).
    let o = generate(
        &t,
        &[&dir, "--prompt-ids", "2 3", "--max-new-tokens", "8", "--ignore-eos"],
    )
    .run();
    let ids: Vec<&str> = o.stdout.split_whitespace().collect();
    let want = [
        "one", "two", "three", "four", "five", "six", "seven", "eight", "</s>", "one",
    ];
    assert_eq!(ids[..10], want[..], "{}", o.stdout);
    // Sampling is seeded: the same seed gives the same text.
    let sample = |seed: &str| {
        generate(
            &t,
            &[
                &dir,
                "--prompt",
                "one",
                "--temperature",
                "1.5",
                "--seed",
                seed,
                "--ignore-eos",
            ],
        )
        .run()
        .stdout
    };
    assert_eq!(sample("4"), sample("4"));

    // Refused with what to do: an id beyond the vocabulary, and a classifier's run.
    generate(&t, &[&dir, "--prompt-ids", "3 99"])
        .exit(2)
        .stderr_has("token id 99, beyond the model's vocabulary of 16")
        .run();
    let digits = t.clone().name("digits").set("train.epochs", 1).run();
    generate(&t, &[&digits.out.display().to_string(), "--prompt-ids", "1"])
        .exit(2)
        .stderr_has("is a classifier: score it with memtrain eval")
        .run();
}

/// A run whose decoder layers streamed from host memory (`memory.parameters = "host"`) under a
/// cap smaller than its weights: generate streams them the same way under that cap, and its
/// greedy tokens are those of the whole model on the device; eval's figures too.
#[test]
fn a_streamed_run_generates_under_its_cap_token_for_token_as_the_whole_model() {
    let t = Test::new();
    let (data, tok) = sentence_files(&t);
    // 8 layers of about 1 MiB each; the cap holds two of them, not all eight.
    let run = t
        .clone()
        .name("streamed")
        .spec(table(&format!(
            "[job]\nthreads = 2\ndevice = \"cpu\"\n[model]\npreset = \"llama\"\n\
             [model.llama]\nvocab_size = 16\nhidden_size = 128\nintermediate_size = 512\nnum_hidden_layers = 8\n\
             num_attention_heads = 4\nnum_key_value_heads = 2\nmax_position_embeddings = 64\n\
             [data]\nsource = \"jsonl\"\npath = \"{}\"\ntokenizer = \"{}\"\ntext_field = \"text\"\nseq_len = 16\n\
             [train]\nepochs = 1\nbatch_size = 8\noptimizer = \"adamw\"\nlr = 0.001\n\
             [memory]\nparameters = \"host\"\nlimit = \"4MiB\"\n[log]\nprogress = \"off\"\n",
            data.display(),
            tok.display()
        )))
        .run();
    let dir = run.out.display().to_string();
    let ids = ["--prompt-ids", "2 3 4", "--max-new-tokens", "12", "--ignore-eos"];
    let streamed = generate(&t, &[&[dir.as_str()], &ids[..]].concat()).run().stdout;

    // The same weights read by a run directory whose spec keeps them on the device.
    let elsewhere = |name: &str, drop: &[&str]| respecced(&run.out, &t.dir().join(name), drop);
    // The weights alone: the checkpoint's state names the levers the run had engaged.
    let checkpoint = memtrain::checkpoint::Store::latest_in(&run.out).unwrap();
    let ck = t.dir().join("model.safetensors");
    std::fs::copy(checkpoint.join("model.safetensors"), &ck).unwrap();
    let ck = ck.display().to_string();
    let whole_dir = elsewhere("whole", &["parameters =", "limit ="]);
    let whole = generate(&t, &[&[whole_dir.as_str(), "--checkpoint", &ck], &ids[..]].concat())
        .run()
        .stdout;
    assert_eq!(streamed, whole, "streamed greedy decoding equals the whole model's");
    assert_eq!(streamed.split_whitespace().count(), 3 + 12, "{streamed}");

    // eval streams the layers the same way under the cap, with the whole model's figures.
    let scored = |dir: &str, weights: &str, name: &str| {
        let json = t.dir().join(name);
        let args = [dir, "--checkpoint", weights, "--json", json.to_str().unwrap()];
        t.clone().command("eval").no_spec().args(&args).run();
        typed::<memtrain::eval::EvalReport>(&json)
    };
    let ck_dir = checkpoint.display().to_string();
    let (s, w) = (
        scored(&dir, &ck_dir, "streamed.json"),
        scored(&whole_dir, &ck, "whole.json"),
    );
    assert_eq!(s.loss.to_bits(), w.loss.to_bits(), "{} vs {}", s.loss, w.loss);
    assert_eq!((s.tokens, s.accuracy), (w.tokens, w.accuracy));

    // Under the same cap the whole model does not fit: streaming is what keeps it under.
    let capped = elsewhere("capped", &["parameters ="]);
    generate(&t, &[&[capped.as_str(), "--checkpoint", &ck], &ids[..]].concat())
        .exit(3)
        .stderr_has("out of memory")
        .run();
}
