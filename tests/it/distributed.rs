//! Data-parallel training on c10d with Gloo: `run --nproc 2` on the CPU, against one process.
use std::path::Path;

use crate::common::*;

/// A job whose 2-rank run takes each micro-batch of a 1-rank run on one rank: accumulation 2.
/// (A group too small to split at micro-batch boundaries, such as an epoch's short last one, is
/// split in slices: the same gradient, summed in another order.)
fn mlp() -> Test {
    Test::new()
        .set("train.epochs", 2)
        .set("train.batch_size", 64)
        .set("train.accumulation_steps", 2)
        .set("train.grad_clip_norm", 1.0)
}

fn darts() -> Test {
    Test::darts()
        .set("data.samples", 64)
        .set("data.val_fraction", 0.25)
        .set("train.batch_size", 8)
        .set("train.accumulation_steps", 2)
        .set("train.lr", 0.025)
        .set("train.grad_clip_norm", 5.0)
        .set("log.progress", "off")
}

fn assert_close_losses(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "step counts differ");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-6 * x.abs().max(1e-12), "step {}: {x} vs {y}", i + 1);
    }
}

/// Largest difference between the parameters of two model files, relative to the largest.
/// BatchNorm running statistics are left out: with data-parallel training they are rank 0's, from
/// rank 0's micro-batches only, as with DDP.
fn weight_gap(a: &Path, b: &Path) -> f64 {
    let params = |p: &Path| -> Vec<(String, tch::Tensor)> {
        tensors(p)
            .into_iter()
            .filter(|(n, _)| !n.contains("running_"))
            .collect()
    };
    let (ta, tb) = (params(a), params(b));
    assert_eq!(ta.len(), tb.len());
    let mut gap: f64 = 0.0;
    let mut scale: f64 = 0.0;
    for ((na, x), (nb, y)) in ta.iter().zip(&tb) {
        assert_eq!(na, nb);
        gap = gap.max((x - y).abs().max().double_value(&[]));
        scale = scale.max(x.abs().max().double_value(&[]));
    }
    gap / scale
}

fn two_ranks_equal_one(t: Test) {
    let one = t.clone().name("one").run();
    let two = t.clone().name("two").arg("--nproc").arg("2").run();
    assert_close_losses(&step_losses(&one), &step_losses(&two));
    let gap = weight_gap(&one.final_model(), &two.final_model());
    assert!(gap <= 1e-6, "final weights differ by {gap:e} (relative)");
    // Rank 0 alone writes the run directory and prints; the other rank's output is nowhere.
    assert_eq!(two.stderr.matches("memtrain: job").count(), 1, "{}", two.stderr);
    assert!(!two.stderr.contains("memtrain-rank1"), "{}", two.stderr);
}

#[test]
fn two_ranks_train_the_mlp_one_process_trains() {
    two_ranks_equal_one(mlp());
}

#[test]
fn two_ranks_train_the_darts_supernet_one_process_trains() {
    two_ranks_equal_one(darts());
}

#[test]
fn an_oom_on_one_rank_backs_off_both_on_the_same_group() {
    let t = mlp().set("memory.on_oom", vec!["backoff", "fail"]);
    let clean = t.clone().name("clean").arg("--nproc").arg("2").run();
    // Rank 1's counting allocator refuses its optimizer step's first allocation at step 3.
    let hit = t
        .clone()
        .name("hit")
        .arg("--nproc")
        .arg("2")
        .env("MEMTRAIN_FAULT_OOM_IN_OPTIMIZER_AT_STEP", "3@1")
        .run();
    let ooms = hit.ooms();
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    assert_eq!(ooms[0].step, 2, "after two completed steps");
    assert_eq!(ooms[0].decision.action, "backoff", "{:?}", ooms[0]);
    assert!(ooms[0].error.contains("rank 1 ran out of memory"), "{:?}", ooms[0]);
    let micro: Vec<i64> = hit.steps().iter().map(|r| r.micro_batch).collect();
    assert_eq!(&micro[..2], &[64, 64]);
    assert!(micro[2..].iter().all(|&m| m == 32), "{micro:?}");
    // Same groups, same model; only the micro-batch split (summation order) differs.
    assert_close_losses(&step_losses(&clean), &step_losses(&hit));
    let gap = weight_gap(&clean.final_model(), &hit.final_model());
    assert!(gap <= 1e-6, "final weights differ by {gap:e} (relative)");
}

