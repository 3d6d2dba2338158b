//! Token data for language models through the data module's public face: `load` gives int64
//! windows `x` `[seq_len]` and next-token targets `y` `[seq_len]` (-100: no loss), from a flat
//! token file or from JSON lines tokenized as Python's `tokenizers` does.
use std::fs;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use super::source::jsonl::pair_window;
use super::*;
use crate::spec::schema::{DataSource, TokenDtype};

fn tokens_spec(path: &Path, seq_len: i64) -> Data {
    Data {
        source: DataSource::Tokens,
        path: Some(path.to_owned()),
        seq_len: Some(seq_len),
        token_dtype: Some(TokenDtype::Uint16),
        ..Data::default()
    }
}

fn write_u16(path: &Path, ids: impl IntoIterator<Item = u16>) {
    let bytes: Vec<u8> = ids.into_iter().flat_map(u16::to_le_bytes).collect();
    fs::write(path, bytes).unwrap();
}

fn err_of(r: Result<Splits>) -> String {
    format!("{:#}", r.expect_err("expected an error"))
}

/// Every window of `d` in order: (x, y) as int64 rows.
fn windows(d: &Dataset) -> (Vec<Vec<i64>>, Vec<Vec<i64>>) {
    let idx = Tensor::arange(d.len(), (Kind::Int64, Device::Cpu));
    let (x, y) = d.batch(&idx);
    assert_eq!(
        (x.kind(), y.kind()),
        (Kind::Int64, Kind::Int64),
        "token ids stay integers"
    );
    (
        Vec::<Vec<i64>>::try_from(x).unwrap(),
        Vec::<Vec<i64>>::try_from(y).unwrap(),
    )
}

#[test]
fn a_token_file_is_cut_into_windows_whose_targets_are_the_next_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = (dir.path().join("train.bin"), dir.path().join("val.bin"));
    // 10 windows of 5 tokens (seq_len 4) and a tail of 3 left out.
    write_u16(&train, (0..53).map(|i| (i * 7 % 1000) as u16));
    write_u16(&val, 1000..1011);
    let d = Data {
        val_path: Some(val),
        ..tokens_spec(&train, 4)
    };
    let s = load(&d, &[4], 1024, 0).unwrap();
    assert_eq!((s.train.len(), s.val.len()), (10, 2));
    assert!(s.train.is_mapped() && s.train.is_tokens());
    assert_eq!(s.train.sample_shape(), vec![4]);
    let (x, y) = windows(&s.train);
    for (k, (x, y)) in x.iter().zip(&y).enumerate() {
        let w: Vec<i64> = (0..5).map(|i| ((5 * k as i64 + i) * 7) % 1000).collect();
        assert_eq!((&x[..], &y[..]), (&w[..4], &w[1..]), "window {k}");
    }
    let (x, y) = windows(&s.val);
    assert_eq!(
        (x[1].clone(), y[1].clone()),
        (vec![1005, 1006, 1007, 1008], vec![1006, 1007, 1008, 1009])
    );
    // A batch as training draws it: [batch, seq_len] int64 both.
    let (bx, by) = s.train.batch_at(&[3, 1], 0);
    assert_eq!((bx.size(), by.size()), (vec![2, 4], vec![2, 4]));
    assert_eq!(Vec::<i64>::try_from(bx.get(1)).unwrap(), windows(&s.train).0[1]);
    // Held out without val_path: val_fraction of the windows, none in both.
    let s = load(&tokens_spec(&train, 4), &[4], 1024, 7).unwrap();
    assert_eq!((s.train.len(), s.val.len()), (8, 2));
    let (tx, _) = windows(&s.train);
    let (vx, _) = windows(&s.val);
    assert!(vx.iter().all(|v| !tx.contains(v)));
}

