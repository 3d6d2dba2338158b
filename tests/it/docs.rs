//! The documentation kept true: every spec key memtrain accepts is in docs/spec.md and every key
//! documented there is accepted; every command and flag clap knows is in docs/commands.md; every
//! exit code is in both exit-code tables; every shipped config passes `memtrain check` and is in
//! the README's table; every relative link resolves; the README stays short and gives the two
//! commands; no product text speaks of how the project was made.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use clap::CommandFactory;

use crate::common::{repo, Test};

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// The Markdown files the project ships as documentation.
fn doc_files() -> Vec<String> {
    let mut files: Vec<String> = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md"]
        .map(String::from)
        .to_vec();
    let mut pages: Vec<String> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.expect("a docs/ entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    pages.sort();
    files.extend(pages);
    files
}

/// The lines of a Markdown text outside fenced code blocks, with their 1-based numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = vec![];
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// A heading's anchor as a code host makes it: lower case, punctuation other than `-` and `_`
/// dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor of a Markdown file; a repeated heading gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        let Some(rest) = line.trim_start_matches('#').strip_prefix(' ') else {
            continue;
        };
        if !line.starts_with('#') {
            continue;
        }
        let s = slug(rest);
        let n = seen.entry(s.clone()).or_insert(0);
        out.insert(if *n == 0 { s.clone() } else { format!("{s}-{n}") });
        *n += 1;
    }
    out
}

/// The sections of a Markdown text: (heading, body) for every heading of `level` (`##`); a body
/// holds its deeper headings and its code blocks too.
fn sections(text: &str, level: usize) -> Vec<(String, String)> {
    let marker = format!("{} ", "#".repeat(level));
    let mut fenced = false;
    let mut out: Vec<(String, String)> = vec![];
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        match line.strip_prefix(&marker) {
            Some(h) if !fenced => out.push((h.to_owned(), String::new())),
            _ => {
                if let Some((_, body)) = out.last_mut() {
                    body.push_str(line);
                    body.push('\n');
                }
            }
        }
    }
    out
}

/// The names in backticks in `text`.
fn backticked(text: &str) -> Vec<String> {
    text.split('`').skip(1).step_by(2).map(str::to_owned).collect()
}

/// The keys documented in docs/spec.md: for each heading that names tables (`[train]`, or the
/// three ResNets at once), the names in the first cell of every row of each table whose header
/// begins `| key |`, as full dotted keys.
fn documented_keys() -> BTreeSet<String> {
    let text = read("docs/spec.md");
    let mut tables: Vec<String> = vec![];
    let mut in_key_table = false;
    let mut keys = BTreeSet::new();
    for (_, line) in prose(&text) {
        if line.starts_with('#') {
            tables = backticked(line)
                .into_iter()
                .filter_map(|t| t.strip_prefix('[').and_then(|t| t.strip_suffix(']')).map(str::to_owned))
                .collect();
            in_key_table = false;
            continue;
        }
        if !line.starts_with('|') {
            in_key_table = false;
            continue;
        }
        let first = line.trim_matches('|').split('|').next().unwrap_or_default().trim();
        if first == "key" {
            in_key_table = true;
            continue;
        }
        if !in_key_table || first.starts_with("---") {
            continue;
        }
        let names = backticked(first);
        assert!(!names.is_empty(), "docs/spec.md: a key row without a `key`: {line}");
        assert!(
            !tables.is_empty(),
            "docs/spec.md: keys {names:?} under a heading that names no [table]"
        );
        for t in &tables {
            for key in &names {
                keys.insert(format!("{t}.{key}"));
            }
        }
    }
    keys
}

/// Loads `spec` with `--set key=1` and returns the names the schema lists as expected when `key`
/// is unknown; None when it is not an unknown-key error (`key`'s parent is not a table).
fn expected_beside(dir: &Path, spec: &str, key: &str) -> Option<Vec<String>> {
    let path = dir.join("probe.toml");
    std::fs::write(&path, spec).expect("writing the probe spec");
    let sets = [format!("{key}=1")];
    let err = match memtrain::spec::load_args(&path, &sets, &memtrain::model::validate) {
        Ok(_) => panic!("--set {key}=1 was accepted: the probe key must be unknown"),
        Err(e) => e.problems.join("\n"),
    };
    let unknown = err.contains("unknown field `") || err.contains("is not an option of the");
    if !unknown {
        return None;
    }
    let listed = err.split_once("expected").map(|(_, l)| l).unwrap_or_default();
    let listed = listed.split(" (in [").next().unwrap_or_default();
    Some(backticked(listed))
}

