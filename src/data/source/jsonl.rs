//! `jsonl`: JSON lines of text, tokenized by `data.tokenizer` (a Hugging Face `tokenizer.json`)
//! once into a token cache beside the file (`data.cache_dir` puts it elsewhere), which later
//! runs map in place. Its name hashes the file's size and modification time, the tokenizer's
//! bytes and how the text is read, so a changed file or tokenizer makes a new one.
//!
//! Two shapes:
//! - plain text (`data.text_field`): each document's ids (special tokens as the tokenizer adds
//!   them), then the EOS token, packed into one stream cut into windows of `seq_len + 1` as the
//!   `tokens` source cuts a token file;
//! - prompt/completion (`data.prompt_field`, `data.completion_field`): a pair is one window, the
//!   prompt's ids (with special tokens), the completion's (without) and EOS where the tokenizer
//!   has one, truncated to `seq_len + 1` tokens and padded with EOS (else 0); `y` is -100 for
//!   every target inside the prompt and past the end, so only the completion carries loss.
//!
//! Blank lines are skipped. A line that is not JSON, or lacks the field, stops the run with its
//! line number before anything is written.
use std::fs;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::Tokenizer;

use super::token_cache::Spill;
use super::tokens::seq_len;
use super::DataClasses;
use super::{Opened, Part, Reader, Want};
use crate::data::check::required_path;
use crate::data::gather::Targets;
use crate::data::mapped::safetensors_store;
use crate::data::store::{Map, Store};
use crate::spec::schema::Data;

pub struct Jsonl;

/// The target of a token that carries no loss.
pub const IGNORED: i64 = -100;

/// Names an EOS token goes by in common tokenizers, tried in order.
const EOS_NAMES: [&str; 6] = [
    "</s>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<eos>",
    "<|im_end|>",
    "<|eot_id|>",
];

/// The tokenizer's end-of-text token, found by one of its common names (`EOS_NAMES`).
pub fn eos_by_name(tokenizer: &tokenizers::Tokenizer) -> Option<u32> {
    EOS_NAMES.iter().find_map(|n| tokenizer.token_to_id(n))
}

impl Reader for Jsonl {
    fn sample_shape(&self, data: &Data, _: &Path) -> Result<Option<Vec<i64>>> {
        Ok(data.seq_len.map(|n| vec![n]))
    }

    fn open(&self, want: &Want) -> Result<Opened> {
        let data = want.data;
        let text = Text::of(data, want.num_classes)?;
        let part = |key: &str, path: &Path| -> Result<Part> {
            let what = format!("{key} {}", path.display());
            let (x, targets) = text.windows(path, &what)?;
            Ok(Part::tokens(x, targets, what))
        };
        Ok(Opened {
            train: part("data.path", required_path(data)?)?,
            val: data.val_path.as_deref().map(|v| part("data.val_path", v)).transpose()?,
        })
    }

    fn how_read(&self, _: &Data) -> &'static str {
        "is tokenized once into a token cache beside it (data.cache_dir), then read in place through a memory map (int64 batches)"
    }

    fn classes(&self, _: &Data, _: &Path) -> Result<Option<DataClasses>> {
        Ok(None)
    }

    fn extent(&self, data: &Data) -> Option<String> {
        let text = Text::of(data, i64::MAX).ok()?;
        let path = data.path.as_deref()?;
        let cache = text.cache_path(path).ok()?;
        let n = match text.open_cache(&cache) {
            Some((x, _)) => x.shape[0],
            None => return Some(format!("not tokenized yet: the first run writes {}", cache.display())),
        };
        Some(format!("{n} windows of {} tokens in {}", text.seq_len, cache.display()))
    }

    /// What `open` would refuse before tokenizing: the tokenizer (its file, its vocabulary
    /// against the model's) and each file's first document (JSON, with the fields).
    fn check(&self, data: &Data, vocab: Option<i64>) -> Result<()> {
        let text = Text::of(data, vocab.unwrap_or(i64::MAX))?;
        for (key, path) in [("data.path", &data.path), ("data.val_path", &data.val_path)] {
            if let Some(p) = path {
                text.first_document(p, &format!("{key} {}", p.display()))?;
            }
        }
        Ok(())
    }
}

