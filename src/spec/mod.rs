//! Job specs: TOML files, `--set` overrides, and errors that point at the file, line and key.
//!
//! Every problem is first expressed as a dotted key path (`train.batch_size`), then placed:
//! in an override if `--set` supplied that key, else at the key's line:column in the file.
pub mod error;
mod launch;
pub mod schema;
mod validate;
pub use error::SpecError;
pub use validate::{graph_declines, graph_declines_of, placement as optimizer_placement, streams};

use std::ops::Range;
use std::path::{Path, PathBuf};

pub use schema::*;

/// One `--set key=value` from the command line.
#[derive(Debug, Clone)]
pub struct Override {
    pub key: String,
    pub raw: String,
    value: toml_edit::Value,
}

impl Override {
    /// Values are typed as TOML (`8`, `true`, `[\"a\"]`, `\"x\"`); anything that is not valid TOML
    /// is taken as a string, so `--set job.device=cpu` works without quotes.
    pub fn parse(arg: &str) -> Result<Self, String> {
        let (key, raw) = arg
            .split_once('=')
            .ok_or_else(|| format!("--set {arg}: expected KEY=VALUE, e.g. --set train.batch_size=8"))?;
        let key = key.trim();
        if key.is_empty() || key.split('.').any(|p| p.trim().is_empty()) {
            return Err(format!(
                "--set {arg}: \"{key}\" is not a dotted key like train.batch_size"
            ));
        }
        Ok(Override {
            key: key.to_owned(),
            raw: raw.to_owned(),
            value: toml_value(raw),
        })
    }
}

/// `--rank-set R:KEY=VALUE` entries that apply to `rank`, as `--set` values.
pub fn rank_sets(entries: &[String], rank: usize, world: usize) -> anyhow::Result<Vec<String>> {
    let mut out = vec![];
    for e in entries {
        let (r, set) = e
            .split_once(':')
            .and_then(|(r, set)| Some((r.trim().parse::<usize>().ok()?, set)))
            .ok_or_else(|| {
                crate::exit::UsageError(format!(
                    "--rank-set {e:?}: expected RANK:KEY=VALUE, e.g. 1:memory.limit=64MiB"
                ))
            })?;
        // Ranks must agree on everything that decides which collectives they run (optimizer,
        // sharding, batch, checkpoints); memory is what differs between devices.
        if !set.trim_start().starts_with("memory.") {
            return Err(crate::exit::UsageError(format!(
                "--rank-set {e:?}: only memory.* keys can differ between ranks (e.g. 1:memory.limit=64MiB); use --set for the others"
            ))
            .into());
        }
        if r >= world {
            return Err(crate::exit::UsageError(format!(
                "--rank-set {e:?}: there is no rank {r}; the ranks are 0 to {}",
                world - 1
            ))
            .into());
        }
        if r == rank {
            out.push(set.to_owned());
        }
    }
    Ok(out)
}

/// A value typed as TOML (`8`, `true`, `["a"]`, `"x"`), or the text as a string when it is not
/// valid TOML.
pub fn toml_value(raw: &str) -> toml_edit::Value {
    format!("v = {raw}")
        .parse::<toml_edit::DocumentMut>()
        .ok()
        .and_then(|d| d.get("v").and_then(|i| i.as_value().cloned()))
        .unwrap_or_else(|| toml_edit::Value::from(raw))
}

/// A parsed, overridden and validated spec, with where it came from.
#[derive(Debug, Clone)]
pub struct LoadedSpec {
    pub spec: Spec,
    pub path: PathBuf,
}

/// Problems the model layer finds in the spec's `[model]` table (a preset's options), as
/// (dotted key, message); it may complete what it owns with defaults (the preset's options
/// table) and with what the data says (an image model's size). It sees `[model]` and `[data]`.
pub type MoreChecks<'a> = &'a dyn Fn(&mut Model, &Data) -> Vec<(String, String)>;

/// Parses `--set` arguments and loads the spec with `more` checks (the presets'); every
/// failure is a spec error (exit 2) placed at its `file:line:col` or override.
pub fn load_args(file: &Path, sets: &[String], more: MoreChecks) -> Result<LoadedSpec, SpecError> {
    let overrides = sets
        .iter()
        .map(|s| Override::parse(s))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|m| SpecError { problems: vec![m] })?;
    load_with(file, &overrides, more)
}