/// Rank 1 alone capped, so its backward runs out of memory while rank 0's buckets are already
/// on the wire: it must still take part in every bucket's all-reduce with memory already short,
/// and what it sends then must never reach the weights (the step is retried on both ranks).
#[test]
fn a_rank_out_of_memory_in_backward_backs_off_both_and_trains_the_same_weights() {
    let t = Test::new().spec(table(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 64\n\
         hidden = [1024, 1024]\nnum_classes = 10\n[data]\nsamples = 4096\n[train]\nepochs = 1\n\
         batch_size = 2048\noptimizer = \"sgd\"\nmomentum = 0.9\n[memory]\non_oom = [\"backoff\", \"fail\"]\n\
         [log]\nprogress = \"off\"\n",
    ));
    // 3,277 training samples: two steps, the second short.
    let two = |name: &str| t.clone().name(name).args(&["--nproc", "2"]);
    let clean = two("clean").run();
    let hit = two("hit")
        .args(&["--rank-set", "1:memory.limit=\"24MiB\""])
        .stderr_has("out of memory in backward (preflight)")
        .run();
    let ooms = hit.ooms();
    assert!(
        ooms.iter().any(|o| o.error.contains("rank 1 ran out of memory")),
        "{ooms:?}"
    );
    // Validation, at its own micro-batch, backs off alone.
    let backs = |o: &&OomEvent| ["backoff", "eval_backoff"].contains(&o.decision.action.as_str());
    assert!(ooms.iter().all(|o| backs(&o)), "{ooms:?}");
    assert!(hit.steps().iter().all(|s| s.micro_batch < 2048), "{:?}", hit.steps());
    assert_close_losses(&step_losses(&clean), &step_losses(&hit));
    let gap = weight_gap(&clean.final_model(), &hit.final_model());
    assert!(gap <= 1e-6, "final weights differ by {gap:e} (relative)");
}

#[test]
fn ctrl_c_stops_every_rank_and_resume_continues_on_two_ranks_or_one() {
    let t = mlp();
    let whole = t.clone().name("whole").run();
    let cut = t
        .clone()
        .name("cut")
        .arg("--nproc")
        .arg("2")
        .interrupt_after_step(5)
        .exit(130)
        .stderr_has("interrupted at epoch 1")
        .run();
    let saved = cut.checkpoints();
    assert_eq!(saved.len(), 1, "one checkpoint, from rank 0: {saved:?}");
    // A copy of the interrupted run resumes on one rank; the original on two.
    let copy = cut.test.dir().join("cut-copy");
    copy_dir(&cut.out, &copy);
    let two = cut.resume().arg("--nproc").arg("2").run();
    let one = cut.resume().args_replaced(&["--resume", copy.to_str().unwrap()]).run();
    for (name, dir) in [("two ranks", &two.out), ("one rank", &copy)] {
        let gap = weight_gap(&whole.final_model(), &final_model(dir));
        assert!(gap <= 1e-6, "resumed on {name}: final weights differ by {gap:e}");
    }
    drop(one);
}

/// Peak allocated bytes of each rank over epoch 1, from rank 0's record (before any checkpoint,
/// whose gathering adds to rank 0's later peaks).
fn first_epoch_rank_peaks(o: &Outcome) -> Vec<u64> {
    let epochs = o.epochs();
    let ranks = &epochs[0].ranks;
    assert!(!ranks.is_empty(), "an epoch record lists every rank");
    ranks
        .iter()
        .enumerate()
        .map(|(i, r)| {
            assert_eq!(r.rank, i);
            r.peak_allocated_bytes.expect("a rank's peak allocated bytes")
        })
        .collect()
}

