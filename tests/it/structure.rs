//! The shape of the source, as CONTRIBUTING.md and `src/lib.rs` describe it: modules import in
//! one direction, no file is over 800 lines and no function over 100, and the commands that
//! read a run's records or describe its levers (`report`, `fit`, `check`) do not reach into the
//! room that runs the loop.
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn script(name: &str, args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(root().join("scripts").join(name))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("running scripts/{name}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "scripts/{name} failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn modules_import_in_one_direction() {
    let graph = script("module-graph", &["src"]);
    assert!(
        graph.contains("strongly connected groups (any circle): 0"),
        "src/ has import circles; lib.rs's layers say there are none:\n{graph}"
    );
}

#[test]
fn no_file_over_800_lines_and_no_function_over_100() {
    let mut files = vec![];
    rust_files(&root().join("src"), &mut files);
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).unwrap().lines().count();
            (n > 800).then(|| format!("{} ({n} lines)", f.strip_prefix(root()).unwrap().display()))
        })
        .collect();
    assert!(long.is_empty(), "files over 800 lines: {long:?}");
    let lengths = script("function-lengths", &["3"]);
    assert!(lengths.contains("\n0 function(s) over 100 lines"), "{lengths}");
}

#[test]
fn report_fit_and_check_do_not_reach_into_the_run() {
    let mut files = vec![];
    for dir in ["src/report", "src/fit"] {
        rust_files(&root().join(dir), &mut files);
    }
    files.push(root().join("src/estimate.rs"));
    files.push(root().join("src/policy/levers/mod.rs"));
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(
            !text.contains("crate::run"),
            "{} imports from run; what it needs belongs below the run (policy, records)",
            f.display()
        );
    }
}