/// Reads, overrides, deserialises and validates a spec.
pub fn load(path: &Path, overrides: &[Override]) -> Result<LoadedSpec, SpecError> {
    load_with(path, overrides, &|_, _| vec![])
}

/// `load`, with `more` checks run after the spec's own.
pub fn load_with(path: &Path, overrides: &[Override], more: MoreChecks) -> Result<LoadedSpec, SpecError> {
    let shown = path.display().to_string();
    let one = |m: String| SpecError { problems: vec![m] };
    let text = read_text(path)?;
    let original = toml_edit::ImDocument::parse(text.as_str()).map_err(|e| {
        let at = e.span().map(|s| line_col(&text, s.start)).unwrap_or((1, 1));
        one(format!(
            "{shown}:{}:{}: invalid TOML: {}",
            at.0,
            at.1,
            first_sentence(e.message())
        ))
    })?;
    let mut doc = original.clone().into_mut();
    for o in overrides {
        set_path(&mut doc, &o.key, o.value.clone()).map_err(|m| one(format!("--set {}={}: {m}", o.key, o.raw)))?;
    }
    let merged = doc.to_string();
    let places = Places {
        file: &shown,
        text: &text,
        original: &original,
        overrides,
    };

    let mut spec: Spec = toml::from_str(&merged).map_err(|e| {
        let key = e
            .span()
            .and_then(|s| {
                toml_edit::ImDocument::parse(merged.as_str())
                    .ok()
                    .map(|d| key_at(&d, s))
            })
            .unwrap_or_default();
        let msg = clean_serde_message(e.message(), &key);
        // A missing key has no place in the file; naming the nearest key would mislead.
        let key = if msg.starts_with("missing field") {
            String::new()
        } else {
            key
        };
        one(places.describe(&key, &msg))
    })?;
    if spec.job.name.is_empty() {
        spec.job.name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "job".into());
    }
    spec.data.resolve();
    let mut problems = validate::validate(&spec);
    if problems.is_empty() {
        problems = more(&mut spec.model, &spec.data);
    }
    if !problems.is_empty() {
        return Err(SpecError {
            problems: problems
                .iter()
                .map(|(k, m)| places.describe(k, &format!("{k} {m}")))
                .collect(),
        });
    }
    Ok(LoadedSpec {
        spec,
        path: path.to_owned(),
    })
}

/// Resolved spec as TOML, as `check` prints it and runs record it.
pub fn to_toml(spec: &Spec) -> String {
    toml::to_string_pretty(spec).expect("a spec always serialises")
}

/// A resolved spec's paths made absolute, as the run directory keeps it: `eval`, `export` and
/// `generate` read the run's files from whatever directory they are run in, and a relative
/// path there is relative to the directory the run started in.
pub fn with_absolute_paths(spec_toml: &str) -> String {
    let Ok(mut doc) = spec_toml.parse::<toml_edit::DocumentMut>() else {
        return spec_toml.to_owned();
    };
    let keys: [&[&str]; 6] = [
        &["model", "init_from"],
        &["model", "torchscript", "path"],
        &["data", "path"],
        &["data", "val_path"],
        &["data", "tokenizer"],
        &["data", "cache_dir"],
    ];
    for key in keys {
        // Looked up without inserting: Item::get_mut would add the tables it walks through.
        let Some(item) = key
            .iter()
            .try_fold(doc.as_item_mut(), |item, k| item.as_table_like_mut()?.get_mut(k))
        else {
            continue;
        };
        let absolute = item
            .as_str()
            .map(Path::new)
            .filter(|p| p.is_relative())
            .and_then(|p| std::path::absolute(p).ok());
        if let Some(a) = absolute {
            *item = toml_edit::value(a.display().to_string());
        }
    }
    doc.to_string()
}

struct Places<'a> {
    file: &'a str,
    text: &'a str,
    original: &'a toml_edit::ImDocument<&'a str>,
    overrides: &'a [Override],
}

impl Places<'_> {
    /// "file:line:col: msg" for a key in the file, "--set k=v: msg" for an overridden one.
    fn describe(&self, key: &str, msg: &str) -> String {
        let overridden =
            self.overrides.iter().rev().find(|o| {
                key == o.key || key.starts_with(&format!("{}.", o.key)) || o.key.starts_with(&format!("{key}."))
            });
        if let Some(o) = overridden {
            return format!("--set {}={}: {msg}", o.key, o.raw);
        }
        match span_of(self.original, key) {
            Some(s) => {
                let (l, c) = line_col(self.text, s.start);
                format!("{}:{l}:{c}: {msg}", self.file)
            }
            None => format!("{}: {msg}", self.file),
        }
    }
}

