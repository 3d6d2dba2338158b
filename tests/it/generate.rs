//! `memtrain generate`: a small decoder trained on a jsonl file of one repeated sentence, with a
//! word-level tokenizer, continues a prompt with the rest of the sentence and stops at its
//! end-of-text token; what it cannot do is refused with exit 2.
use std::path::Path;

use crate::common::*;

const SENTENCE: &str = "one two three four five six seven eight";

/// A word-level tokenizer.json of the sentence's words (after `<unk>` = 0 and `</s>` = 1).
fn tokenizer(path: &Path) {
    let mut vocab = serde_json::json!({"<unk>": 0, "</s>": 1});
    for (i, w) in SENTENCE.split(' ').enumerate() {
        vocab[w] = serde_json::json!(i + 2);
    }
    let t = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(path, t.to_string()).unwrap();
}

/// A llama of 16 tokens trained for 3 epochs on 300 copies of the sentence.
fn trained(t: &Test) -> Outcome {
    let (data, tok) = (t.dir().join("d.jsonl"), t.dir().join("tokenizer.json"));
    tokenizer(&tok);
    let line = serde_json::json!({ "text": SENTENCE }).to_string();
    std::fs::write(&data, format!("{}\n", vec![line; 300].join("\n"))).unwrap();
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
