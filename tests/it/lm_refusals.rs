//! A language model's bad input, through `memtrain run` on a Hugging Face llama directory: a
//! token id beyond the vocabulary, a tokenizer larger than the model's vocabulary, a `seq_len`
//! beyond the model's positions, a jsonl line without the named field and a sharded index naming
//! a missing shard. Each is refused with exit 2 and an error that says where, before anything is
//! written: no run directory, no token cache, no entry left in the run registry.
use std::path::Path;

use crate::common::*;
use crate::llama::llama_py;

/// What a refused run may leave: nothing in the test's directory but the inputs it was given.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// `memtrain run` of the llama directory `hf` (96 ids, 256 positions) on `data` (a `[data]`
/// body), refused with exit 2 and `says`; the directory holds afterwards what it held before
/// but the spec file.
#[track_caller]
fn refused(t: &Test, name: &str, hf: &Path, data: &str, says: &str) {
    let before = entries(t.dir());
    let o = t
        .clone()
        .name(name)
        .spec(table(&format!(
            "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\npreset = \"llama\"\ninit_from = \"{}\"\n\
             [data]\n{data}\n[train]\nepochs = 1\nbatch_size = 2\noptimizer = \"adamw\"\nlr = 0.001\n\
             [log]\nprogress = \"off\"\n",
            hf.display()
        )))
        .exit(2)
        .stderr_has(says)
        .run();
    assert!(!o.out.exists(), "{name}: the refused run wrote {}", o.out.display());
    // The run registry (a runtime directory of one file per live process) keeps no entry.
    let registry = t.dir().join("registry");
    if registry.exists() {
        assert_eq!(
            entries(&registry),
            Vec::<String>::new(),
            "{name}: a registry entry stays"
        );
    }
    let mut after = entries(t.dir());
    after.retain(|n| *n != format!("{name}.toml") && n != "registry");
    let mut before = before;
    before.retain(|n| n != "registry");
    assert_eq!(
        after, before,
        "{name}: the refused run left files behind:\n{}",
        o.stderr
    );
}

#[test]
fn bad_language_model_input_is_refused_by_run_and_writes_nothing() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    llama_py(&dir, &["make", "--out", "hf", "--shards", "2"]);
    let hf = dir.join("hf");

    // A token id beyond the 96-id vocabulary, at a place the error names.
    let ids: Vec<u8> = (0..600u32)
        .flat_map(|i| (if i == 321 { 96u16 } else { (i % 90) as u16 }).to_le_bytes())
        .collect();
    std::fs::write(dir.join("train.bin"), ids).unwrap();
    let tokens = format!(
        "source = \"tokens\"\npath = \"{}\"\ntoken_dtype = \"uint16\"\nseq_len = 16",
        dir.join("train.bin").display()
    );
    refused(
        &t,
        "id",
        &hf,
        &tokens,
        "the token at position 321 (counting from 0) has id 96, outside the model's vocabulary of 96 ids",
    );

    // A window longer than the model's 256 positions.
    refused(
        &t,
        "positions",
        &hf,
        &tokens.replace("seq_len = 16", "seq_len = 300"),
        "beyond the model's 256 positions",
    );

    // jsonl: a tokenizer of 100 ids for a model of 96, and a line without the named field.
    let words: Vec<String> = (0..98).map(|i| format!("w{i}")).collect();
    word_tokenizer(&dir.join("big.json"), &words);
    word_tokenizer(&dir.join("small.json"), &words[..10]);
    let lines = "{\"text\": \"w1 w2 w3\"}\n\n{\"text\": \"w4 w5\"}\n{\"body\": \"w6\"}\n";
    std::fs::write(dir.join("d.jsonl"), lines).unwrap();
    let jsonl = |tok: &str| {
        format!(
            "source = \"jsonl\"\npath = \"{}\"\ntokenizer = \"{}\"\ntext_field = \"text\"\nseq_len = 4",
            dir.join("d.jsonl").display(),
            dir.join(tok).display()
        )
    };
    refused(
        &t,
        "tokenizer",
        &hf,
        &jsonl("big.json"),
        "has a vocabulary of 100 ids, more than the model's vocabulary of 96",
    );
    refused(&t, "field", &hf, &jsonl("small.json"), "line 4: has no field \"text\"");

    // A sharded checkpoint whose index names a shard that is not there.
    let index = json(&hf.join("model.safetensors.index.json"));
    let shard = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(|v| v.as_str())
        .max()
        .unwrap()
        .to_owned();
    std::fs::remove_file(hf.join(&shard)).unwrap();
    let clean: Vec<u8> = (0..600u32).flat_map(|i| ((i % 90) as u16).to_le_bytes()).collect();
    std::fs::write(dir.join("clean.bin"), clean).unwrap();
    let clean = tokens.replace("train.bin", "clean.bin");
    refused(
        &t,
        "shard",
        &hf,
        &clean,
        &format!("names the shard {}, which does not exist", hf.join(&shard).display()),
    );
}