/// 1-based line and column of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map(|l| l.chars().count()).unwrap_or(0) + 1;
    (line, col)
}

fn first_sentence(msg: &str) -> String {
    msg.lines().next().unwrap_or(msg).trim().to_owned()
}

/// serde says "unknown field `x`, expected one of ..." without the table; add the full key and
/// a hint so the message stands on its own.
fn clean_serde_message(msg: &str, key: &str) -> String {
    let msg = first_sentence(msg);
    if msg.starts_with("unknown field") {
        // The span is the unknown key itself; name the table it was found in.
        let table = key
            .rsplit_once('.')
            .map(|(t, _)| format!("[{t}]"))
            .unwrap_or_else(|| "the top level".into());
        return format!("{msg} (in {table}); check the spelling against docs/spec.md");
    }
    if msg.starts_with("missing field") {
        return format!("{msg}; the spec must have it (see docs/spec.md)");
    }
    let msg = plain_types(&msg);
    if key.is_empty() {
        msg
    } else {
        format!("{key}: {msg}")
    }
}

/// The spec file's text. One saved in another encoding (UTF-16 by some editors) reads as
/// invalid UTF-8, which the error says how to mend.
fn read_text(path: &Path) -> Result<String, SpecError> {
    std::fs::read_to_string(path).map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::InvalidData => "; save it as UTF-8 text".to_owned(),
            // A run directory given where its spec belongs.
            _ if path.join("config.resolved.toml").is_file() => format!(
                "; it is a run directory: give the job spec (TOML), and continue the run with `memtrain run SPEC --resume {}` (the run's resolved spec is {})",
                path.display(),
                path.join("config.resolved.toml").display()
            ),
            _ if path.is_dir() => "; give the job spec, a TOML file".to_owned(),
            _ => String::new(),
        };
        SpecError {
            problems: vec![format!("{}: cannot read spec file: {e}{hint}", path.display())],
        }
    })
}

/// serde names Rust's types ("expected i64", "expected struct Train"); a spec's author knows
/// TOML's. A quoted number gets the hint to drop the quotes.
pub(crate) fn plain_types(msg: &str) -> String {
    let mut out = msg.to_owned();
    for (rust, toml) in [
        ("expected i64", "expected an integer"),
        ("expected u64", "expected an integer, 0 or more"),
        ("expected i32", "expected an integer"),
        ("expected u32", "expected an integer, 0 or more"),
        ("expected usize", "expected an integer, 0 or more"),
        ("expected f64", "expected a number"),
        ("expected a sequence", "expected an array, like [1, 2]"),
    ] {
        out = out.replace(rust, toml);
    }
    if let Some(i) = out.find("expected struct ") {
        let end = out[i..].find([',', ';']).map_or(out.len(), |e| i + e);
        out.replace_range(i..end, "expected a table");
    }
    if out.starts_with("invalid type: string") && (out.contains("an integer") || out.contains("a number")) {
        out.push_str(" (write numbers without quotes)");
    }
    out
}

/// Where `key` (dotted) sits in the document: the value's key if present, else the nearest table.
fn span_of(doc: &toml_edit::ImDocument<&str>, key: &str) -> Option<Range<usize>> {
    let mut item: &toml_edit::Item = doc.as_item();
    let mut best = None;
    for part in key.split('.') {
        let (k, next) = match item {
            // A key that is not written (a missing required key) is placed at its table.
            toml_edit::Item::Table(t) => match t.get_key_value(part) {
                Some(kv) => kv,
                None => return best,
            },
            toml_edit::Item::Value(toml_edit::Value::InlineTable(t)) => {
                let Some((k, v)) = t.get_key_value(part) else {
                    return best;
                };
                return k.span().or_else(|| v.span()).or(best);
            }
            toml_edit::Item::Value(v) => return v.span().or(best),
            _ => return best,
        };
        best = k.span().or_else(|| next.span()).or(best);
        item = next;
    }
    best
}