#[test]
fn an_npy_says_its_own_token_type() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ids.npy");
    let header = "{'descr': '<u4', 'fortran_order': False, 'shape': (12,), }";
    let header = format!("{header:<width$}\n", width = 117);
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend((header.len() as u16).to_le_bytes());
    b.extend(header.as_bytes());
    b.extend((0..12u32).flat_map(|i| (70_000 + i).to_le_bytes()));
    fs::write(&p, b).unwrap();
    let d = Data {
        token_dtype: None,
        ..tokens_spec(&p, 3)
    };
    let s = load(
        &Data {
            val_fraction: 0.34,
            ..d.clone()
        },
        &[3],
        80_000,
        0,
    )
    .unwrap();
    let mut all: Vec<Vec<i64>> = windows(&s.train).0;
    all.extend(windows(&s.val).0);
    all.sort();
    assert_eq!(all[2], vec![70_008, 70_009, 70_010]);
    // A token_dtype that contradicts the header is refused.
    let e = err_of(load(
        &Data {
            token_dtype: Some(TokenDtype::Uint16),
            ..d
        },
        &[3],
        80_000,
        0,
    ));
    assert!(
        e.contains("data.token_dtype = Uint16 but the .npy file holds <u4"),
        "{e}"
    );
}

#[test]
fn token_data_errors_say_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("train.bin");
    write_u16(&p, (0..40).map(|i| if i == 23 { 600 } else { i }));
    let e = err_of(load(&tokens_spec(&p, 4), &[4], 512, 0));
    assert!(
        e.contains("the token at position 23 (counting from 0) has id 600, outside the model's vocabulary of 512 ids"),
        "{e}"
    );
    let e = err_of(load(&tokens_spec(&p, 40), &[40], 1024, 0));
    assert!(
        e.contains("holds 40 token(s), fewer than one window of data.seq_len + 1 = 41 tokens"),
        "{e}"
    );
    let e = err_of(load(
        &Data {
            token_dtype: None,
            ..tokens_spec(&p, 4)
        },
        &[4],
        1024,
        0,
    ));
    assert!(e.contains("set data.token_dtype = \"uint16\" or \"uint32\""), "{e}");
    let e = err_of(load(
        &Data {
            seq_len: None,
            ..tokens_spec(&p, 4)
        },
        &[4],
        1024,
        0,
    ));
    assert!(e.contains("data.seq_len is required"), "{e}");
    let e = err_of(load(&tokens_spec(&p, 4), &[8], 1024, 0));
    assert!(
        e.contains("windows of [4] tokens (data.seq_len) but the model takes inputs of shape [8]"),
        "{e}"
    );
    fs::write(&p, [0u8; 9]).unwrap();
    let e = err_of(load(&tokens_spec(&p, 2), &[2], 1024, 0));
    assert!(e.contains("is 9 bytes, not a whole number of 2-byte ids"), "{e}");
}

#[test]
fn windows_come_in_the_seeded_order_and_a_resumed_epoch_continues_with_the_same_ones() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("train.bin");
    write_u16(&p, (0..5 * 64).map(|i| i as u16));
    let s = load(&tokens_spec(&p, 4), &[4], 1024, 3).unwrap();
    let n = s.train.len();
    let batches = |epoch: i64| -> Vec<Vec<i64>> {
        epoch_order(n, 3, epoch)
            .chunks(4)
            .map(|b| Vec::<i64>::try_from(s.train.batch_at(b, epoch).0.flatten(0, -1)).unwrap())
            .collect()
    };
    let whole = batches(1);
    assert_eq!(whole, batches(1), "the same order each time");
    assert_ne!(whole, batches(2), "another epoch, another order");
    // A run stopped after 5 steps of epoch 1 reopens the set and continues at step 6.
    let again = load(&tokens_spec(&p, 4), &[4], 1024, 3).unwrap();
    let order = epoch_order(again.train.len(), 3, 1);
    let rest: Vec<Vec<i64>> = order
        .chunks(4)
        .skip(5)
        .map(|b| Vec::<i64>::try_from(again.train.batch_at(b, 1).0.flatten(0, -1)).unwrap())
        .collect();
    assert_eq!(rest, whole[5..]);
}

