//! `memtrain report`, the report every run writes, TensorBoard's reading of memtrain's event
//! files, and the page in a real browser.
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

fn policy(p: &[&str]) -> toml::Value {
    toml::Value::Array(p.iter().map(|s| toml::Value::from(*s)).collect())
}

/// The digits job with an OOM at step 5 (inside the optimizer step), per-step records.
fn with_an_oom(t: Test) -> Test {
    t.set("log.every_steps", 1)
        .set("train.epochs", 2)
        .set("train.batch_size", 16)
        .set("train.accumulation_steps", 2)
        .set("memory.limit", "1GiB")
        .env("MEMTRAIN_FAULT_OOM_IN_OPTIMIZER_AT_STEP", "5")
}

/// The figure with this id: its inline SVG.
fn figure<'a>(html: &'a str, id: &str) -> &'a str {
    let start = html
        .find(&format!("<figure id=\"{id}\">"))
        .unwrap_or_else(|| panic!("no figure {id}"));
    let end = start + html[start..].find("</figure>").unwrap();
    &html[start..end]
}

/// The point counts of the polylines drawn in `color` (plotters writes one per series, and a
/// two-point one for its legend entry).
fn polyline_points(svg: &str, color: &str) -> Vec<usize> {
    svg.split("<polyline")
        .skip(1)
        .filter(|p| p.contains(&format!("stroke=\"{color}\"")))
        .map(|p| {
            let pts = p.split("points=\"").nth(1).unwrap().split('"').next().unwrap();
            pts.split_whitespace().count()
        })
        .collect()
}

/// The text elements of an SVG.
fn texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .map(|t| {
            t[t.find('>').unwrap() + 1..t.find("</text>").unwrap()]
                .trim()
                .to_owned()
        })
        .collect()
}

/// `memtrain report` of a run's directory.
fn report(r: &Outcome) -> Test {
    r.test
        .clone()
        .no_spec()
        .command("report")
        .args_replaced(&[r.out.to_str().unwrap()])
}

#[test]
fn every_run_writes_a_report_with_its_memory_events_and_curves() {
    let r = with_an_oom(Test::new())
        .set("memory.on_oom", policy(&["backoff", "fail"]))
        .stderr_has("backing off: micro-batch 16 -> 8")
        .run();
    assert!(r.stdout.contains("report: ") || r.stderr.contains("report: "));
    let html = std::fs::read_to_string(r.out.join("report.html")).unwrap();
    let steps = r.steps();
    assert_eq!(steps.len(), 2 * 45);

    // Memory: allocated (#1F77B4) and its peak (#9ECAE1) have a point for every step line; the
    // backoff is marked, and both epoch ends are drawn.
    let memory = figure(&html, "memory");
    assert!(
        polyline_points(memory, "#1F77B4").contains(&steps.len()),
        "{:?}",
        polyline_points(memory, "#1F77B4")
    );
    assert!(polyline_points(memory, "#9ECAE1").contains(&steps.len()));
    let labels = texts(memory);
    for l in ["allocated", "peak allocated", "backoff", "checkpoint"] {
        assert!(labels.iter().any(|t| t == l), "legend lacks {l}: {labels:?}");
    }
    assert!(
        labels[0].contains("(cap 1.00 GiB is far above)"),
        "the 1 GiB cap is noted, not drawn: {labels:?}"
    );
    let rss = figure(&html, "rss");
    assert!(polyline_points(rss, "#2CA02C").contains(&steps.len()));
    // Loss per step and per epoch, accuracy per epoch (train and validation), the lr.
    let loss = figure(&html, "loss");
    assert!(polyline_points(loss, "#9ECAE1").contains(&steps.len()));
    assert!(polyline_points(loss, "#1F77B4").contains(&2) && polyline_points(loss, "#E66E00").contains(&2));
    assert!(polyline_points(figure(&html, "accuracy"), "#E66E00").contains(&2));
    assert!(polyline_points(figure(&html, "lr"), "#756BB1").contains(&steps.len()));
    // The events table: the OOM and its decision at the step it happened, then the checkpoints.
    let oom = &r.ooms()[0];
    let row = format!("<tr><td>{}</td>", oom.step);
    let events = &html[html.find("<table id=\"events\">").unwrap()..];
    assert!(
        events.contains(&row) && events.contains("backoff from micro-batch 16 x 2 to 8 x 4"),
        "{events}"
    );
    assert_eq!(events.matches("epoch checkpoint").count(), 2);
    assert!(!html.contains("<script"), "no scripts");
    for fetch in ["src=", "href=", "<link", "@import", "url("] {
        assert!(!html.contains(fetch), "nothing is fetched, but the page has {fetch}");
    }

    // `memtrain report` redraws it and sums it up.
    let text = report(&r).run().stdout;
    assert!(text.contains("status completed"), "{text}");
    assert!(text.contains("OOM events: 1"), "{text}");
    assert!(text.contains("backoff from micro-batch 16 x 2 to 8 x 4"), "{text}");
    assert!(text.contains("cache clearing: 0 clears"), "{text}");
    assert!(
        text.contains("throughput: ") && text.contains("over 90 steps"),
        "{text}"
    );
}