/// The dotted key whose key or value encloses the error span in `doc` (deepest wins).
fn key_at(doc: &toml_edit::ImDocument<&str>, span: Range<usize>) -> String {
    fn walk(table: &toml_edit::Table, pos: usize, prefix: &str, found: &mut (usize, String)) {
        for (name, item) in table.iter() {
            let path = if prefix.is_empty() {
                name.to_owned()
            } else {
                format!("{prefix}.{name}")
            };
            let key_span = table.key(name).and_then(|k| k.span());
            let inside = |s: Option<Range<usize>>| {
                s.map(|s| s.start <= pos && pos <= s.end.max(s.start + 1))
                    .unwrap_or(false)
            };
            let depth = path.matches('.').count() + 1;
            if (inside(key_span.clone()) || inside(item.span())) && depth >= found.0 {
                *found = (depth, path.clone());
            }
            match item {
                toml_edit::Item::Table(t) => walk(t, pos, &path, found),
                toml_edit::Item::Value(toml_edit::Value::InlineTable(t)) => {
                    walk(&t.clone().into_table(), pos, &path, found)
                }
                _ => {}
            }
        }
    }
    let mut found = (0, String::new());
    walk(doc.as_table(), span.start, "", &mut found);
    found.1
}

/// The spec file's text with the `--set` overrides and then `edits` applied (`None` removes a
/// key), its comments and layout kept: what `fit --write` writes and what its probes run.
pub fn edited_text(
    path: &Path,
    sets: &[String],
    edits: &[(&str, Option<toml_edit::Value>)],
) -> Result<String, SpecError> {
    let one = |m: String| SpecError { problems: vec![m] };
    let text = read_text(path)?;
    let mut doc: toml_edit::DocumentMut = text
        .parse()
        .map_err(|e| one(format!("{}: invalid TOML: {e}", path.display())))?;
    for s in sets {
        let o = Override::parse(s).map_err(one)?;
        set_path(&mut doc, &o.key, o.value).map_err(|m| one(format!("--set {s}: {m}")))?;
    }
    for (key, value) in edits {
        match value {
            Some(v) => set_path(&mut doc, key, v.clone()).map_err(|m| one(format!("{key}: {m}")))?,
            None => remove_path(&mut doc, key),
        }
    }
    Ok(doc.to_string())
}

/// Removes a dotted key; a key (or a table on its path) that is not there is already removed.
fn remove_path(doc: &mut toml_edit::DocumentMut, key: &str) {
    let parts: Vec<&str> = key.split('.').map(str::trim).collect();
    let (last, tables) = parts.split_last().expect("keys are non-empty");
    let mut table: &mut dyn toml_edit::TableLike = doc.as_table_mut();
    for part in tables {
        match table.get_mut(part).and_then(|i| i.as_table_like_mut()) {
            Some(t) => table = t,
            None => return,
        }
    }
    table.remove(last);
}

fn is_table(doc: &toml_edit::DocumentMut, parts: &[&str]) -> bool {
    let mut table: &dyn toml_edit::TableLike = doc.as_table();
    for part in parts {
        match table.get(part).and_then(|i| i.as_table_like()) {
            Some(t) => table = t,
            None => return false,
        }
    }
    true
}