/// This process's anonymous resident memory (`RssAnon`), in bytes.
fn rss_anon() -> u64 {
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let kb = status.lines().find_map(|l| l.strip_prefix("RssAnon:")).unwrap();
    kb.split_whitespace().next().unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn a_token_file_of_a_gigabyte_is_read_mapped_not_into_memory() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("big.bin");
    const SIZE: u64 = 1 << 30;
    // Sparse: a gigabyte of token 0, with a few ids written at its end.
    let f = fs::File::create(&p).unwrap();
    f.set_len(SIZE).unwrap();
    drop(f);
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.seek(SeekFrom::Start(SIZE - 8)).unwrap();
        f.write_all(&[1, 0, 2, 0, 3, 0, 4, 0]).unwrap();
    }
    let before = rss_anon();
    // A vocabulary below 65536: every id is read once, to check it.
    let s = load(&tokens_spec(&p, 1023), &[1023], 50_304, 0).unwrap();
    assert!(s.train.is_mapped());
    let n = s.train.len() + s.val.len();
    assert_eq!(n, (SIZE / 2 / 1024) as i64);
    for k in 0..8 {
        let _ = s.train.batch_at(&[k * 1000, k * 7 + 1], 0);
    }
    let grew = rss_anon().saturating_sub(before);
    eprintln!("1 GiB token file: {} MiB more anonymous memory", grew >> 20);
    assert!(
        grew < SIZE / 8,
        "{} MiB of anonymous memory for a mapped 1 GiB file",
        grew >> 20
    );
}

#[test]
fn a_prompts_targets_carry_no_loss() {
    // Prompt [10, 11, 12], completion [20, 21], EOS 2, seq_len 7.
    let (x, y) = pair_window(&[10, 11, 12], &[20, 21], Some(2), 7);
    assert_eq!(x, vec![10, 11, 12, 20, 21, 2, 2]);
    // Position 2 (12) predicts 20, the first completion token: the first that counts.
    assert_eq!(y, vec![-100, -100, 20, 21, 2, -100, -100]);
    // Truncated to seq_len + 1 tokens; no EOS known: padded with 0 and none appended.
    let (x, y) = pair_window(&[10, 11], &[20, 21, 22, 23], None, 4);
    assert_eq!((x, y), (vec![10, 11, 20, 21], vec![-100, 20, 21, 22]));
    // A prompt longer than the window leaves it without loss.
    let (_, y) = pair_window(&[1; 9], &[5], Some(2), 4);
    assert!(y.iter().all(|&t| t == -100));
}