#[test]
fn a_failed_run_has_its_report_and_a_snapshot_becomes_a_segment_map() {
    let r = with_an_oom(Test::new())
        .set("memory.on_oom", policy(&["fail"]))
        .exit(3)
        .run();
    assert_eq!(r.summary().status, Status::Oom);
    let html = std::fs::read_to_string(r.out.join("report.html")).unwrap();
    assert!(
        html.contains("OOM in optimizer step: failed at micro-batch 16 x 2"),
        "the failing OOM is listed"
    );
    assert!(!html.contains("id=\"segments\""), "the CPU has no allocator snapshot");

    // A snapshot that is not one costs the segment map, not the report.
    std::fs::write(r.out.join("oom/snapshot.pickle"), b"not a pickle").unwrap();
    let text = report(&r).run().stdout;
    assert!(
        text.contains("note: the allocator snapshot could not be drawn"),
        "{text}"
    );
    let html = std::fs::read_to_string(r.out.join("report.html")).unwrap();
    assert!(html.contains("The allocator snapshot could not be drawn") && html.contains("id=\"memory\""));

    // A snapshot as a CUDA run leaves it in oom/ (written by PyTorch's pickler format, see
    // reference.py): three segments, fragmented.
    reference(
        r.test.dir(),
        &["snapshot", "--out", r.out.join("oom/snapshot.pickle").to_str().unwrap()],
    );
    let text = report(&r).run().stdout;
    assert!(
        text.contains("allocator at the OOM: 3 segments, 42.00 MiB reserved, 28.50 MiB allocated, largest free block 4.00 MiB for a request of 6.00 MiB"),
        "{text}"
    );
    let html = std::fs::read_to_string(r.out.join("report.html")).unwrap();
    let seg = figure(&html, "segments");
    // One allocated rectangle per allocated block (5) and one free one per free block (5),
    // plus the outlines (3) and legend swatches (3).
    assert_eq!(seg.matches("fill=\"#1F77B4\"").count(), 5 + 1, "{seg}");
    assert_eq!(seg.matches("fill=\"#D2D2D2\"").count(), 5 + 1, "{seg}");
    assert_eq!(seg.matches("stroke=\"#5A5A5A\"").count(), 3, "{seg}");
    let rows: Vec<String> = texts(seg).into_iter().filter(|t| t.contains("largest free")).collect();
    assert_eq!(
        rows,
        [
            "20.00 MiB (large), largest free 4.00 MiB &lt; request",
            "20.00 MiB (large), largest free 3.00 MiB &lt; request",
            "2.00 MiB (small), largest free 1.50 MiB &lt; request"
        ]
    );
    let bars = figure(&html, "request");
    let labels = texts(bars);
    for l in [
        "failed request: 6.00 MiB",
        "largest free block: 4.00 MiB",
        "all free cached memory: 13.50 MiB",
    ] {
        assert!(labels.iter().any(|t| t == l), "{labels:?}");
    }

    // Not a run directory: a clear error, nothing written.
    let nothing = Test::new().no_spec().command("report");
    let empty = nothing.dir().to_path_buf();
    nothing
        .arg(empty.to_str().unwrap())
        .exit(2)
        .stderr_has("has no readable metrics.jsonl")
        .run();
    assert!(!empty.join("report.html").exists());
    // A run directory whose records never came: said, nothing written.
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(empty.join("metrics.jsonl"), "{\"type\":\"sta").unwrap();
    Test::new()
        .no_spec()
        .command("report")
        .arg(empty.to_str().unwrap())
        .exit(2)
        .stderr_has("metrics.jsonl holds no records (1 unreadable line(s)): the run stopped before it wrote any")
        .run();
    assert!(!empty.join("report.html").exists());
}