fn set_path(doc: &mut toml_edit::DocumentMut, key: &str, value: toml_edit::Value) -> Result<(), String> {
    let parts: Vec<&str> = key.split('.').map(str::trim).collect();
    if let toml_edit::Value::InlineTable(t) = &value {
        if is_table(doc, &parts) {
            // `--set train={epochs=1}` sets train.epochs and keeps train's other keys: an
            // override adds and changes keys, never removes them.
            for (k, v) in t.iter() {
                set_path(doc, &format!("{key}.{k}"), v.clone())?;
            }
            return Ok(());
        }
    }
    let (last, tables) = parts.split_last().expect("keys are non-empty");
    let mut table: &mut dyn toml_edit::TableLike = doc.as_table_mut();
    for (i, part) in tables.iter().enumerate() {
        if table.get(part).is_none() {
            table.insert(part, toml_edit::Item::Table(toml_edit::Table::new()));
        }
        let item = table.get_mut(part).expect("just inserted");
        table = item
            .as_table_like_mut()
            .ok_or_else(|| format!("{} is a value, not a table", parts[..=i].join(".")))?;
    }
    table.insert(last, toml_edit::Item::Value(value));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edited_text_keeps_comments_sets_and_removes_nested_keys() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.toml");
        std::fs::write(
            &p,
            "# mine\n[train]\nbatch_size = 8 # small\n[model.mlp]\nhidden = [4]\ninputs = 2\n",
        )
        .unwrap();
        let out = edited_text(
            &p,
            &["train.lr=0.5".into()],
            &[
                ("train.batch_size", Some(toml_value("16"))),
                ("model.mlp.hidden", None),
                ("memory.fraction", None),
            ],
        )
        .unwrap();
        assert!(out.starts_with("# mine\n"), "{out}");
        assert!(out.contains("batch_size = 16"), "{out}");
        assert!(out.contains("lr = 0.5"), "{out}");
        assert!(!out.contains("hidden") && out.contains("inputs = 2"), "{out}");
        assert!(!out.contains("memory"), "removing an absent key adds nothing: {out}");
    }

    fn load_str(text: &str, sets: &[&str]) -> Result<Spec, String> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.toml");
        std::fs::write(&p, text).unwrap();
        let o: Vec<Override> = sets.iter().map(|s| Override::parse(s).unwrap()).collect();
        load(&p, &o)
            .map(|l| l.spec)
            .map_err(|e| e.to_string().replace(&p.display().to_string(), "x.toml"))
    }

    #[test]
    fn validation_errors_point_at_the_key() {
        let err = load_str(
            "[model]\npreset = \"mlp\"\n\n[train]\nepochs = 1\nbatch_size = 0\n",
            &[],
        )
        .unwrap_err();
        assert_eq!(err, "x.toml:6:1: train.batch_size must be at least 1, got 0");
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_line() {
        let err = load_str("[model]\npreset = \"mlp\"\n[train]\nbatchsize = 3\n", &[]).unwrap_err();
        assert!(err.starts_with("x.toml:4:1: unknown field `batchsize`"), "{err}");
    }

    #[test]
    fn overrides_are_typed_and_blamed() {
        let spec = load_str("[model]\npreset = \"mlp\"\n", &["train.batch_size=8", "job.device=cpu"]).unwrap();
        assert_eq!(spec.train.batch_size, 8);
        assert_eq!(spec.job.device, Device::Cpu);
        let err = load_str("[model]\npreset = \"mlp\"\n", &["train.batch_size=0"]).unwrap_err();
        assert_eq!(
            err,
            "--set train.batch_size=0: train.batch_size must be at least 1, got 0"
        );
    }

    #[test]
    fn an_inline_table_override_changes_keys_and_removes_none() {
        let text = "[model]\npreset = \"mlp\"\n[model.mlp]\nhidden = [64]\n[train]\nlr = 0.01\nepochs = 3\n";
        let spec = load_str(text, &["train={epochs=1}", "model.mlp={}"]).unwrap();
        assert_eq!((spec.train.epochs, spec.train.lr), (1, 0.01));
        assert_eq!(
            spec.model.options["mlp"]["hidden"],
            toml::Value::Array(vec![toml::Value::Integer(64)])
        );
        // Where there is no table yet, the inline table is the table.
        let spec = load_str("[model]\npreset = \"mlp\"\n", &["train={epochs=2, lr=0.5}"]).unwrap();
        assert_eq!((spec.train.epochs, spec.train.lr), (2, 0.5));
    }

    #[test]
    fn an_invalid_lr_is_one_error_not_two() {
        let err = load_str("[model]\npreset = \"mlp\"\n[train]\nlr = -0.1\n", &[]).unwrap_err();
        assert_eq!(err, "x.toml:4:1: train.lr must be a positive number, got -0.1");
    }

    #[test]
    fn type_errors_speak_toml() {
        let err = load_str("[model]\npreset = \"mlp\"\n[train]\nepochs = \"ten\"\n", &[]).unwrap_err();
        assert!(
            err.ends_with(
                "train.epochs: invalid type: string \"ten\", expected an integer (write numbers without quotes)"
            ),
            "{err}"
        );
        let err = load_str("train = 1\n[model]\npreset = \"mlp\"\n", &[]).unwrap_err();
        assert!(err.contains("expected a table"), "{err}");
        assert!(!err.contains("struct"), "{err}");
    }

    #[test]
    fn line_col_counts_from_one() {
        assert_eq!(line_col("ab\ncd", 4), (2, 2));
        assert_eq!(line_col("ab", 0), (1, 1));
    }
}