/// Trains a byte-level BPE tokenizer with Python's `tokenizers` on `texts` in `dir` and writes
/// `tokenizer.json` and `data.jsonl` (one `{"text", "prompt", "completion"}` a line, a blank
/// line among them); returns Python's ids of each text, with and without special tokens.
fn python_tokenizer(dir: &Path, texts: &[&str]) -> serde_json::Value {
    let python = std::env::var("MEMTRAIN_PYTHON").expect("MEMTRAIN_PYTHON (scripts/bootstrap) is set");
    let script = r#"
import json, sys
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders, processors
out, texts = sys.argv[1], json.loads(sys.argv[2])
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(texts * 20, trainer)
tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
tok.save(out + "/tokenizer.json")
with open(out + "/data.jsonl", "w", encoding="utf-8") as f:
    for i, t in enumerate(texts):
        f.write(json.dumps({"text": t, "prompt": t, "completion": texts[-1 - i]}, ensure_ascii=False) + "\n")
        if i == 1:
            f.write("\n")
print(json.dumps({"special": [tok.encode(t).ids for t in texts],
                  "plain": [tok.encode(t, add_special_tokens=False).ids for t in texts],
                  "vocab": tok.get_vocab_size(), "eos": tok.token_to_id("</s>")}))
"#;
    let o = std::process::Command::new(python)
        .args([
            "-c",
            script,
            dir.to_str().unwrap(),
            &serde_json::to_string(texts).unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<Vec<i64>> {
    serde_json::from_value(v.clone()).unwrap()
}

const TEXTS: [&str; 6] = [
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, 日本語のテキスト, emoji 😀👍 and ünïcödé",
    "",
    "line one\n\nline three after an empty line\n",
    "  leading and trailing spaces  ",
    "tabs\tand \"quotes\" and \\ backslashes",
];

fn jsonl_spec(dir: &Path, seq_len: i64) -> Data {
    Data {
        source: DataSource::Jsonl,
        path: Some(dir.join("data.jsonl")),
        val_path: Some(dir.join("data.jsonl")),
        tokenizer: Some(dir.join("tokenizer.json")),
        seq_len: Some(seq_len),
        ..Data::default()
    }
}

#[test]
fn jsonl_text_is_tokenized_as_pythons_tokenizers_does_and_packed_with_eos() {
    let dir = tempfile::tempdir().unwrap();
    let py = python_tokenizer(dir.path(), &TEXTS);
    let eos = py["eos"].as_i64().unwrap();
    let stream: Vec<i64> = ids(&py["special"])
        .into_iter()
        .flat_map(|d| d.into_iter().chain([eos]))
        .collect();
    let d = Data {
        text_field: Some("text".into()),
        ..jsonl_spec(dir.path(), 8)
    };
    let s = load(&d, &[8], 512, 0).unwrap();
    assert!(s.train.is_mapped());
    let (x, y) = windows(&s.train);
    let n = stream.len() / 9;
    assert_eq!(x.len(), n);
    for (k, (x, y)) in x.iter().zip(&y).enumerate() {
        assert_eq!(&x[..], &stream[9 * k..9 * k + 8], "window {k}");
        assert_eq!(&y[..], &stream[9 * k + 1..9 * k + 9], "window {k}");
    }
    // Later runs map the cache: the same windows, the cache beside the file, nothing else.
    let cached: Vec<PathBuf> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains(".tokens-"))
        .collect();
    assert_eq!(cached.len(), 1, "{cached:?}");
    assert_eq!(windows(&load(&d, &[8], 512, 0).unwrap().train).0, x);
}

#[test]
fn jsonl_pairs_carry_loss_on_the_completion_alone() {
    let dir = tempfile::tempdir().unwrap();
    let py = python_tokenizer(dir.path(), &TEXTS);
    let eos = py["eos"].as_u64().unwrap() as u32;
    let (special, plain) = (ids(&py["special"]), ids(&py["plain"]));
    let d = Data {
        prompt_field: Some("prompt".into()),
        completion_field: Some("completion".into()),
        ..jsonl_spec(dir.path(), 24)
    };
    let s = load(&d, &[24], 512, 0).unwrap();
    let (x, y) = windows(&s.train);
    assert_eq!(x.len(), TEXTS.len(), "one window a pair, the blank line skipped");
    let u32s = |v: &[i64]| v.iter().map(|&t| t as u32).collect::<Vec<u32>>();
    for i in 0..TEXTS.len() {
        let (wx, wy) = pair_window(&u32s(&special[i]), &u32s(&plain[TEXTS.len() - 1 - i]), Some(eos), 24);
        let i64s = |v: Vec<i32>| v.into_iter().map(i64::from).collect::<Vec<i64>>();
        assert_eq!((&x[i], &y[i]), (&i64s(wx), &i64s(wy)), "pair {i}");
        // Every target inside the prompt is -100.
        let p = special[i].len();
        assert!(
            y[i][..p.saturating_sub(1).min(24)].iter().all(|&t| t == -100),
            "pair {i}"
        );
    }
}

#[test]
fn jsonl_errors_name_the_line_and_write_no_cache() {
    let dir = tempfile::tempdir().unwrap();
    let py = python_tokenizer(dir.path(), &TEXTS);
    let d = Data {
        text_field: Some("text".into()),
        val_path: None,
        ..jsonl_spec(dir.path(), 4)
    };
    let data = dir.path().join("data.jsonl");
    let good = fs::read_to_string(&data).unwrap();
    fs::write(&data, format!("{good}{{\"body\": \"x\"}}\n")).unwrap();
    let e = err_of(load(&d, &[4], 512, 0));
    assert!(e.contains("line 8: has no field \"text\""), "{e}");
    fs::write(&data, format!("{good}{{\"text\": \"x\"\n")).unwrap();
    let e = err_of(load(&d, &[4], 512, 0));
    assert!(e.contains("line 8: not valid JSON"), "{e}");
    let vocab = py["vocab"].as_i64().unwrap();
    let e = err_of(load(&d, &[4], vocab - 1, 0));
    assert!(
        e.contains(&format!(
            "has a vocabulary of {vocab} ids, more than the model's vocabulary of {}",
            vocab - 1
        )),
        "{e}"
    );
    fs::write(&data, "{\"text\": \"hi\"}\n").unwrap();
    let e = err_of(load(
        &Data {
            seq_len: Some(64),
            ..d.clone()
        },
        &[64],
        512,
        0,
    ));
    assert!(
        e.contains("fewer tokens than one window of data.seq_len + 1 = 65 tokens"),
        "{e}"
    );
    let left: Vec<String> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tokens-") || n.starts_with(".tmp"))
        .collect();
    assert_eq!(left.len(), 1, "only the short file's whole cache: {left:?}");
}

/// The most anonymous memory `f` adds while it runs, sampled from another thread.
fn peak_growth(f: impl FnOnce()) -> u64 {
    let before = rss_anon();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_anon());
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            peak
        })
    };
    f();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    watch.join().unwrap().saturating_sub(before)
}