#[test]
fn tensorboard_reads_the_scalars_memtrain_wrote() {
    let r = Test::new().set("log.tensorboard", true).set("train.epochs", 2).run();
    let tb = r.out.join("tensorboard");
    let files: Vec<_> = std::fs::read_dir(&tb).unwrap().collect();
    assert_eq!(files.len(), 1);
    // What TensorBoard read, as reference.py prints it: {tag: [[step, value], ...]}, JSON from
    // Python, not memtrain's records.
    let seen: serde_json::Value =
        serde_json::from_str(&reference(r.test.dir(), &["tensorboard", tb.to_str().unwrap()])).unwrap();
    let steps = r.steps();
    let series = |tag: &str| -> Vec<(i64, f32)> {
        seen[tag]
            .as_array()
            .unwrap_or_else(|| panic!("TensorBoard has no {tag}: {seen}"))
            .iter()
            .map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap() as f32))
            .collect()
    };
    // TensorBoard keeps float32; compare there (JSON's decimal round trip may differ below it).
    let expect = |key: &dyn Fn(&StepEvent) -> f64| -> Vec<(i64, f32)> {
        steps.iter().map(|s| (s.step, key(s) as f32)).collect()
    };
    let bytes = |b: Option<u64>| b.expect("the CPU's allocated bytes are counted") as f64;
    assert_eq!(series("train/loss"), expect(&|s| s.loss));
    assert_eq!(series("train/lr"), expect(&|s| s.lr));
    assert_eq!(
        series("memory/allocated_bytes"),
        expect(&|s| bytes(s.memory.allocated_bytes))
    );
    assert_eq!(
        series("memory/peak_allocated_bytes"),
        expect(&|s| bytes(s.memory.peak_allocated_bytes))
    );
    assert_eq!(series("memory/rss_bytes"), expect(&|s| s.memory.rss_bytes as f64));
    assert_eq!(series("train/samples_per_s"), expect(&|s| s.samples_per_s));
    let epochs = r.epochs();
    let val: Vec<(i64, f32)> = epochs
        .iter()
        .map(|e| (e.step, e.val_acc.expect("a validation accuracy") as f32))
        .collect();
    assert_eq!(series("epoch/val_acc"), val);
    assert_eq!(val.iter().map(|v| v.0).collect::<Vec<_>>(), [45, 90]);
    assert!(
        seen.get("memory/reserved_bytes").is_none(),
        "no reserved memory on the CPU"
    );

    // A resumed run adds its own file beside the first; TensorBoard reads both.
    let more = r.resume().set("train.epochs", 3).run();
    assert_eq!(std::fs::read_dir(&tb).unwrap().count(), 2);
    let seen: serde_json::Value =
        serde_json::from_str(&reference(more.test.dir(), &["tensorboard", tb.to_str().unwrap()])).unwrap();
    assert_eq!(seen["train/loss"].as_array().unwrap().len(), 3 * 45);
}

/// The browser: Debian's Chromium (scripts/bootstrap-browser installs it; MEMTRAIN_CHROMIUM).
fn chromium() -> PathBuf {
    let c = std::env::var("MEMTRAIN_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&c).exists(),
        "no Chromium at {c}: run the tests through scripts/test, or scripts/bootstrap-browser first"
    );
    PathBuf::from(c)
}

fn headless(profile: &Path) -> Command {
    let mut c = Command::new(chromium());
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--enable-logging=stderr",
        "--v=0",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    c
}

#[test]
fn the_report_opens_in_a_real_browser() {
    let r = with_an_oom(Test::new())
        .set("memory.on_oom", policy(&["backoff", "fail"]))
        .run();
    reference(
        r.test.dir(),
        &["snapshot", "--out", r.out.join("oom/snapshot.pickle").to_str().unwrap()],
    );
    report(&r).run();
    // The page alone, away from the run directory, so that nothing it names could be found
    // there; in the test's own directory, which a failing test keeps for people to look at.
    let dir = r.test.dir().join("page");
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("report.html");
    std::fs::copy(r.out.join("report.html"), &page).unwrap();
    let url = format!("file://{}", page.display());

    let o = headless(&dir.join("profile-dom"))
        .arg("--dump-dom")
        .arg(&url)
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&o.stdout);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "chromium failed:\n{log}");
    // Every figure's SVG made it into the document the browser built.
    for id in [
        "memory",
        "rss",
        "loss",
        "accuracy",
        "lr",
        "throughput",
        "request",
        "segments",
    ] {
        let at = dom
            .find(&format!("<figure id=\"{id}\">"))
            .unwrap_or_else(|| panic!("no {id} in the DOM"));
        assert!(
            dom[at..]
                .trim_start_matches(&format!("<figure id=\"{id}\">"))
                .starts_with("<svg"),
            "{id}"
        );
    }
    assert_eq!(dom.matches("<svg").count(), 8);
    // Nothing the page names is missing (a broken reference would be logged here).
    assert!(
        !log.contains("Failed to load resource") && !log.contains("ERR_FILE_NOT_FOUND"),
        "{log}"
    );

    let shot = dir.join("report.png");
    let o = headless(&dir.join("profile-shot"))
        .arg("--window-size=1050,2600")
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let png = std::fs::read(&shot).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    assert!(
        png.len() > 50_000,
        "a page of charts, not a blank one: {} bytes",
        png.len()
    );
}