#[test]
fn sharded_optimizer_state_trains_the_same_weights_with_less_memory_per_rank() {
    let hidden = 256;
    let t = mlp().set("model.mlp.hidden", vec![hidden]);
    let plain = t.clone().name("plain").arg("--nproc").arg("2").run();
    let sharded = t
        .clone()
        .name("sharded")
        .set("train.shard_optimizer_state", true)
        .arg("--nproc")
        .arg("2")
        .run();
    // The owner computes exactly the update every rank would: bit-identical.
    assert_eq!(step_losses(&plain), step_losses(&sharded));
    let gap = weight_gap(&plain.final_model(), &sharded.final_model());
    assert_eq!(gap, 0.0, "sharded and unsharded weights differ");
    let (p, s) = (first_epoch_rank_peaks(&plain), first_epoch_rank_peaks(&sharded));
    assert_eq!((p.len(), s.len()), (2, 2));
    for r in 0..2 {
        assert!(s[r] < p[r], "rank {r}: sharded peak {} not below {}", s[r], p[r]);
    }
    // Adam keeps two fp32 tensors per parameter; sharded over 2 ranks, about half of that state
    // is gone from the ranks together.
    let numel = 64 * hidden + hidden + hidden * 10 + 10;
    let state = 2 * 4 * numel as u64;
    let saved = p.iter().sum::<u64>() - s.iter().sum::<u64>();
    assert!(
        saved >= state / 2,
        "sharding saved {saved} bytes of {state} bytes of state"
    );
    // The summary carries every rank's run-wide peaks too, and the report shows them.
    let ranks = sharded.summary().memory.ranks.len();
    assert_eq!(ranks, 2);
    let html = std::fs::read_to_string(sharded.out.join("report.html")).unwrap();
    assert!(html.contains("id=\"ranks\""), "report has no per-rank table");
}

/// Sharded state with the foreach and fused implementations: each rank runs its own
/// parameters' groups, and the weights are those of the unsharded run, bit for bit.
#[test]
fn sharded_state_trains_the_same_weights_with_foreach_and_fused() {
    let t = mlp().set("model.mlp.hidden", vec![64]).set("train.epochs", 1);
    for imp in ["foreach", "fused"] {
        let t = t.clone().set("train.optimizer_impl", imp);
        let plain = t.clone().name(&format!("plain-{imp}")).arg("--nproc").arg("2").run();
        let sharded = t
            .clone()
            .name(&format!("sharded-{imp}"))
            .set("train.shard_optimizer_state", true)
            .arg("--nproc")
            .arg("2")
            .run();
        assert_eq!(step_losses(&plain), step_losses(&sharded), "{imp}");
        let gap = weight_gap(&plain.final_model(), &sharded.final_model());
        assert_eq!(gap, 0.0, "{imp}: sharded and unsharded weights differ");
        assert_eq!(sharded.summary().precision.optimizer_impl.as_deref(), Some(imp));
    }
}

#[test]
fn a_sharded_checkpoint_resumes_on_one_rank_and_a_single_one_on_two_sharded() {
    let t = mlp();
    let whole = t.clone().name("whole").run();
    // Sharded on 2 ranks, cut, resumed by one process: the checkpoint holds the whole state.
    let cut = t
        .clone()
        .name("cut")
        .set("train.shard_optimizer_state", true)
        .arg("--nproc")
        .arg("2")
        .interrupt_after_step(5)
        .exit(130)
        .run();
    let one = cut.resume().run();
    let gap = weight_gap(&whole.final_model(), &one.final_model());
    assert!(
        gap <= 1e-6,
        "sharded checkpoint resumed on one rank: weights differ by {gap:e}"
    );
    // One process, cut, resumed on 2 ranks with sharded state.
    let single = t.clone().name("single").interrupt_after_step(5).exit(130).run();
    let two = single
        .resume()
        .arg("--nproc")
        .arg("2")
        .arg("--set")
        .arg("train.shard_optimizer_state=true")
        .run();
    let gap = weight_gap(&whole.final_model(), &two.final_model());
    assert!(gap <= 1e-6, "resumed on two sharded ranks: weights differ by {gap:e}");
}

/// torchrun (the bootstrap environment's, `--standalone`: its agent hosts the store) launching
/// memtrain as its workers, as users launch PyTorch jobs.
#[test]
fn a_torchrun_launch_trains_as_nproc_does() {
    let t = mlp();
    let ours = t.clone().name("nproc").arg("--nproc").arg("2").run();
    let theirs = t
        .clone()
        .name("torchrun")
        .launched_by(
            &python(),
            &[
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "--no-python",
            ],
        )
        .env("OMP_NUM_THREADS", "1")
        .run();
    assert_eq!(
        step_losses(&ours),
        step_losses(&theirs),
        "same group, same split, same losses"
    );
    assert_eq!(ours.final_bytes(), theirs.final_bytes());
}