const PROBE: &str = "zz_not_a_key";

/// Every key the schema accepts, found the way a user finds them: an unknown key in a table is
/// an error that lists the table's keys; a key whose own unknown key is such an error is a table.
fn schema_keys(dir: &Path) -> BTreeSet<String> {
    let minimal = "[model]\npreset = \"mlp\"\n";
    let mut keys = BTreeSet::new();
    let mut tables: Vec<(String, String)> = vec![];
    let top = expected_beside(dir, minimal, PROBE).expect("an unknown top-level key is an error");
    for t in top {
        if t == "model" {
            continue;
        }
        tables.push((minimal.to_owned(), t));
    }
    for preset in memtrain::model::names() {
        tables.push((format!("[model]\npreset = \"{preset}\"\n"), format!("model.{preset}")));
    }
    tables.push(("[model]\npreset = \"vit\"\n".to_owned(), "model.lora".to_owned()));
    keys.insert("model.preset".to_owned());
    keys.insert("model.init_from".to_owned());
    // Beside the preset's table in [model], so an unknown key there does not list them either.
    keys.insert("model.init_format".to_owned());
    keys.insert("model.init_skip".to_owned());
    while let Some((spec, table)) = tables.pop() {
        let listed = expected_beside(dir, &spec, &format!("{table}.{PROBE}"))
            .unwrap_or_else(|| panic!("[{table}] did not answer an unknown key with its keys"));
        assert!(!listed.is_empty(), "[{table}] lists no keys");
        for k in listed {
            let full = format!("{table}.{k}");
            if expected_beside(dir, &spec, &format!("{full}.{PROBE}")).is_some() {
                tables.push((spec.clone(), full));
            } else {
                keys.insert(full);
            }
        }
    }
    keys
}

#[test]
fn spec_reference_lists_every_key_and_only_keys_that_exist() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let schema = schema_keys(dir.path());
    let documented = documented_keys();
    // Sanity: the probe found the nested tables and the presets' options.
    for k in [
        "memory.allocator.expandable_segments",
        "data.augment.horizontal_flip",
        "model.vit.patch_size",
    ] {
        assert!(schema.contains(k), "the schema probe missed {k}: {schema:?}");
    }
    let undocumented: Vec<_> = schema.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&schema).collect();
    assert!(
        undocumented.is_empty(),
        "spec keys memtrain accepts that docs/spec.md does not document: {undocumented:?}"
    );
    assert!(
        unknown.is_empty(),
        "keys docs/spec.md documents that memtrain rejects: {unknown:?}"
    );
}

#[test]
fn commands_page_lists_every_subcommand_and_flag() {
    let text = read("docs/commands.md");
    let sections = sections(&text, 2);
    let cli = memtrain::cli::Cli::command();
    for arg in cli.get_arguments() {
        if let Some(long) = arg.get_long() {
            assert!(
                text.contains(&format!("`--{long}`")),
                "docs/commands.md lacks the global flag --{long}"
            );
        }
        if let Some(short) = arg.get_short() {
            assert!(
                text.contains(&format!("`-{short}`")),
                "docs/commands.md lacks the global flag -{short}"
            );
        }
    }
    let mut names = vec![];
    for sub in cli.get_subcommands() {
        let name = sub.get_name();
        if name == "help" {
            continue;
        }
        names.push(name.to_owned());
        let Some((_, body)) = sections.iter().find(|(h, _)| h == &format!("`memtrain {name}`")) else {
            panic!("docs/commands.md has no section \"## `memtrain {name}`\"");
        };
        assert!(
            text.contains(&format!("memtrain [-q | -v...] {name} ")),
            "the synopsis in docs/commands.md lacks `{name}`"
        );
        let contents = text.split("## Synopsis").next().unwrap_or_default();
        assert!(
            contents.contains(&format!("[`memtrain {name}`](#memtrain-{name})")),
            "the contents at the top of docs/commands.md lack `memtrain {name}`"
        );
        for arg in sub.get_arguments() {
            if let Some(long) = arg.get_long() {
                if long == "help" {
                    continue;
                }
                assert!(
                    body.contains(&format!("--{long}")),
                    "docs/commands.md's section on `memtrain {name}` does not mention --{long}"
                );
            }
        }
    }
    // And no section for a command that does not exist.
    for (h, _) in &sections {
        if let Some(cmd) = h.strip_prefix("`memtrain ").and_then(|c| c.strip_suffix('`')) {
            assert!(
                names.iter().any(|n| n == cmd),
                "docs/commands.md documents `memtrain {cmd}`, which clap does not know"
            );
        }
    }
}

