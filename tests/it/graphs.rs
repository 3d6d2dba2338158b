//! `train.cuda_graph` on a machine without a GPU: the key is validated, "auto" and "on" resolve
//! to eager steps and say why (in the start record, the resolved spec and the terminal), and a
//! spec whose step cannot be captured is refused under "on" before anything is written. The
//! captured step itself runs in gpu-check's graph rows.
use crate::common::*;

fn job() -> Test {
    Test::new()
        .spec(digits_spec())
        .set("train.epochs", 1)
        .set("train.optimizer", "adam")
        .set("train.optimizer_impl", "fused")
}

#[test]
fn auto_on_the_cpu_runs_eager_says_why_and_trains_as_off_does() {
    let off = job().name("off").run();
    let auto = job().name("auto").set("train.cuda_graph", "auto").run();
    let start = &auto.starts()[0];
    let said = start
        .cuda_graph
        .as_deref()
        .expect("the start record says what was decided");
    assert!(said.starts_with("eager: ") && said.contains("CPU"), "{said}");
    let resolved = std::fs::read_to_string(auto.out.join("config.resolved.toml")).unwrap();
    let first = resolved.lines().next().unwrap();
    assert!(
        first.starts_with("# train.cuda_graph: eager") && first.contains("CPU"),
        "{first}"
    );
    assert!(resolved.contains("cuda_graph = \"auto\""), "{resolved}");
    let said = format!("{}{}", auto.stdout, auto.stderr);
    assert!(said.contains("CUDA graph: eager"), "{said}");
    assert_eq!(step_losses(&auto), step_losses(&off));
    assert_eq!(auto.final_bytes(), off.final_bytes());
    // "off" leaves the resolved spec as it was and prints nothing about graphs.
    let plain = std::fs::read_to_string(off.out.join("config.resolved.toml")).unwrap();
    let off_said = format!("{}{}", off.stdout, off.stderr);
    assert!(!plain.starts_with('#') && !off_said.contains("CUDA graph"), "{plain}");
}

#[test]
fn on_with_a_host_lever_is_refused_before_anything_is_written() {
    let t = job()
        .set("train.cuda_graph", "on")
        .set("memory.optimizer_state", "host")
        .exit(2)
        .stderr_has("train.cuda_graph")
        .stderr_has("memory.optimizer_state");
    let out = t.clone().run();
    assert!(
        out.stderr.contains("\"auto\""),
        "the error says what to set instead: {}",
        out.stderr
    );
    assert!(!out.out.exists(), "no run directory for a refused spec");
    // check refuses the same spec, for the same reason.
    t.name("check")
        .command("check")
        .exit(2)
        .stderr_has("memory.optimizer_state")
        .run();
}

#[test]
fn on_with_recomputation_or_an_explicit_foreach_is_refused_naming_it() {
    job()
        .set("train.cuda_graph", "on")
        .set("train.activation_checkpointing", true)
        .exit(2)
        .stderr_has("train.activation_checkpointing")
        .run();
    job()
        .name("foreach")
        .set("train.cuda_graph", "on")
        .set("train.optimizer_impl", "foreach")
        .exit(2)
        .stderr_has("\"fused\"")
        .run();
}

#[test]
fn on_on_the_cpu_says_it_has_no_effect_and_trains() {
    let out = job().set("train.cuda_graph", "on").run();
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(all.contains("no effect on the CPU"), "{all}");
    assert_eq!(out.summary().status, Status::Completed);
}

#[test]
fn an_unknown_value_is_a_clear_error() {
    job()
        .set("train.cuda_graph", "yes")
        .exit(2)
        .stderr_has("cuda_graph")
        .stderr_has("auto")
        .run();
}

#[test]
fn check_says_what_a_run_would_decide() {
    let cpu = job().set("train.cuda_graph", "auto").command("check").run();
    assert!(
        cpu.stdout.contains("CUDA graph       eager: the run is on the CPU"),
        "{}",
        cpu.stdout
    );
    let host = job()
        .name("host")
        .set("train.cuda_graph", "auto")
        .set("memory.optimizer_state", "host")
        .command("check")
        .run();
    assert!(
        host.stdout.contains("CUDA graph       eager: memory.optimizer_state"),
        "{}",
        host.stdout
    );
    let off = job().name("off").command("check").run();
    assert!(!off.stdout.contains("CUDA graph"), "{}", off.stdout);
}

/// `check` of a spec that captures on CUDA counts the graph's pool: validation's forward
/// allocates beside it, so under bf16-mixed its own bf16 copies of the weights (2410 of them:
/// 4.71 KiB) come on top of the static bill, and a cap that only the pool overflows is answered
/// with turning graphs off. No GPU is needed: check runs nothing.
#[test]
fn check_counts_the_graph_pool_of_a_captured_cuda_step() {
    let t = job()
        .set("job.device", "cuda")
        .set("train.precision", "bf16-mixed")
        .command("check");
    let eager = t.clone().name("eager").run();
    assert!(!eager.stdout.contains("graph pool"), "{}", eager.stdout);
    assert!(
        eager
            .stdout
            .contains("device static    37.66 KiB (+ activations, measured by the preflight step)\n"),
        "{}",
        eager.stdout
    );
    let auto = t.clone().set("train.cuda_graph", "auto");
    let captured = auto.clone().name("captured").run();
    assert!(
        captured.stdout.contains(
            "  graph pool        4.71 KiB  device: the captured step's working memory stays in the graph's pool"
        ),
        "{}",
        captured.stdout
    );
    assert!(
        captured.stdout.contains("device static    42.36 KiB (+ activations, measured by the preflight step; captured, the step's and validation's both)"),
        "{}",
        captured.stdout
    );
    let tight = auto.name("tight").set("memory.limit", "40KiB").run();
    assert!(tight.stdout.contains("WARNING: "), "{}", tight.stdout);
    assert!(
        tight.stdout.contains("to fit, set train.cuda_graph = \"off\""),
        "{}",
        tight.stdout
    );
}