#[test]
fn a_per_rank_setting_is_limited_to_memory_keys() {
    let bad = mlp()
        .name("bad")
        .arg("--nproc")
        .arg("2")
        .arg("--rank-set")
        .arg("1:train.shard_optimizer_state=true")
        .exit(2)
        .stderr_has("only memory.* keys can differ between ranks")
        .run();
    assert!(!bad.out.exists(), "nothing is written for a rejected command line");
    let absent = mlp()
        .name("absent")
        .arg("--nproc")
        .arg("2")
        .arg("--rank-set")
        .arg("5:memory.limit=64MiB")
        .exit(2)
        .stderr_has("--rank-set \"5:memory.limit=64MiB\": there is no rank 5; the ranks are 0 to 1")
        .run();
    assert!(!absent.out.exists(), "nothing is written for a rejected command line");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

#[test]
fn a_killed_rank_stops_the_other_with_its_name() {
    // Long enough that the ranks are still training when one is killed.
    let mut running = mlp()
        .name("killed")
        .set("train.epochs", 400)
        .set("log.progress", "off")
        .arg("--nproc")
        .arg("2")
        .env("MEMTRAIN_DIST_TIMEOUT", "20")
        .exit(1)
        .stderr_has("rank 1 was killed (SIGKILL)")
        .spawn();
    // Rank 0's line for epoch 1: both ranks are up and have trained together, and a completed
    // step is there to be saved.
    running.await_stderr("epoch 1/400");
    let ranks = children(running.pid());
    assert_eq!(ranks.len(), 2, "{ranks:?}");
    let rank1 = *ranks
        .iter()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .unwrap()
                .split(|&b| b == 0)
                .any(|v| v == b"RANK=1")
        })
        .expect("a child with RANK=1");
    unsafe { libc::kill(rank1, libc::SIGKILL) };
    let r = running.finish();
    assert!(
        r.stderr.contains(&format!("rank 1 (pid {rank1}) stopped answering")),
        "{}",
        r.stderr
    );
    // Rank 0 stopped by itself: the launcher did not have to kill it once the timeout had passed.
    assert!(
        !r.stderr.contains("did not stop after another rank failed"),
        "{}",
        r.stderr
    );
    // Rank 0 saved the last completed step on its own, and one process resumes from it.
    assert!(r.stderr.contains("was saved to"), "{}", r.stderr);
    r.resume()
        .args(&["--max-steps", "2"])
        .stderr_has("stopped after 2 optimizer steps")
        .run();
}

/// Two "nodes" of two ranks each on this machine: two torchrun agents started together, joined
/// through the static rendezvous at MASTER_ADDR (node 0's agent hosts the store), as on two
/// hosts. Gloo's connections go through the interface GLOO_SOCKET_IFNAME names.
#[test]
fn two_nodes_of_two_ranks_train_as_one_process_does() {
    // One micro-batch per rank.
    let t = mlp()
        .set("train.epochs", 1)
        .set("train.batch_size", 32)
        .set("train.accumulation_steps", 4);
    let one = t.clone().name("one").run();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let node = |rank: &str| {
        t.clone()
            .name("nodes")
            .launched_by(
                &python(),
                &[
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    rank,
                    "--nproc-per-node",
                    "2",
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    &port,
                    "--no-python",
                ],
            )
            .env("OMP_NUM_THREADS", "1")
            .env("GLOO_SOCKET_IFNAME", "lo")
    };
    let second = node("1").spawn();
    let first = node("0").run();
    let second = second.finish();
    assert_close_losses(&step_losses(&one), &step_losses(&first));
    let gap = weight_gap(&one.final_model(), &first.final_model());
    assert!(gap <= 1e-6, "final weights differ by {gap:e} (relative)");
    let ranks: Vec<usize> = first.summary().memory.ranks.iter().map(|r| r.rank).collect();
    assert_eq!(ranks, [0, 1, 2, 3]);
    // Global rank 0 alone prints; node 1's ranks are quiet.
    assert_eq!(first.stderr.matches("memtrain: job").count(), 1, "{}", first.stderr);
    assert!(!second.stderr.contains("memtrain: job"), "{}", second.stderr);
}