/// The codes `src/exit.rs` defines (`pub const NAME: i32 = N;`).
fn exit_codes() -> BTreeSet<i32> {
    read("src/exit.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("pub const "))
        .filter_map(|l| l.split_once(": i32 = "))
        .map(|(_, n)| {
            n.trim_end_matches(';')
                .trim()
                .parse()
                .expect("an exit code is a number")
        })
        .collect()
}

/// The first column of the table under the `## Exit codes` heading.
fn documented_exit_codes(rel: &str) -> BTreeSet<i32> {
    let text = read(rel);
    let Some((_, body)) = sections(&text, 2).into_iter().find(|(h, _)| h == "Exit codes") else {
        panic!("{rel} has no \"## Exit codes\" section");
    };
    body.lines()
        .filter(|l| l.starts_with('|'))
        .filter_map(|l| l.trim_matches('|').split('|').next().map(|c| c.trim().to_owned()))
        .filter_map(|c| c.parse().ok())
        .collect()
}

#[test]
fn every_exit_code_is_documented() {
    let codes = exit_codes();
    assert!(codes.len() >= 5, "src/exit.rs read as {codes:?}");
    for rel in ["README.md", "docs/commands.md"] {
        assert_eq!(
            documented_exit_codes(rel),
            codes,
            "{rel}'s exit-code table against src/exit.rs"
        );
    }
}

#[test]
fn every_relative_link_resolves() {
    let mut bad = vec![];
    for file in doc_files() {
        let text = read(&file);
        let base = Path::new(&file).parent().map(Path::to_path_buf).unwrap_or_default();
        for (n, line) in prose(&text) {
            for part in line.split("](").skip(1) {
                let target = part.split(')').next().unwrap_or_default();
                if target.contains("://") || target.starts_with("mailto:") || target.contains(' ') {
                    continue;
                }
                let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
                let resolved: PathBuf = if path.is_empty() {
                    PathBuf::from(&file)
                } else {
                    base.join(path)
                };
                let full = repo().join(&resolved);
                if !full.exists() {
                    bad.push(format!("{file}:{n}: {target}: no file {}", resolved.display()));
                    continue;
                }
                if !anchor.is_empty() && full.extension().is_some_and(|e| e == "md") {
                    let there = std::fs::read_to_string(&full).expect("a linked Markdown file reads");
                    if !anchors(&there).contains(anchor) {
                        bad.push(format!("{file}:{n}: {target}: no heading #{anchor}"));
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "links that do not resolve:\n{}", bad.join("\n"));
}

/// Every `docs/PAGE.md#anchor` the source names (help texts, error messages) exists.
#[test]
fn docs_pages_the_code_names_exist() {
    let mut named = vec![];
    let mut stack = vec![repo().join("src")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("src/ reads") {
            let p = e.expect("an entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&p).expect("a source file reads");
                for part in text.split("docs/").skip(1) {
                    let r: String = part
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || "-_.#".contains(*c))
                        .collect();
                    let r = r.trim_end_matches('.');
                    if r.contains(".md") {
                        named.push((p.clone(), r.to_owned()));
                    }
                }
            }
        }
    }
    assert!(
        named.iter().any(|(_, r)| r.starts_with("spec.md")),
        "no source names docs/spec.md"
    );
    for (src, r) in named {
        let (page, anchor) = r.split_once('#').unwrap_or((&r, ""));
        let text = std::fs::read_to_string(repo().join("docs").join(page))
            .unwrap_or_else(|e| panic!("{} names docs/{page}: {e}", src.display()));
        assert!(
            anchor.is_empty() || anchors(&text).contains(anchor),
            "{} names docs/{r}, which has no such heading",
            src.display()
        );
    }
}

#[test]
fn help_and_spec_errors_name_the_docs_not_the_readme() {
    let mut cli = memtrain::cli::Cli::command();
    let mut helps = vec![cli.render_long_help().to_string()];
    for sub in cli.get_subcommands_mut() {
        helps.push(sub.render_long_help().to_string());
    }
    for h in &helps {
        assert!(!h.contains("README"), "--help points at the README:\n{h}");
    }
    assert!(
        helps.iter().any(|h| h.contains("docs/outputs.md")),
        "no --help names docs/outputs.md"
    );
    let r = Test::new()
        .command("check")
        .args(&["--set", "train.nope=1"])
        .exit(2)
        .run();
    assert!(r.stderr.contains("docs/spec.md"), "{}", r.stderr);
    assert!(!r.stderr.contains("README"), "{}", r.stderr);
}

#[test]
fn readme_is_short_and_gives_the_two_commands_first() {
    let readme = read("README.md");
    assert!(
        readme.len() <= 15_000,
        "README.md is {} bytes; keep it at most 15,000",
        readme.len()
    );
    let head: Vec<&str> = readme.lines().take(60).collect();
    assert!(
        head.contains(&"scripts/memtrain run configs/darts_4gb.toml"),
        "the main job's command is not in the README's first 60 lines"
    );
    // CI runs the test command through .ci/run: the README's must be the same line.
    let ci = read(".ci/run");
    let test_command = ci
        .lines()
        .find_map(|l| l.strip_prefix("exec "))
        .expect(".ci/run execs the test command");
    assert!(
        head.contains(&test_command),
        "the README's first 60 lines lack the test command `{test_command}`"
    );
    assert!(repo().join("LICENSE").exists(), "LICENSE is missing");
    assert!(read("LICENSE").starts_with("MIT License"), "Cargo.toml says MIT");
}

#[test]
fn product_text_says_nothing_of_how_the_project_was_made() {
    let mut files = doc_files();
    files.retain(|f| f != "CHANGELOG.md");
    for e in std::fs::read_dir(repo().join("configs")).expect("configs/ reads") {
        files.push(format!(
            "configs/{}",
            e.expect("an entry").file_name().to_string_lossy()
        ));
    }
    let words = ["worktree", "helper", "engineers'", "seed 00"];
    for f in files {
        let text = read(&f).to_lowercase();
        for w in words {
            assert!(!text.contains(w), "{f} mentions \"{w}\"");
        }
        let issue = text
            .match_indices("issue ")
            .any(|(i, m)| text[i + m.len()..].starts_with(|c: char| c.is_ascii_digit()));
        assert!(!issue, "{f} names an issue number");
        // Another project's tracker, as in "transformers#32215".
        let tracker = text
            .as_bytes()
            .windows(5)
            .any(|w| w[0].is_ascii_alphabetic() && w[1] == b'#' && w[2..].iter().all(u8::is_ascii_digit));
        assert!(!tracker, "{f} names an issue of another project");
    }
}

#[test]
fn every_shipped_config_checks_and_is_in_the_readme() {
    let readme = read("README.md");
    let mut configs: Vec<String> = std::fs::read_dir(repo().join("configs"))
        .expect("configs/ reads")
        .map(|e| e.expect("an entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".toml"))
        .collect();
    configs.sort();
    assert!(configs.len() >= 5, "{configs:?}");
    for name in configs {
        let rel = format!("configs/{name}");
        assert!(
            readme.contains(&format!("| `{rel}` |")),
            "the README's config table lacks {rel}"
        );
        let text = read(&rel);
        assert!(
            text.starts_with("# "),
            "{rel} does not open with a comment saying what it shows"
        );
        Test::new().command("check").no_spec().arg(&rel).run();
    }
}

/// The run shown in docs/commands.md prints what the docs show, line for line: the start lines,
/// the preflight's figure and the epochs' losses and tensor bytes (deterministic on a CPU). Only
/// the times, speeds and RSS vary by machine.
#[test]
fn the_documented_run_prints_what_the_docs_show() {
    let text = read("docs/commands.md");
    let start = text
        .find("$ memtrain run configs/digits_mlp.toml --out /tmp/dm\n")
        .expect("the example run is in docs/commands.md");
    let shown: Vec<&str> = text[start..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .filter(|l| l.trim() != "...")
        .collect();
    assert!(shown.iter().any(|l| l.starts_with("Preflight:")), "{shown:?}");
    let t = Test::new().no_spec();
    let out = t.dir().join("dm").display().to_string();
    let r = t.args(&["configs/digits_mlp.toml", "--out", &out]).run();
    let printed = r.stderr.replace(&out, "/tmp/dm");
    let printed: Vec<String> = printed.lines().map(machine_free).collect();
    for line in shown {
        assert!(
            printed.contains(&machine_free(line)),
            "the docs show\n{line}\nthe run printed\n{}",
            printed.join("\n")
        );
    }
}

/// An epoch line with what varies by machine (its time, its speed, the RSS) as `N`, and without
/// the note a busy machine adds when the steps waited for their batches.
fn machine_free(line: &str) -> String {
    let line = line.split_once("  data wait ").map_or(line, |(l, _)| l);
    let words: Vec<&str> = line.split(' ').collect();
    let varies = |i: usize| {
        matches!(words.get(i + 1), Some(&"ms") | Some(&"samples/s") | Some(&"s")) || (i > 0 && words[i - 1] == "RSS")
    };
    // A loaded machine takes 1.2 s for an epoch the docs show at 75 ms: the unit varies too.
    let kept: Vec<&str> = (0..words.len())
        .map(|i| match words[i] {
            _ if varies(i) => "N",
            "ms" if i > 0 && varies(i - 1) => "s",
            w => w,
        })
        .collect();
    kept.join(" ")
}

/// The files behind the spec errors docs/commands.md quotes, by the name it shows them under.
const QUOTED_SPECS: [(&str, &str); 5] = [
    (
        "bad2.toml",
        "[model]\npreset = \"mlp\"\n[train]\nlr = -1\nepochs = 0\nbatch_size = 3000000000\n",
    ),
    ("bad.toml", "[model]\npreset = \"mlp\"\n[train]\nbatchsize = 8\n"),
    ("type.toml", "[model]\npreset = \"mlp\"\n[train]\nepochs = \"x\"\n"),
    ("inv.toml", "[model]\npreset = \"mlp\"\n[train\nepochs = 1\n"),
    ("nomodel.toml", "[train]\nepochs = 1\n"),
];

/// Every error line docs/commands.md quotes under "Error messages" is what `memtrain check`
/// prints for it: the `/tmp/NAME.toml` lines for the files above, the `--set` lines for those
/// overrides of a shipped config.
#[test]
fn the_documented_spec_errors_are_what_the_binary_prints() {
    let text = read("docs/commands.md");
    let section = sections(&text, 2)
        .into_iter()
        .find(|(h, _)| h == "Error messages")
        .expect("an Error messages section")
        .1;
    let quoted: Vec<&str> = section
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("/tmp/") || l.starts_with("--set "))
        .collect();
    assert!(quoted.len() >= 10, "{quoted:?}");
    for line in quoted {
        let printed = if let Some(set) = line.strip_prefix("--set ") {
            let (arg, _) = set.split_once(": ").expect("--set KEY=VALUE: MESSAGE");
            Test::new()
                .command("check")
                .no_spec()
                .args(&["configs/digits_mlp.toml", "--set", arg])
                .exit(2)
                .run()
                .stderr
        } else {
            let name = &line["/tmp/".len()..line.find(':').expect("FILE: MESSAGE")];
            let (_, spec) = QUOTED_SPECS
                .iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("no file behind {name} in QUOTED_SPECS"));
            let t = Test::new().command("check").no_spec();
            let path = t.dir().join(name);
            std::fs::write(&path, spec).unwrap();
            let dir = format!("{}/", t.dir().display());
            t.arg(path.to_str().unwrap())
                .exit(2)
                .run()
                .stderr
                .replace(&dir, "/tmp/")
        };
        assert!(
            printed.lines().any(|l| abridged_as(l, line)),
            "docs/commands.md quotes\n{line}\ncheck printed\n{printed}"
        );
    }
}

/// Whether `quoted` is `printed`, or `printed` with a stretch cut to `...`.
fn abridged_as(printed: &str, quoted: &str) -> bool {
    match quoted.split_once("...") {
        Some((head, tail)) => printed.len() > quoted.len() && printed.starts_with(head) && printed.ends_with(tail),
        None => printed == quoted,
    }
}

/// The guide's backoff example: its spec, run as shown, prints the lines shown.
#[test]
fn the_guides_backoff_example_prints_what_it_shows() {
    let text = read("docs/guide.md");
    let start = text
        .find("Save this spec as `wide.toml`")
        .expect("the backoff example is in the guide");
    let blocks: Vec<&str> = text[start..].split("```").collect();
    let spec = blocks[1].strip_prefix("toml\n").expect("the spec comes first, as TOML");
    let shown: Vec<&str> = blocks[3].lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(shown.len(), 3, "{shown:?}");
    let t = Test::new().no_spec();
    let path = t.dir().join("wide.toml");
    std::fs::write(&path, spec).unwrap();
    let out = t.dir().join("runs").display().to_string();
    let r = t.args(&[path.to_str().unwrap(), "--out", &out]).run();
    for line in shown {
        assert!(
            r.stderr.lines().any(|l| l == line),
            "the guide shows\n{line}\nthe run printed\n{}",
            r.stderr
        );
    }
    let preflight = text
        .lines()
        .find(|l| l.starts_with("Preflight: the first step at micro-batch 16"));
    assert!(
        r.stderr.lines().any(|l| Some(l) == preflight),
        "the Preflight section's line: {preflight:?}"
    );
}

/// Every line of the `check` example in docs/commands.md, but the `...` that mark cuts, is a line
/// the binary prints for that spec today.
#[test]
fn the_documented_check_prints_what_the_docs_show() {
    let text = read("docs/commands.md");
    let start = text
        .find("$ memtrain check configs/darts_4gb.toml\n")
        .expect("the check example is in docs/commands.md");
    let shown: Vec<&str> = text[start..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .filter(|l| l.trim() != "...")
        .collect();
    assert!(shown.len() > 20, "{shown:?}");
    let r = Test::new()
        .command("check")
        .no_spec()
        .arg("configs/darts_4gb.toml")
        .run();
    let printed = format!("{}\n{}", r.stdout, r.stderr);
    // The loader's thread count follows the machine's cores.
    let threads = |l: &str| match l.find(" thread(s)") {
        Some(i) => format!("{}N{}", &l[..l[..i].rfind(' ').map_or(0, |j| j + 1)], &l[i..]),
        None => l.to_owned(),
    };
    for line in shown {
        assert!(
            printed.lines().any(|l| threads(l) == threads(line)),
            "docs/commands.md shows {line:?}; check printed:\n{printed}"
        );
    }
}

/// The `fit` example in docs/commands.md has the columns fit prints today: a probe line's
/// setting columns and the recommendation's opening are what a run of fit prints for the same
/// setting (on the digits MLP, which probes in seconds).
#[test]
fn the_documented_fit_prints_what_the_docs_show() {
    let text = read("docs/commands.md");
    let start = text
        .find("$ memtrain fit configs/resnet18_accumulation.toml")
        .expect("the fit example is in docs/commands.md");
    let shown: Vec<&str> = text[start..].lines().take_while(|l| !l.starts_with("```")).collect();
    let probe = shown
        .iter()
        .find(|l| l.starts_with("probe  fp32        checkpointing off"))
        .expect("an fp32 probe line");
    let columns = &probe[..probe.find("micro-batch").expect("a micro-batch column") + "micro-batch".len()];
    let r = Test::new()
        .command("fit")
        .no_spec()
        .args(&[
            "configs/digits_mlp.toml",
            "--limit",
            "64MiB",
            "--steps",
            "2",
            "--precision",
            "fp32",
            "--checkpointing",
            "off",
        ])
        .run();
    assert!(
        r.stderr.lines().any(|l| l.starts_with(columns)),
        "the docs show probe lines as {columns:?}; fit printed:\n{}",
        r.stderr
    );
    for opening in [
        "recommendation: precision ",
        "  measured peak ",
        "  run it with: memtrain run ",
    ] {
        let shown_line = shown
            .iter()
            .find(|l| l.starts_with(opening))
            .unwrap_or_else(|| panic!("the example lacks {opening:?}"));
        let cut = shown_line.find(": batch_size").unwrap_or(opening.len());
        let printed = format!("{}{}", r.stdout, r.stderr);
        let want = if opening.starts_with("recommendation") {
            shown_line[..cut].replace("bf16-mixed", "fp32")
        } else {
            opening.to_string()
        };
        assert!(
            printed.lines().any(|l| l.starts_with(&want)),
            "the docs show {want:?}; fit printed:\n{printed}"
        );
    }
}