/// How the documents are read.
#[derive(Debug, Clone)]
enum Shape {
    Plain { field: String },
    Pairs { prompt: String, completion: String },
}

/// The tokenizer and how text becomes windows.
struct Text<'a> {
    data: &'a Data,
    tokenizer: Tokenizer,
    /// Hash of the tokenizer file's bytes.
    tokenizer_hash: u64,
    shape: Shape,
    eos: Option<u32>,
    seq_len: i64,
}

impl<'a> Text<'a> {
    /// The tokenizer of `data.tokenizer`, refused when its ids reach past `vocab` (the model's).
    fn of(data: &'a Data, vocab: i64) -> Result<Text<'a>> {
        let seq_len = seq_len(data)?;
        let path = data.tokenizer.as_deref().ok_or_else(|| {
            anyhow!("data.tokenizer is required for data.source = \"jsonl\": a Hugging Face tokenizer.json")
        })?;
        let what = format!("data.tokenizer {}", path.display());
        let bytes = fs::read(path).with_context(|| format!("{what}: cannot read it"))?;
        let tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| anyhow!("{what}: not a tokenizer.json ({e})"))?;
        let size = tokenizer
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as i64 + 1)
            .max(tokenizer.get_vocab_size(true) as i64);
        if size > vocab {
            bail!("{what}: has a vocabulary of {size} ids, more than the model's vocabulary of {vocab}; use the tokenizer the model was trained with (a Hugging Face model directory's tokenizer.json), or, for a model drawn at random, set model.llama.vocab_size to at least {size}");
        }
        let shape = match (&data.text_field, &data.prompt_field, &data.completion_field) {
            (Some(t), None, None) => Shape::Plain { field: t.clone() },
            (None, Some(p), Some(c)) => Shape::Pairs {
                prompt: p.clone(),
                completion: c.clone(),
            },
            _ => bail!("data.source = \"jsonl\" reads either plain text (set data.text_field) or prompt/completion pairs (set data.prompt_field and data.completion_field)"),
        };
        let eos = match data.eos_id {
            Some(id) if id >= vocab => bail!("data.eos_id = {id} is outside the model's vocabulary of {vocab} ids"),
            Some(id) => Some(id as u32),
            None => eos_by_name(&tokenizer),
        };
        if eos.is_none() && matches!(shape, Shape::Plain { .. }) {
            bail!(
                "{what}: has no end-of-text token (none of {}) to put between documents; set data.eos_id",
                EOS_NAMES.join(", ")
            );
        }
        Ok(Text {
            data,
            tokenizer,
            tokenizer_hash: fnv1a(FNV_START, &bytes),
            shape,
            eos,
            seq_len,
        })
    }

    /// The windows of the file at `path` and their targets: from the cache, or tokenized into it.
    fn windows(&self, path: &Path, what: &str) -> Result<(Store, Targets)> {
        let cache = self.cache_path(path)?;
        if let Some(opened) = self.open_cache(&cache) {
            tracing::info!("{what}: token ids from the cache {}", cache.display());
            return self.checked(opened, what);
        }
        let t0 = std::time::Instant::now();
        let writing = || {
            format!(
                "{what}: writing the token cache {}{}",
                cache.display(),
                match self.data.cache_dir {
                    None => "; set data.cache_dir to a writable directory",
                    Some(_) => "",
                }
            )
        };
        let names: &[&'static str] = match self.shape {
            Shape::Plain { .. } => &["x"],
            Shape::Pairs { .. } => &["x", "y"],
        };
        let mut spill = Spill::new(&cache, names).with_context(writing)?;
        let shapes = self.tokenize(path, what, &mut spill, &writing)?;
        spill.finish(&cache, &shapes).with_context(writing)?;
        tracing::info!(
            "{what}: tokenized in {:.1} s into {}",
            t0.elapsed().as_secs_f64(),
            cache.display()
        );
        let opened = self
            .open_cache(&cache)
            .ok_or_else(|| anyhow!("{what}: cannot read back the token cache {}", cache.display()))?;
        self.checked(opened, what)
    }

    /// Windows as the model takes them: at least one.
    fn checked(&self, (x, targets): (Store, Targets), what: &str) -> Result<(Store, Targets)> {
        if x.shape[0] < 1 {
            bail!(
                "{what}: its text makes fewer tokens than one window of data.seq_len + 1 = {} tokens; use more text or a smaller data.seq_len",
                self.seq_len + 1
            );
        }
        Ok((x, targets))
    }

    /// The cache's windows, mapped, when it is there and whole.
    fn open_cache(&self, cache: &Path) -> Option<(Store, Targets)> {
        let map = Arc::new(Map::open(cache).ok()?);
        let x = safetensors_store(&map, "x")?;
        match self.shape {
            Shape::Plain { .. } => (x.shape.len() == 1).then(|| (x.windows(self.seq_len + 1), Targets::Next)),
            Shape::Pairs { .. } => {
                let y = safetensors_store(&map, "y")?;
                let fits = x.shape.len() == 2 && x.shape[1] == self.seq_len && y.shape == x.shape;
                fits.then(|| (x, Targets::Stored(Arc::new(y))))
            }
        }
    }

    /// Where the tokens of the file at `path` are kept.
    fn cache_path(&self, path: &Path) -> Result<PathBuf> {
        let meta = fs::metadata(path).with_context(|| format!("{}: cannot read it", path.display()))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let how = match &self.shape {
            Shape::Plain { field } => format!("plain {field:?}"),
            Shape::Pairs { prompt, completion } => format!("pairs {prompt:?} {completion:?} {}", self.seq_len),
        };
        let key = format!(
            "v1 {} {mtime} {:x} {how} {:?}",
            meta.len(),
            self.tokenizer_hash,
            self.eos
        );
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let file = format!("{name}.tokens-{:016x}.safetensors", fnv1a(FNV_START, key.as_bytes()));
        let dir = match &self.data.cache_dir {
            Some(d) => d.clone(),
            None => path.parent().map(Path::to_path_buf).unwrap_or_default(),
        };
        Ok(dir.join(file))
    }

    /// Every line's ids, into the tensors of the cache: `x` (a stream, or `[N, seq_len]`) and,
    /// for pairs, `y`; written to `spill` as they come, never held whole. Their shapes.
    fn tokenize(
        &self,
        path: &Path,
        what: &str,
        spill: &mut Spill,
        writing: &dyn Fn() -> String,
    ) -> Result<Vec<Vec<i64>>> {
        let f = fs::File::open(path).with_context(|| format!("{what}: cannot read it"))?;
        let mut push = |i: usize, values: &mut dyn Iterator<Item = i32>| spill.push(i, values).with_context(writing);
        let encode = |text: &str, special: bool, line: usize| -> Result<Vec<u32>> {
            let e = self
                .tokenizer
                .encode(text, special)
                .map_err(|e| anyhow!("{what}: line {line}: cannot tokenize it ({e})"))?;
            Ok(e.get_ids().to_vec())
        };
        // Pairs, and those whose prompt fills the window: no completion token carries loss.
        let (mut pairs, mut lossless) = (0usize, 0usize);
        for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
            let n = i + 1;
            let line = line.with_context(|| format!("{what}: line {n}: cannot read it (not UTF-8?)"))?;
            if line.trim().is_empty() {
                continue;
            }
            let doc = json_line(&line, what, n)?;
            let texts = self.texts(&doc, what, n)?;
            match &self.shape {
                Shape::Plain { .. } => {
                    push(0, &mut encode(texts[0], true, n)?.iter().map(|&t| t as i32))?;
                    push(0, &mut self.eos.map(|e| e as i32).into_iter())?;
                }
                Shape::Pairs { .. } => {
                    let p = encode(texts[0], true, n)?;
                    let c = encode(texts[1], false, n)?;
                    let (x, y) = self.pair_window(&p, &c);
                    pairs += 1;
                    lossless += y.iter().all(|&t| t == IGNORED as i32) as usize;
                    push(0, &mut x.into_iter())?;
                    push(1, &mut y.into_iter())?;
                }
            }
        }
        self.lossless_pairs(what, pairs, lossless)?;
        let n = spill.len(0) as i64;
        Ok(match self.shape {
            Shape::Plain { .. } => vec![vec![n]],
            Shape::Pairs { .. } => vec![vec![n / self.seq_len, self.seq_len]; 2],
        })
    }

    /// Pairs whose prompt fills the window train nothing: said, and refused when every pair is
    /// one (the loss would be over no token at all).
    fn lossless_pairs(&self, what: &str, pairs: usize, lossless: usize) -> Result<()> {
        let fix = "raise data.seq_len or shorten the prompts";
        if pairs > 0 && lossless == pairs {
            bail!(
                "{what}: no pair has a completion token within data.seq_len = {} tokens (every prompt fills the window), so none would carry loss; {fix}",
                self.seq_len
            );
        }
        if lossless > 0 {
            tracing::warn!(
                "{what}: {lossless} of {pairs} pairs have no completion token within data.seq_len = {} tokens (the prompt fills the window), so they carry no loss; {fix}",
                self.seq_len
            );
        }
        Ok(())
    }

    /// A document's texts: its text field, or its prompt and completion.
    fn texts<'d>(&self, doc: &'d serde_json::Value, what: &str, n: usize) -> Result<Vec<&'d str>> {
        let field = |name: &str| -> Result<&'d str> {
            match doc.get(name) {
                Some(serde_json::Value::String(s)) => Ok(s),
                Some(v) => bail!("{what}: line {n}: field \"{name}\" is {v}, not a string"),
                None => bail!("{what}: line {n}: has no field \"{name}\""),
            }
        };
        match &self.shape {
            Shape::Plain { field: f } => Ok(vec![field(f)?]),
            Shape::Pairs { prompt, completion } => Ok(vec![field(prompt)?, field(completion)?]),
        }
    }

    /// The file's first document read as `tokenize` reads each, for `check`.
    fn first_document(&self, path: &Path, what: &str) -> Result<()> {
        let f = fs::File::open(path).with_context(|| format!("{what}: cannot read it"))?;
        for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
            let n = i + 1;
            let line = line.with_context(|| format!("{what}: line {n}: cannot read it (not UTF-8?)"))?;
            if !line.trim().is_empty() {
                self.texts(&json_line(&line, what, n)?, what, n)?;
                break;
            }
        }
        Ok(())
    }

    /// One prompt/completion pair as a window: ids `x` and targets `y`.
    fn pair_window(&self, prompt: &[u32], completion: &[u32]) -> (Vec<i32>, Vec<i32>) {
        pair_window(prompt, completion, self.eos, self.seq_len as usize)
    }
}