/// The test switch: one process, a one-rank Gloo group, the data-parallel path end to end, and
/// the same run bit for bit. A bad GLOO_SOCKET_IFNAME is named with the interfaces there are.
#[test]
fn a_one_rank_group_trains_as_one_process_does() {
    let t = mlp().set("train.epochs", 1);
    let plain = t.clone().name("plain").run();
    let group = t
        .clone()
        .name("group")
        .env("MEMTRAIN_TEST_SINGLE_RANK_GROUP", "1")
        .stderr_has("MEMTRAIN_TEST_SINGLE_RANK_GROUP=1: training as a one-rank Gloo group")
        .run();
    assert_eq!(step_losses(&plain), step_losses(&group));
    assert_eq!(plain.final_bytes(), group.final_bytes());
    assert_eq!(group.summary().memory.ranks.len(), 1, "a group's run records its ranks");
    assert!(plain.summary().memory.ranks.is_empty());
    let bad = t
        .clone()
        .name("bad")
        .env("MEMTRAIN_TEST_SINGLE_RANK_GROUP", "1")
        .env("GLOO_SOCKET_IFNAME", "nosuch0")
        .exit(1)
        .stderr_has("GLOO_SOCKET_IFNAME=\"nosuch0\": this machine has no network interface \"nosuch0\" (it has: ")
        .run();
    assert!(bad.stderr.contains("lo"), "{}", bad.stderr);
}

/// A rank out of memory inside a collective (its part of the step's outcome exchange cannot be
/// made while the others wait in it) cannot retry, but it lost no peer: the last completed step
/// is saved as an OOM's, and the run ends as an OOM does.
#[test]
fn an_oom_inside_a_collective_saves_the_last_step_as_an_ooms() {
    let r = mlp()
        .set("train.epochs", 1)
        .set("log.progress", "off")
        .env("MEMTRAIN_TEST_SINGLE_RANK_GROUP", "1")
        .env("MEMTRAIN_FAULT_OOM_IN_COLLECTIVE_AT_STEP", "2")
        .exit(3)
        .stderr_has("this rank ran out of memory inside a collective with the other ranks")
        .stderr_has("the last completed step (epoch 1 step 1) was saved to")
        .run();
    let ck = r.checkpoints();
    assert_eq!(ck.len(), 1, "{ck:?}");
    assert_eq!((ck[0].reason.as_str(), ck[0].step), ("oom", 1), "{ck:?}");
}

/// A language model on prompt/completion pairs, whose windows count different numbers of target
/// tokens: two ranks' losses are token means over both ranks' tokens, training and validation,
/// as one process's are over all of them.
#[test]
fn two_ranks_take_a_language_models_token_means_over_every_rank() {
    let t = Test::new();
    let words = ["one", "two", "three", "four", "five", "six", "seven", "eight"];
    let mut vocab = serde_json::json!({"<unk>": 0, "</s>": 1});
    for (i, w) in words.iter().enumerate() {
        vocab[*w] = serde_json::json!(i + 2);
    }
    let tok = t.dir().join("tokenizer.json");
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(&tok, tokenizer.to_string()).unwrap();
    // Completions of 1 to 7 words: a window counts 2 to 8 target tokens.
    let lines: Vec<String> = (0..64)
        .map(|i| {
            let cut = 1 + i % 7;
            let prompt = words[..1].join(" ");
            let completion = words[1..=cut].join(" ");
            serde_json::json!({ "prompt": prompt, "completion": completion }).to_string()
        })
        .collect();
    let data = t.dir().join("pairs.jsonl");
    std::fs::write(&data, lines.join("\n")).unwrap();
    let t = t.spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"llama\"\n\
         [model.llama]\nvocab_size = 16\nhidden_size = 16\nintermediate_size = 32\nnum_hidden_layers = 1\n\
         num_attention_heads = 2\nnum_key_value_heads = 1\nmax_position_embeddings = 16\n\
         [data]\nsource = \"jsonl\"\npath = \"{}\"\ntokenizer = \"{}\"\nprompt_field = \"prompt\"\n\
         completion_field = \"completion\"\nseq_len = 10\nval_fraction = 0.25\n\
         [train]\nepochs = 2\nbatch_size = 8\naccumulation_steps = 2\noptimizer = \"adamw\"\nlr = 0.01\n\
         [log]\nprogress = \"off\"\n",
        data.display(),
        tok.display()
    )));
    let one = t.clone().name("one").run();
    let two = t.clone().name("two").arg("--nproc").arg("2").run();
    assert_close_losses(&step_losses(&one), &step_losses(&two));
    for (a, b) in one.epochs().iter().zip(two.epochs().iter()) {
        let (a, b) = (&a.result, &b.result);
        assert_close_losses(&[a.train_loss], &[b.train_loss]);
        assert_close_losses(&[a.val_loss.unwrap()], &[b.val_loss.unwrap()]);
    }
}