/// The environment variable that makes `tokenize_a_large_jsonl_alone` run (in a process of its
/// own, so no other test's allocations count).
const ALONE: &str = "MEMTRAIN_TEST_TOKENIZE_ALONE";

#[test]
fn jsonl_is_tokenized_into_its_cache_in_bounded_memory() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "data::token_tests::tokenize_a_large_jsonl_alone",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ALONE, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    let grew: u64 = text
        .lines()
        .find_map(|l| l.split("peak growth: ").nth(1))
        .unwrap_or_else(|| panic!("no measurement: {text}"))
        .trim()
        .parse()
        .unwrap();
    eprintln!(
        "tokenizing 54 MB of ids: {} MiB more anonymous memory at the peak",
        grew >> 20
    );
    assert!(
        grew < 16 << 20,
        "{} MiB of anonymous memory to tokenize 54 MB of ids",
        grew >> 20
    );
}

#[test]
#[ignore = "run by jsonl_is_tokenized_into_its_cache_in_bounded_memory in a process of its own"]
fn tokenize_a_large_jsonl_alone() {
    if std::env::var_os(ALONE).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let words = ["one", "two", "three", "four", "five", "six", "seven", "eight"];
    let mut vocab = serde_json::json!({"<unk>": 0, "</s>": 1});
    for (i, w) in words.iter().enumerate() {
        vocab[*w] = serde_json::json!(i + 2);
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    // 1.5 million documents of 9 ids: 54 MB of int32 ids.
    const DOCS: usize = 1_500_000;
    {
        use std::io::Write;
        let line = format!("{}\n", serde_json::json!({ "text": words.join(" ") }));
        let mut w = std::io::BufWriter::new(fs::File::create(dir.path().join("data.jsonl")).unwrap());
        for _ in 0..DOCS {
            w.write_all(line.as_bytes()).unwrap();
        }
    }
    let spec = Data {
        text_field: Some("text".into()),
        ..jsonl_spec(dir.path(), 16)
    };
    let mut windows = 0;
    let grew = peak_growth(|| {
        let s = load(&spec, &[16], 16, 0).unwrap();
        windows = s.train.len();
    });
    assert_eq!(windows, (DOCS * 9 / 17) as i64);
    println!("peak growth: {grew}");
}