/// `prompt`, `completion` and `eos` (where known) as one window of `seq_len`: ids `x`, padded
/// with EOS (else 0), and targets `y`, each position's next id where that is a completion token
/// (or the EOS after it), -100 elsewhere.
pub fn pair_window(prompt: &[u32], completion: &[u32], eos: Option<u32>, seq_len: usize) -> (Vec<i32>, Vec<i32>) {
    let mut ids: Vec<i32> = prompt
        .iter()
        .chain(completion)
        .chain(eos.as_ref())
        .map(|&t| t as i32)
        .collect();
    ids.truncate(seq_len + 1);
    let p = prompt.len();
    let pad = eos.map_or(0, |e| e as i32);
    let x = (0..seq_len).map(|i| ids.get(i).copied().unwrap_or(pad)).collect();
    let y = (0..seq_len)
        .map(|i| match ids.get(i + 1) {
            Some(&t) if i + 1 >= p => t,
            _ => IGNORED as i32,
        })
        .collect();
    (x, y)
}

/// Line `n` of the file, a JSON document.
fn json_line(line: &str, what: &str, n: usize) -> Result<serde_json::Value> {
    serde_json::from_str(line).map_err(|e| anyhow!("{what}: line {n}: not valid JSON ({e})"))
}

const FNV_START: u64 = 0xCBF2_9CE4_8422_2325;

fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3))
}
