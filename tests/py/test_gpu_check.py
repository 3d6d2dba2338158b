"""scripts/gpu_check.py's self-test, on any machine: its readers, judges and table on made-up and
reference inputs, and, when MEMTRAIN_BIN names a built memtrain, a rehearsal of the checks that
mean something on the CPU (the same runner and judges, job.device = "cpu"), so the commands the
GPU machine will run are known to be accepted by this build.

Run: scripts/gpu-check --self-test (tests/it/gpu_check.rs does, with MEMTRAIN_BIN set)."""
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import tempfile
import tomllib
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_check as g  # noqa: E402

GiB = g.GiB
MiB = g.MiB


def step(n, loss, **kw):
    r = {"type": "step", "step": n, "loss": loss}
    r.update(kw)
    return r


class Readers(unittest.TestCase):
    def test_get_reads_dotted_paths(self):
        d = {"a": {"b": {"c": 3}}, "x": None}
        self.assertEqual(g.get(d, "a.b.c"), 3)
        self.assertIsNone(g.get(d, "a.b.d"))
        self.assertEqual(g.get(d, "x.y", 7), 7)

    def test_sizes_read_as_a_person_would(self):
        self.assertEqual(g.size(None), "none")
        self.assertEqual(g.size(512), "512 B")
        self.assertEqual(g.size(3 * MiB // 2), "1.50 MiB")
        self.assertEqual(g.size(80 * GiB), "80.00 GiB")

    def test_a_torn_last_line_is_left_out(self):
        text = '{"type":"start","step":0}\n\n{"type":"step","step":1,"loss":2.0}\n{"type":"ste'
        recs = g.parse_jsonl(text)
        self.assertEqual([r["type"] for r in recs], ["start", "step"])
        self.assertEqual(g.step_losses(recs), [2.0])

    def test_relative_gaps(self):
        self.assertEqual(g.max_rel_gap([1.0, 2.0], [1.0, 2.0]), 0.0)
        self.assertAlmostEqual(g.max_rel_gap([1.0, 2.002], [1.0, 2.0]), 1e-3)
        self.assertEqual(g.max_rel_gap([1.0], [1.0, 2.0]), float("inf"))
        self.assertEqual(g.max_rel_gap([], []), float("inf"), "nothing to compare is no agreement")
        self.assertEqual(g.gap_text(float("inf")), "lengths differ")

    def test_safetensors_header_names(self):
        header = json.dumps({"__metadata__": {}, "rng/cuda": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
                             "rng/cpu": {"dtype": "U8", "shape": [16], "data_offsets": [16, 32]}}).encode()
        with tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False) as f:
            f.write(struct.pack("<Q", len(header)) + header + bytes(32))
        try:
            self.assertEqual(g.safetensors_keys(f.name), ["rng/cpu", "rng/cuda"])
        finally:
            os.unlink(f.name)

    def test_nvidia_smi_csv(self):
        self.assertEqual(g.parse_smi_apps("1234, 812\n99, [N/A]\n\n"), {1234: 812 * MiB})
        self.assertEqual(g.parse_smi_used("4711\n"), 4711 * MiB)
        self.assertIsNone(g.parse_smi_used("[N/A]"))


class Table(unittest.TestCase):
    def test_one_row_per_check_with_its_verdict_and_a_count(self):
        rows = [g.Check("a", "x", "seen a", True), g.Check("bb | c", "y", "seen b", False)]
        text = g.render(rows)
        lines = text.splitlines()
        self.assertTrue(lines[0].startswith("| check"), text)
        self.assertIn("result", lines[0])
        self.assertTrue(lines[1].startswith("|-"), text)
        self.assertIn("PASS", lines[2])
        self.assertIn("FAIL", lines[3])
        self.assertIn("bb / c", lines[3], "a | inside a cell would split it")
        self.assertEqual(lines[-1], "1 passed, 1 failed")
        self.assertEqual(len({len(l) for l in lines[:-1]}), 1, "columns line up:\n" + text)
        self.assertEqual(g.exit_status(rows), 1)
        self.assertEqual(g.exit_status(rows[:1]), 0)

    def test_a_machine_without_cuda_is_told_so(self):
        msg = g.no_cuda_message({"version": "2.11.0+cu130", "cuda_built": "13.0", "available": False, "count": 0})
        self.assertIn("no CUDA device", msg)
        self.assertIn("torch 2.11.0+cu130", msg)
        self.assertIn("cannot use PyTorch", g.no_cuda_message({"error": "ModuleNotFoundError: torch"}))
        self.assertIsNone(g.no_cuda_message({"available": True, "count": 1}))


PROBE = {"available": True, "count": 1, "name": "NVIDIA H100 80GB HBM3", "total": 79 * GiB, "free": 78 * GiB}


def info(**gpu):
    g0 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_bytes": 80 * GiB, "free_bytes": 78 * GiB + 300 * MiB,
          "used_bytes": 1 * GiB + 700 * MiB, "processes": []}
    g0.update(gpu)
    return {"cuda": {"available": True, "device_count": 1, "driver": "580", "runtime": "13.0"}, "gpus": [g0]}


class Judges(unittest.TestCase):
    def test_info_within_the_tolerances_passes(self):
        c = g.judge_info(info(), PROBE)
        self.assertTrue(c.ok, c)
        self.assertIn("NVIDIA H100", c.seen)

    def test_info_that_disagrees_with_torch_fails_and_says_where(self):
        c = g.judge_info(info(free_bytes=70 * GiB), PROBE)
        self.assertFalse(c.ok)
        self.assertIn("MISMATCH: free_bytes", c.seen)
        c = g.judge_info(info(name="CUDA device 0", total_bytes=40 * GiB), PROBE)
        self.assertIn("name", c.seen)
        self.assertIn("total", c.seen)
        c = g.judge_info({"cuda": {"available": False}, "gpus": []}, PROBE)
        self.assertFalse(c.ok)
        self.assertIn("although torch sees 1: is the binary linked with libtorch_cuda", c.seen)

    def test_backoff_and_fallback(self):
        s = {"status": "completed", "device": "cuda:0", "oom": {"backoffs": 2, "cpu_fallbacks": 0},
             "batch": {"final_micro_batch": 256, "final_accumulation_steps": 4, "effective_batch": 1024},
             "memory": {"peak_reserved_bytes": GiB - MiB}}
        self.assertTrue(g.judge_backoff(s, 1024).ok)
        self.assertFalse(g.judge_backoff(dict(s, device="cpu"), 1024).ok, "a backoff must happen on the GPU")
        self.assertFalse(g.judge_cpu_fallback(s).ok)
        self.assertTrue(g.judge_cpu_fallback(dict(s, device="cpu", oom={"cpu_fallbacks": 1})).ok)

    def test_a_validation_oom_must_leave_training_alone(self):
        clean = {"status": "completed", "device": "cuda:0", "oom": {"backoffs": 0, "eval_backoffs": 0},
                 "batch": {"final_micro_batch": 64}}
        hit = dict(clean, oom={"backoffs": 0, "eval_backoffs": 1})
        oom = {"type": "oom", "phase": "validation", "decision": {"action": "eval_backoff", "to": {"micro_batch": 256}}}
        steps = [step(1, 2.0), step(2, 1.5)]
        c = g.judge_eval_oom(clean, hit, steps, steps + [oom], True, 512)
        self.assertTrue(c.ok, c.seen)
        self.assertIn("512 -> 256", c.seen)
        self.assertFalse(g.judge_eval_oom(clean, hit, steps, steps + [oom], False, 512).ok, "weights must match")
        shrunk = dict(hit, oom={"backoffs": 1, "eval_backoffs": 1})
        self.assertFalse(g.judge_eval_oom(clean, shrunk, steps, steps + [oom], True, 512).ok, "training shrank")
        trained = dict(oom, phase="training step", decision={"action": "backoff"})
        self.assertFalse(g.judge_eval_oom(clean, hit, steps, steps + [trained], True, 512).ok)
        self.assertFalse(g.judge_eval_oom(clean, hit, steps, steps, True, 512).ok, "no OOM happened")

    def test_snapshot_of_the_reference_format(self):
        """reference.py writes a snapshot in the format torch.cuda.memory._snapshot() returns."""
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "snapshot.pickle")
            subprocess.run([sys.executable, os.path.join(HERE, "reference.py"), "snapshot", "--out", out], check=True)
            with open(out, "rb") as f:
                snap = pickle.load(f)
        reserved, segs = g.snapshot_reserved(snap)
        self.assertGreater(segs, 0)
        report = {"device": "cuda:0", "allocator_stats": {"reserved": reserved, "allocated": g.snapshot_allocated(snap)}}
        c = g.judge_snapshot(3, report, snap)
        self.assertTrue(c.ok, c)
        c = g.judge_snapshot(3, dict(report, allocator_stats={"reserved": reserved + 2 * MiB}), snap)
        self.assertFalse(c.ok)
        self.assertFalse(g.judge_snapshot(0, report, snap).ok, "the run must end with exit 3")
        self.assertIn("no oom/report.json", g.judge_snapshot(3, None, snap).seen)

    def test_end_snapshot_replays_its_trace_to_the_oom(self):
        def snap(live, trace):
            blocks = [{"address": a, "size": 2 * MiB, "requested_size": r, "state": "active_allocated"} for a, r in live]
            return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]}
        at_oom = snap([(0, MiB + 8)], [{"action": "alloc", "addr": 0, "size": MiB + 8}, {"action": "oom", "size": 9 * MiB}])
        # After the OOM: block 0 freed, block 5 asked for and still live.
        end = snap([(5, 300)], at_oom["device_traces"][0] + [
            {"action": "free_requested", "addr": 0, "size": MiB + 8},
            {"action": "free_completed", "addr": 0, "size": MiB + 8},
            {"action": "alloc", "addr": 5, "size": 300}])
        self.assertEqual(g.requested_at_oom(end), MiB + 8)
        self.assertTrue(g.judge_end_snapshot(at_oom, end).ok)
        self.assertFalse(g.judge_end_snapshot(snap([(0, MiB + 9)], []), end).ok, "another live total")
        self.assertFalse(g.judge_end_snapshot(at_oom, snap([(5, 300)], [])).ok, "no history")
        self.assertFalse(g.judge_end_snapshot(at_oom, None).ok)

    def test_requested_bytes_sit_under_allocated(self):
        recs = [step(1, 2.0, memory={"peak_requested_bytes": 90, "peak_allocated_bytes": 100, "peak_reserved_bytes": 128}),
                step(2, 1.9, memory={"peak_requested_bytes": 95, "peak_allocated_bytes": 95, "peak_reserved_bytes": 128})]
        self.assertTrue(g.judge_requested(recs, {"memory": {"peak_requested_bytes": 95}}).ok)
        self.assertFalse(g.judge_requested(recs, {"memory": {"peak_requested_bytes": 90}}).ok, "summary lost the top")
        recs[1]["memory"]["peak_requested_bytes"] = 129
        self.assertFalse(g.judge_requested(recs, {"memory": {"peak_requested_bytes": 129}}).ok, "above reserved")
        self.assertFalse(g.judge_requested([step(1, 2.0, memory={"peak_allocated_bytes": 100})],
                                           {"memory": {"peak_requested_bytes": 1}}).ok, "no reading (a CPU run)")

    def test_bn_retry_needs_the_statistics_of_the_smaller_micro_batch(self):
        def safetensors(tensors):
            header, blob = {}, b""
            for name, (dtype, values) in tensors.items():
                raw = struct.pack(f"<{len(values)}{'f' if dtype == 'F32' else 'q'}", *values)
                header[name] = {"dtype": dtype, "shape": [len(values)], "data_offsets": [len(blob), len(blob) + len(raw)]}
                blob += raw
            h = json.dumps(header).encode()
            return struct.pack("<Q", len(h)) + h + blob

        def bn(mean, count):
            return g.batchnorm_state(safetensors({"bn.running_mean": ("F32", mean), "bn.running_var": ("F32", [1.0, 1.0]),
                                                  "bn.num_batches_tracked": ("I64", [count]), "fc.weight": ("F32", [0.5])}))
        small = bn([0.25, -0.5], 4)
        self.assertEqual(sorted(small), ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"])
        self.assertEqual(small["bn.num_batches_tracked"], [4])
        capped = {"status": "completed", "oom": {"backoffs": 1}, "batch": {"final_micro_batch": 32}}
        self.assertTrue(g.judge_bn_retry(capped, bn([0.25, -0.5], 4), small, 64).ok)
        self.assertFalse(g.judge_bn_retry(capped, bn([0.25, -0.5], 5), small, 64).ok, "the failed attempt's update counted")
        self.assertFalse(g.judge_bn_retry(capped, bn([0.3, -0.5], 4), small, 64).ok, "statistics it left")
        self.assertFalse(g.judge_bn_retry(dict(capped, oom={"backoffs": 0}), small, small, 64).ok, "no OOM")

    def test_bn_retry_searches_between_the_first_step_and_the_halved_run(self):
        def rec(allocated, reserved=None):
            m = {"peak_allocated_bytes": allocated}
            if reserved is not None:
                m["peak_reserved_bytes"] = reserved
            return step(1, 2.0, memory=m)

        big = [rec(900, 1400), rec(950, 1400)]
        small = [{"type": "preflight", "peak_bytes": 600}, rec(500, 600), rec(520, 700)]
        # The first try lies between the halved run's largest reserved (700) and the first big
        # step's allocated (900), not the big run's reserved, which a capped allocator need not reach.
        self.assertEqual(g.bn_retry_bounds(big, small), ((520, 900, 800), ""))
        # On the CPU only allocated figures exist.
        self.assertEqual(g.bn_retry_bounds([rec(900)], [rec(500)]), ((500, 900, 700), ""))
        # Reserved at or above the first step's allocated: the first try halves the allocated span.
        self.assertEqual(g.bn_retry_bounds([rec(690, 1400)], small)[0], (520, 690, 605))
        bounds, why = g.bn_retry_bounds([rec(500, 1400)], small)
        self.assertIsNone(bounds)
        self.assertIn("not above", why)
        self.assertIsNone(g.bn_retry_bounds([], small)[0], "no step records")

        def oom(step_done, micro=64):
            return {"type": "oom", "step": step_done, "micro_batch_before": micro}

        done = {"batch": {"final_micro_batch": 32}}
        self.assertEqual(g.bn_retry_verdict(0, [oom(0), oom(0, 32)][:1], done, 64), "ok")
        self.assertEqual(g.bn_retry_verdict(0, [], {"batch": {"final_micro_batch": 64}}, 64), "high", "no OOM")
        self.assertEqual(g.bn_retry_verdict(0, [oom(2)], done, 64), "high", "the first steps ran at 64")
        self.assertEqual(g.bn_retry_verdict(0, [oom(0), oom(0, 32)], {"batch": {"final_micro_batch": 16}}, 64), "low")
        self.assertEqual(g.bn_retry_verdict(3, [oom(0)], {}, 64), "low", "the run failed")

    def test_setup_oom_names_the_cap_and_no_host_count(self):
        said = ("error: out of memory while building the model (its parameters are 601 MiB): CUDA out of memory. "
                "Tried to allocate 122.07 MiB. GPU 0 has a total capacity of 79.18 GiB of which 78.5 GiB is free. "
                "256.00 MiB allowed; ... To fix: raise memory.limit (memory.fraction on a GPU), or use a smaller model")
        self.assertTrue(g.judge_setup_oom(3, said).ok)
        self.assertFalse(g.judge_setup_oom(1, said).ok, "exit 1")
        self.assertFalse(g.judge_setup_oom(3, said.replace("; ... To", "; 1.2 MiB of tensors were allocated. To")).ok,
                         "the host's count")
        uncapped = said.replace("raise memory.limit (memory.fraction on a GPU)",
                                "no memory.limit bound it, so the GPU's own memory ran out")
        self.assertFalse(g.judge_setup_oom(3, uncapped).ok, "the cap not named")

    def test_a_fine_tune_needs_its_frozen_count_groups_and_evals_figures(self):
        summary = {"training": {"frozen_parameters": 4160, "groups": [{}, {}]}, "final": {"val_acc": 0.9, "val_loss": 0.31}}
        report = {"accuracy": 0.9, "loss": 0.3100001}
        self.assertTrue(g.judge_finetune(0, summary, 0, report).ok)
        self.assertFalse(g.judge_finetune(0, summary, 0, dict(report, accuracy=0.89)).ok, "eval disagrees")
        self.assertFalse(g.judge_finetune(0, summary, 2, None).ok, "eval failed")
        self.assertFalse(g.judge_finetune(0, dict(summary, training={"frozen_parameters": 0, "groups": [{}, {}]}), 0, report).ok)
        self.assertFalse(g.judge_finetune(3, None, 0, report).ok)

    def test_a_resident_nan_is_named_by_file_and_sample(self):
        said = "error: training step failed: data.path /t/nan.safetensors: x contains NaN or infinite values (sample 5, counting from 0); replace or drop that sample"
        self.assertTrue(g.judge_resident_nan(1, said, "/t/nan.safetensors").ok)
        self.assertFalse(g.judge_resident_nan(0, said, "/t/nan.safetensors").ok, "it trained")
        self.assertFalse(g.judge_resident_nan(1, said.replace("sample 5", "sample 6"), "/t/nan.safetensors").ok)
        self.assertFalse(g.judge_resident_nan(1, "thread 'main' panicked at src/data/dataset.rs:\n" + said,
                                              "/t/nan.safetensors").ok, "a raw panic")

    def test_a_group_backs_off_as_the_run_without_one(self):
        done = {"status": "completed", "oom": {"backoffs": 1}, "batch": {"final_micro_batch": 512},
                "memory": {"ranks": [{"rank": 0}]}}
        recs = [step(1, 2.0), step(2, 1.5)]
        self.assertTrue(g.judge_group_oom(done, done, recs, recs).ok)
        self.assertFalse(g.judge_group_oom(done, dict(done, oom={"backoffs": 0}), recs, recs).ok, "no OOM")
        self.assertFalse(g.judge_group_oom(done, dict(done, status="oom"), recs, recs).ok)
        self.assertFalse(g.judge_group_oom(done, done, recs, [step(1, 2.0), step(2, 1.6)]).ok, "other losses")

    def test_the_advice_is_read_word_for_word(self):
        said = ('error: out of memory in optimizer step (preflight): CUDA out of memory. ...; last good state saved '
                'to /tmp/x/checkpoints/step-000000000; resume with --resume after setting memory.optimizer_state = '
                '"host", or after setting train.optimizer_state_bits = 8, or with a larger memory.limit or a smaller model')
        self.assertEqual(g.advice_ways("ok\n" + said + "\n"),
                         ['memory.optimizer_state="host"', "train.optimizer_state_bits=8"])
        self.assertEqual(g.advice_ways("error: out of memory; no checkpoint (--max-steps)"), [])

    def test_a_static_bill_goes_to_the_host_at_the_configured_micro_batch(self):
        start = {"type": "start", "train_samples": 51}
        oom = {"type": "oom", "phase": "optimizer step (preflight)", "micro_batch_before": 16,
               "decision": {"action": "host_optimizer_state"}}
        done = {"status": "completed", "device": "cuda:0", "samples_trained": 51, "oom": {"backoffs": 0},
                "batch": {"final_micro_batch": 16}}
        self.assertTrue(g.judge_static_offload(0, [start, oom], done, 16).ok)
        backed = dict(oom, micro_batch_before=8)
        halved = {"type": "oom", "micro_batch_before": 16, "decision": {"action": "backoff"}}
        self.assertFalse(g.judge_static_offload(0, [start, halved, backed], done, 16).ok, "a backoff first")
        self.assertFalse(g.judge_static_offload(0, [start], done, 16).ok, "no OOM: the cap did not bind")
        self.assertFalse(g.judge_static_offload(3, [start, oom], dict(done, status="oom"), 16).ok)
        self.assertFalse(g.judge_static_offload(0, [start, oom], dict(done, device="cpu"), 16).ok, "fell back")
        self.assertFalse(g.judge_static_offload(0, [start, oom], dict(done, samples_trained=48), 16).ok)

    def test_a_static_bill_without_offload_stops_and_names_the_setting(self):
        fail = {"type": "oom", "decision": {"action": "fail"}}
        said = 'error: ...; resume with --resume after setting memory.optimizer_state = "host", or with a larger memory.limit'
        self.assertTrue(g.judge_static_advice(3, [fail], said).ok)
        self.assertFalse(g.judge_static_advice(0, [fail], said).ok)
        self.assertFalse(g.judge_static_advice(3, [{"type": "oom", "decision": {"action": "backoff"}}, fail], said).ok,
                         "backed off first")
        self.assertFalse(g.judge_static_advice(3, [fail], "error: ...; resume with --resume with a larger memory.limit").ok)

    def test_the_advice_followed_trains_to_the_end(self):
        way = 'memory.optimizer_state="host"'
        recs = [{"type": "start", "resumed": False, "train_samples": 51},
                {"type": "start", "resumed": True, "train_samples": 51}]
        done = {"status": "completed", "device": "cuda:0", "samples_trained": 51}
        self.assertTrue(g.judge_advice_resume(3, way, 0, recs, done).ok)
        self.assertFalse(g.judge_advice_resume(3, way, 1, recs, dict(done, status="failed")).ok)
        self.assertFalse(g.judge_advice_resume(3, way, 0, recs[:1], done).ok, "not resumed")
        self.assertFalse(g.judge_advice_resume(0, way, 0, recs, done).ok, "the first run did not fail")
        self.assertFalse(g.judge_advice_resume(3, "memory.limit=1GiB", 0, recs, done).ok, "another way")

    def test_an_oom_inside_a_collective_ends_as_an_oom_with_the_last_step_saved(self):
        said = "memtrain: one-rank NCCL group\nerror: ... this rank ran out of memory inside a collective with the other ranks"
        ck = [{"type": "checkpoint", "reason": "oom", "step": 1}]
        self.assertTrue(g.judge_collective_oom(3, ck, said, 2).ok)
        self.assertFalse(g.judge_collective_oom(0, ck, said, 2).ok, "the hook did not fire")
        self.assertFalse(g.judge_collective_oom(3, [dict(ck[0], reason="failure")], said, 2).ok)
        self.assertFalse(g.judge_collective_oom(3, ck, said.replace("NCCL", "Gloo"), 2).ok, "no NCCL group")
        self.assertTrue(g.judge_collective_oom(3, ck, said.replace("NCCL", "Gloo"), 2, "Gloo").ok)

    def test_inf_step(self):
        recs = [step(1, 2.0, skipped=False, loss_scale=65536.0), step(2, 1.9, skipped=False, loss_scale=65536.0),
                step(3, 1.8, skipped=True, loss_scale=32768.0), step(4, 1.7, skipped=False, loss_scale=32768.0)]
        summary = {"precision": {"skipped_steps": 1, "loss_scale": 32768.0}}
        self.assertTrue(g.judge_inf_step(recs, summary, 3).ok)
        recs[2]["loss_scale"] = 65536.0
        self.assertFalse(g.judge_inf_step(recs, summary, 3).ok, "the scale must halve")
        self.assertFalse(g.judge_inf_step(recs[:2], summary, 3).ok)

    def test_recompute_needs_equal_losses_and_a_lower_peak(self):
        plain = [step(1, 2.0), step(2, 1.5)]
        ps = {"memory": {"peak_allocated_bytes": 100 * MiB}, "precision": {"activation_checkpointing": False}}
        cs = {"memory": {"peak_allocated_bytes": 40 * MiB}, "precision": {"activation_checkpointing": True}}
        self.assertTrue(g.judge_recompute("vit", plain, ps, [step(1, 2.0), step(2, 1.500001)], cs).ok)
        self.assertFalse(g.judge_recompute("vit", plain, ps, [step(1, 2.0), step(2, 1.51)], cs).ok)
        self.assertFalse(g.judge_recompute("vit", plain, ps, plain, dict(cs, memory={"peak_allocated_bytes": 100 * MiB})).ok)

    def test_async_cap(self):
        s = {"status": "completed", "device": "cuda:0", "oom": {"backoffs": 1}, "batch": {"final_micro_batch": 512}}
        cap = {"kind": "cuda_fraction", "bytes": 1 << 30, "fraction": 0.0125}
        start = {"allocator_conf": "backend:cudaMallocAsync", "cap": cap}
        self.assertTrue(g.judge_async_cap(start, s, 1024).ok)
        self.assertFalse(g.judge_async_cap({"allocator_conf": "backend:cudaMallocAsync"}, s, 1024).ok, "no cap")
        self.assertFalse(g.judge_async_cap({"allocator_conf": "per_process_memory_fraction:0.0125", "cap": cap}, s, 1024).ok)
        self.assertFalse(g.judge_async_cap(start, dict(s, oom={"backoffs": 0}), 1024).ok, "an unenforced cap")

    def test_fit_against_what_the_driver_sees(self):
        fit = {"budget": {"bytes": 512 * MiB}, "recommendation": {"batch_size": 64, "accumulation_steps": 4,
                                                                   "peak_bytes": 300 * MiB}}
        run = {"memory": {"peak_reserved_bytes": 310 * MiB}}
        self.assertTrue(g.judge_fit(fit, run, 300 * MiB + 600 * MiB, "its process").ok)
        self.assertFalse(g.judge_fit(fit, run, 200 * MiB, "its process").ok, "the driver cannot see less")
        self.assertFalse(g.judge_fit(fit, run, 300 * MiB + 2 * GiB, "its process").ok)
        self.assertFalse(g.judge_fit(fit, run, None, "").ok)
        self.assertIn("no recommendation", g.judge_fit({"recommendation": None}, run, None, "").seen)

    def test_fit_graph_needs_both_probes_and_the_written_spec_run_under_the_budget(self):
        def probe(graph, rate=100.0, micro=32, fits=True):
            return {"precision": "fp32", "activation_checkpointing": False, "placement": "none",
                    "cuda_graph": graph, "micro_batch": micro, "fits": fits, "samples_per_s": rate}
        fit = {"budget": {"bytes": 2 * GiB}, "probes": [probe("off", micro=16), probe("off"), probe("on", 300.0)],
               "recommendation": {"cuda_graph": "on", "batch_size": 32}}
        captured = [{"type": "graph", "action": "captured", "of": "weights"}]
        run = {"memory": {"peak_reserved_bytes": GiB}}
        c = g.judge_fit_graph(fit, 0, captured, run)
        self.assertTrue(c.ok, c)
        self.assertIn("fp32 at 32: eager 100/s, captured 300/s", c.seen)
        self.assertFalse(g.judge_fit_graph(fit, 0, [], run).ok, "recommended captured, ran eager")
        self.assertFalse(g.judge_fit_graph(fit, 1, captured, run).ok, "the run failed")
        self.assertFalse(g.judge_fit_graph(fit, 0, captured, {"memory": {"peak_reserved_bytes": 3 * GiB}}).ok,
                         "over the budget")
        eager_won = dict(fit, recommendation={"cuda_graph": "off", "batch_size": 32})
        self.assertTrue(g.judge_fit_graph(eager_won, 0, [], run).ok)
        self.assertFalse(g.judge_fit_graph(eager_won, 0, captured, run).ok, "written off, yet captured")
        apart = dict(fit, probes=[probe("off", micro=16), probe("on", micro=32)])
        c = g.judge_fit_graph(apart, 0, captured, run)
        self.assertFalse(c.ok, "not at the same micro-batch")
        self.assertIn("no setting probed both ways", c.seen)
        oom = dict(fit, probes=[probe("off"), probe("on", fits=False)], recommendation={"cuda_graph": "off"})
        c = g.judge_fit_graph(oom, 0, [], run)
        self.assertTrue(c.ok, "a captured probe that did not fit still counts as measured")
        self.assertIn("captured OOM", c.seen)

    def test_resume(self):
        whole = [step(i, 1.0 / i) for i in range(1, 9)]
        self.assertTrue(g.judge_resume(whole, list(whole), 130, ["rng/cpu", "rng/cuda"]).ok)
        self.assertFalse(g.judge_resume(whole, list(whole), 130, ["rng/cpu"]).ok, "the CUDA generator must be saved")
        self.assertFalse(g.judge_resume(whole, whole[:5] + [step(6, 0.2)] + whole[6:], 130, ["rng/cuda"]).ok)
        self.assertFalse(g.judge_resume(whole, list(whole), 0, ["rng/cuda"]).ok)

    def test_expandable(self):
        recs = [{"type": "cache_clear", "released_bytes": 0}, {"type": "cache_clear", "released_bytes": 64 * MiB}]
        start = {"allocator_conf": "expandable_segments:True"}
        self.assertTrue(g.judge_expandable(start, recs, {"status": "completed"}).ok)
        self.assertFalse(g.judge_expandable(start, recs[:1], {"status": "completed"}).ok)
        self.assertFalse(g.judge_expandable({"allocator_conf": None}, recs, {"status": "completed"}).ok)

    def test_host_reads_against_the_interface(self):
        recs = [step(4, 1.0, host_reads=1), step(8, 1.0, host_reads=1), step(10, 1.0, host_reads=0)]
        self.assertTrue(g.judge_host_reads(recs, {"host_reads": 2, "global_steps": 10}, False).ok)
        over = [step(4, 1.0, host_reads=2)] + recs[1:]
        c = g.judge_host_reads(over, {"host_reads": 3, "global_steps": 10}, False)
        self.assertFalse(c.ok)
        self.assertIn("step 4: 2 > 1", c.seen)
        # fp16-mixed: one more read per step covered (the scaler's found-inf).
        fp16 = [step(4, 1.0, host_reads=5), step(8, 1.0, host_reads=5)]
        self.assertTrue(g.judge_host_reads(fp16, {"host_reads": 10, "global_steps": 8}, True).ok)
        self.assertFalse(g.judge_host_reads(fp16, {"host_reads": 10, "global_steps": 8}, False).ok)
        c = g.judge_host_reads([step(1, 1.0)], {}, False)
        self.assertFalse(c.ok)
        self.assertIn("binary has no host-read counter", c.seen)
        # The epoch's end reads validation's sums and the epoch's (2), which the summary counts.
        ended = [step(4, 1.0, host_reads=1), {"type": "epoch", "step": 6, "host_reads": 2}]
        self.assertTrue(g.judge_host_reads(ended, {"host_reads": 3, "global_steps": 6}, False).ok)
        ended[1]["host_reads"] = 3
        c = g.judge_host_reads(ended, {"host_reads": 4, "global_steps": 6}, False)
        self.assertFalse(c.ok)
        self.assertIn("epoch 6: 3 > 2", c.seen)

    def test_optimizer_and_group(self):
        self.assertTrue(g.judge_optimizer("fused", "fused", [1.0, 0.9], [1.0, 0.9000001]).ok)
        self.assertFalse(g.judge_optimizer("fused", "fused", [1.0, 0.9], [1.0, 0.91]).ok)
        plain = [step(1, 2.0), step(2, 1.0)]
        s = {"memory": {"ranks": [{"rank": 0}]}}
        said = "memtrain: MEMTRAIN_TEST_SINGLE_RANK_GROUP=1: training as a one-rank NCCL group"
        self.assertTrue(g.judge_single_rank(plain, list(plain), s, said).ok)
        self.assertFalse(g.judge_single_rank(plain, list(plain), {"memory": {"ranks": []}}, said).ok)
        self.assertFalse(g.judge_single_rank(plain, list(plain), s, "").ok)

    def test_darts_and_cache_clears(self):
        s = {"device": "cuda:0", "memory": {"peak_reserved_bytes": 3 * GiB}, "cache": {"clears": 10, "clear_seconds": 0.01}}
        self.assertTrue(g.judge_darts_cap(s, 4 * GiB).ok)
        self.assertFalse(g.judge_darts_cap(dict(s, memory={"peak_reserved_bytes": 5 * GiB}), 4 * GiB).ok)
        self.assertTrue(g.judge_cache_clear_cost(s).ok)
        self.assertFalse(g.judge_cache_clear_cost({"cache": {"clears": 0}}).ok)


    def test_twin_losses_within_the_tolerance(self):
        theirs = [2.3 - 0.1 * i for i in range(10)]
        ok = g.judge_twin("darts", [x * (1 + 1e-5) for x in theirs], theirs)
        self.assertTrue(ok.ok, ok)
        self.assertIn("over 10 steps", ok.seen)
        off = g.judge_twin("darts", [x * 1.01 for x in theirs], theirs)
        self.assertFalse(off.ok, "a percent apart is a defect, not rounding")
        self.assertFalse(g.judge_twin("vit", theirs[:9], theirs[:9]).ok, "10 steps each, or no verdict")
        self.assertFalse(g.judge_twin("vit", theirs, theirs[:9]).ok)

    def test_step_seconds_against_the_epochs(self):
        recs = [step(i, 1.0, seconds=0.1) for i in range(1, 11)]
        s = {"train_seconds": 1.02, "global_steps": 10}
        self.assertTrue(g.judge_step_time(recs, s).ok)
        # A step timed before its loss read, on a GPU: the records hold the host's share only.
        short = [step(i, 1.0, seconds=0.03) for i in range(1, 11)]
        c = g.judge_step_time(short, s)
        self.assertFalse(c.ok, c)
        self.assertIn("(70.6% apart)", c.seen)
        self.assertFalse(g.judge_step_time(recs[:5], s).ok, "a record every step")
        # Records written late (on CUDA, once the next step is queued) still come in order.
        epoch = {"type": "epoch", "step": 10}
        self.assertTrue(g.judge_step_time(recs + [epoch], s).ok)
        swapped = recs[:4] + [recs[5], recs[4]] + recs[6:]
        self.assertFalse(g.judge_step_time(swapped, s).ok, "step order")
        self.assertFalse(g.judge_step_time(recs[:9] + [epoch, recs[9]], s).ok, "the epoch after its steps")
        self.assertFalse(g.judge_step_time(recs[:9] + [step(10, float("nan"), seconds=0.1)], s).ok)
        # Steps timed when the host looked: one a fraction of the others, the next one long.
        skewed = recs[:2] + [step(3, 1.0, seconds=0.02), step(4, 1.0, seconds=0.18)] + recs[4:]
        self.assertTrue(g.judge_step_time(skewed, s).ok, "a CPU run's steps vary for real")
        c = g.judge_step_time(skewed, dict(s, device="cuda:0"))
        self.assertFalse(c.ok, c)
        self.assertIn("1 step(s) under half the median step (0.0200 s)", c.seen)
        self.assertFalse(g.judge_step_time([], s).ok)
        self.assertFalse(g.judge_step_time(recs, None).ok)

    def test_the_loader_trains_on_the_same_batches_and_records_its_wait(self):
        plain = [step(i, 2.0 - 0.1 * i) for i in range(1, 6)]
        ahead = [step(i, 2.0 - 0.1 * i, data_wait_seconds=0.001) for i in range(1, 6)]
        c = g.judge_loader(plain, ahead)
        self.assertTrue(c.ok, c)
        self.assertIn("5 steps, loss gap 0.0e+00", c.seen)
        off = [dict(r, loss=r["loss"] * (1 + 1e-6)) for r in ahead]
        self.assertFalse(g.judge_loader(plain, off).ok, "another batch is another loss")
        self.assertFalse(g.judge_loader(plain, plain).ok, "no data wait in the records")
        self.assertFalse(g.judge_loader(plain, ahead[:4]).ok)
        self.assertFalse(g.judge_loader([], []).ok)

    def test_a_step_that_waits_on_the_device_fails_naming_the_op(self):
        recs = [step(i, 1.0) for i in range(1, 9)]
        c = g.judge_step_syncs(0, "", recs, 8)
        self.assertTrue(c.ok, c)
        err = ("called a synchronizing CUDA operation\nException raised from warn_or_error_on_sync at x.cpp:160\n"
               "frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d\n"
               "frame #1: c10::cuda::warn_or_error_on_sync() + 0x10\n"
               "frame #2: at::native::copy_impl(at::Tensor&, at::Tensor const&, bool) + 0x1f\n")
        c = g.judge_step_syncs(101, err, recs[:3], 8)
        self.assertFalse(c.ok)
        self.assertIn("a synchronizing CUDA call after 3 step records", c.seen)
        self.assertIn("at::native::copy_impl", c.seen)
        self.assertFalse(g.judge_step_syncs(0, "", recs[:7], 8).ok, "every step recorded")

    def test_libtorch_warning_lines_fail_the_runs_they_are_in(self):
        w = "[W1126 10:00:00.123456789 Context.cpp:12] Warning: pin_memory's device argument is deprecated"
        self.assertEqual(g.warning_lines(f"memtrain: started\n  {w}\nWhich [W is not at the start\n"), [w])
        clean = [("a", "memtrain: done\n"), ("b", "")]
        self.assertTrue(g.judge_no_warnings(clean).ok)
        c = g.judge_no_warnings(clean + [("offload", f"{w}\n{w}\n")])
        self.assertFalse(c.ok)
        self.assertIn("2 in 1 of 3 runs (offload)", c.seen)
        self.assertIn("pin_memory", c.seen)
        self.assertFalse(g.judge_no_warnings([]).ok, "no run looked at is no verdict")

    def test_the_runner_keeps_memtrain_stderr_but_not_a_deterministic_runs(self):
        r = g.Runner("/bin/memtrain", sys.executable, tempfile.gettempdir(), budget=10, cmd_timeout=10)
        r.note_stderr("plain", ["/bin/memtrain", "run"], None, "x")
        r.note_stderr("torch", [sys.executable, "-c"], None, "y")
        r.note_stderr("twin", ["/bin/memtrain", "run"], g.DETERMINISTIC_ENV, "z")
        self.assertEqual(r.stderrs, [("plain", "x")])

    def test_the_new_rows_are_registered_with_the_warnings_row_last(self):
        keys = [c[0] for c in g.CHECKS]
        self.assertIn("twins", keys)
        self.assertIn("step_time", keys)
        self.assertEqual(keys[-1], "warnings")

    def test_every_check_has_its_row_in_the_docs(self):
        with open(os.path.join(g.ROOT, "docs", "gpu-check.md")) as f:
            documented = re.findall(r"^\| `([a-z_0-9]+)` \|", f.read(), re.M)
        self.assertEqual(sorted(documented), sorted(c[0] for c in g.CHECKS))


# A ViT small enough for a 2-core CPU, with the fields the checks fill in.
SMALL_VIT = g.VIT.replace("image_size = 64", "image_size = 16").replace("patch_size = 8", "patch_size = 4") \
    .replace("layers = 6", "layers = 2").replace("heads = 8", "heads = 2").replace("hidden_dim = 256", "hidden_dim = 32") \
    .replace("mlp_dim = 1024", "mlp_dim = 64").replace("batch_size = 32", "batch_size = 16")
# And a ResNet18 likewise: 32 px, 64 samples, micro-batch 16 (4 steps an epoch).
SMALL_RESNET = g.RESNET.replace("image_size = 128", "image_size = 32").replace("samples = 320", "samples = 64") \
    .replace("batch_size = 64", "batch_size = 16")


class Graphs(unittest.TestCase):
    """The CUDA-graph rows' judges on made-up records."""

    @staticmethod
    def graph(action, of="weights", micro_batch=8, reason=None):
        return {"type": "graph", "action": action, "of": of, "micro_batch": micro_batch, "micro_batches": 1,
                "reason": reason}

    def run_of(self, losses, *events, start="captured: ..."):
        return [{"type": "start", "cuda_graph": start}] + [step(i + 1, l) for i, l in enumerate(losses)] + list(events)

    def test_exact_means_bit_for_bit_and_every_step_kind_captured(self):
        eager = self.run_of([2.0, 1.5, 1.25])
        ok = self.run_of([2.0, 1.5, 1.25], self.graph("captured"))
        self.assertTrue(g.judge_graph_exact("mlp", eager, ok).ok)
        off_by_ulp = self.run_of([2.0, 1.5, 1.2500000000000002], self.graph("captured"))
        self.assertFalse(g.judge_graph_exact("mlp", eager, off_by_ulp).ok, "a last-bit difference fails")
        never = self.run_of([2.0, 1.5, 1.25], start="eager: why")
        c = g.judge_graph_exact("mlp", eager, never)
        self.assertFalse(c.ok)
        self.assertIn("eager: why", c.seen)
        self.assertFalse(g.judge_graph_exact("darts", eager, ok, ("weights", "architecture")).ok)
        both = ok + [self.graph("captured", of="architecture")]
        self.assertTrue(g.judge_graph_exact("darts", eager, both, ("weights", "architecture")).ok)

    def test_compared_jobs_step_at_rates_float32_holds(self):
        """"on" has every step read its learning rate from the device as float32, "off" hands the
        kernels a double: any other rate makes the two runs differ before anything is captured."""
        class Runner:
            def __init__(self, d):
                self.d = d

            def path(self, name):
                return os.path.join(self.d, name)

        def effective(spec, sets):
            with open(os.path.join(g.ROOT, spec), "rb") as f:
                t = tomllib.load(f)
            got = {"train.lr": t["train"].get("lr", 1e-3), "train.schedule": t["train"].get("schedule", "constant"),
                   "train.warmup_steps": t["train"].get("warmup_steps", 0)}
            if "darts" in t["model"]:
                got["model.darts.arch_lr"] = t["model"]["darts"].get("arch_lr", 3e-4)
            for s in sets:
                k, v = s.split("=", 1)
                if k in got:
                    got[k] = tomllib.loads(f"v = {v}")["v"]
            return got

        with tempfile.TemporaryDirectory() as d:
            jobs = g.graph_jobs(Runner(d)) + [("capture oom", g.DIGITS, g.GRAPH_MLP)]
            for model, spec, sets in jobs:
                got = effective(spec, sets)
                self.assertEqual(got["train.schedule"], "constant", model)
                # Every rate the compared steps take, the warm-up's included (as the schedule
                # computes it, in double), is one float32 holds.
                lr, warmup = got["train.lr"], got["train.warmup_steps"]
                rates = [lr * (k + 1) / warmup if k < warmup else lr for k in range(g.GRAPH_STEPS)]
                for v in rates + [got.get("model.darts.arch_lr", 0.0)]:
                    self.assertEqual(struct.unpack("f", struct.pack("f", v))[0], v, f"{model}: a rate of {v}")
                self.assertGreater(len(set(rates)), g.GRAPH_STEPS // 2, f"{model}: the rate changes across replays")

    def test_replays_hold_the_memory_the_capture_set_aside(self):
        def run(reserved, peaks=None):
            steps = [{"type": "step", "step": i + 1, "memory": {"reserved_bytes": r, "peak_reserved_bytes": p}}
                     for i, (r, p) in enumerate(zip(reserved, peaks or reserved))]
            return [{"type": "graph", "action": "captured", "of": "weights", "step": 2}] + steps

        flat = run([10, 20, 20, 20, 20])
        self.assertTrue(g.judge_graph_steady({"mlp": flat, "vit": flat}).ok)
        self.assertFalse(g.judge_graph_steady({"mlp": flat, "vit": run([10, 20, 20, 22, 22])}).ok, "grew")
        self.assertFalse(g.judge_graph_steady({"mlp": run([10, 20, 20, 20], [10, 20, 20, 24])}).ok, "a peak above")
        self.assertFalse(g.judge_graph_steady({"mlp": flat[1:]}).ok, "never captured: nothing judged")
        self.assertFalse(g.judge_graph_steady({}).ok, "nothing ran")
        short = g.judge_graph_steady({"mlp": flat, "resnet18": run([10, 20])})
        self.assertTrue(short.ok, short)
        self.assertIn("resnet18: 0 replays, not judged", short.seen)
        self.assertFalse(g.judge_graph_steady({"mlp": run([10, 20, 20, 20], [10, 20, 20, None])}).ok, "no reading")

    def test_a_capture_oom_runs_eager_with_its_records(self):
        eager = self.run_of([2.0, 1.5])
        why = "the capture ran out of memory (CUDA out of memory. Tried to allocate 4.00 TiB)"
        oom = {"type": "oom", "decision": {"action": "eager"}}
        self.assertTrue(g.judge_graph_capture_oom(eager, self.run_of([2.0, 1.5], self.graph("eager", reason=why),
                                                                     oom)).ok)
        self.assertFalse(g.judge_graph_capture_oom(eager, self.run_of([2.0, 1.5], self.graph("eager", reason=why))).ok,
                         "no oom record")
        self.assertFalse(g.judge_graph_capture_oom(eager, self.run_of([2.0, 1.5], self.graph("captured"), oom)).ok)
        other = self.graph("eager", reason="the capture failed: Other")
        self.assertFalse(g.judge_graph_capture_oom(eager, self.run_of([2.0, 1.5], other, oom)).ok,
                         "a failure that was no OOM")

    def test_a_failed_capture_runs_eager_bit_for_bit_without_an_oom(self):
        eager = self.run_of([2.0, 1.5, 1.25])
        why = "the capture failed: CUDA error: operation not permitted when stream is capturing"
        failed = self.graph("eager", reason=why)
        c = g.judge_graph_capture_failure(eager, self.run_of([2.0, 1.5, 1.25], failed))
        self.assertTrue(c.ok, c)
        self.assertIn("operation not permitted", c.seen)
        drift = self.run_of([2.0, 1.5, 1.2500001], failed)
        self.assertFalse(g.judge_graph_capture_failure(eager, drift).ok, "the eager steps after it drift")
        oom = self.graph("eager", reason="the capture ran out of memory (CUDA out of memory.)")
        self.assertFalse(g.judge_graph_capture_failure(eager, self.run_of([2.0, 1.5, 1.25], oom)).ok, "an OOM")
        answered = {"type": "oom", "decision": {"action": "eager"}}
        self.assertFalse(g.judge_graph_capture_failure(eager, self.run_of([2.0, 1.5, 1.25], failed, answered)).ok,
                         "an oom record")
        kept = self.run_of([2.0, 1.5, 1.25], failed, self.graph("captured"))
        self.assertFalse(g.judge_graph_capture_failure(eager, kept).ok, "captured after all")
        self.assertFalse(g.judge_graph_capture_failure(eager, self.run_of([2.0, 1.5, 1.25])).ok, "nothing said")

    def test_a_graph_kept_over_a_short_groups_eager_step_replays_bit_for_bit(self):
        def run(losses, samples, *events):
            return [{"type": "start", "cuda_graph": "captured: ..."}] + [
                step(i + 1, l, samples=n) for i, (l, n) in enumerate(zip(losses, samples))] + list(events)

        losses, samples = [2.0, 1.5, 1.25, 1.0, 0.9, 0.8, 0.7], [32, 32, 32, 32, 24, 32, 32]
        captured = dict(self.graph("captured"), step=4)
        eager = run(losses, samples)
        c = g.judge_graph_between(eager, run(losses, samples, captured))
        self.assertTrue(c.ok, c)
        self.assertIn("short group at step 5, 2 step(s) after it", c.seen)
        drift = run(losses[:-1] + [0.7000001], samples, captured)
        self.assertFalse(g.judge_graph_between(eager, drift).ok, "a replay after the short step drifts")
        self.assertFalse(g.judge_graph_between(eager, run(losses, samples)).ok, "never captured")
        again = run(losses, samples, captured, dict(self.graph("captured"), step=6))
        self.assertFalse(g.judge_graph_between(eager, again).ok, "captured anew after the short step")
        last = run(losses[:5], samples[:5], captured)
        self.assertFalse(g.judge_graph_between(run(losses[:5], samples[:5]), last).ok, "nothing replayed after it")
        early = run(losses, [32, 24, 32, 32, 32, 32, 32], captured)
        self.assertFalse(g.judge_graph_between(run(losses, [32, 24] + [32] * 5), early).ok, "short before the capture")

    def test_backoff_needs_the_smaller_shape_captured_twice(self):
        backoff = {"type": "oom", "decision": {"action": "backoff"}}
        twice = self.run_of([1.0], backoff, self.graph("captured", micro_batch=512),
                            {"type": "grow_back"}, backoff, self.graph("captured", micro_batch=512))
        self.assertTrue(g.judge_graph_backoff(twice, 1024).ok)
        once = self.run_of([1.0], backoff, self.graph("captured", micro_batch=512))
        self.assertFalse(g.judge_graph_backoff(once, 1024).ok)

    def test_declining_names_the_setting(self):
        said = "eager: memory.optimizer_state = \"host\" runs the update on the host"
        self.assertTrue(g.judge_graph_declines(self.run_of([1.0], start=said)).ok)
        self.assertFalse(g.judge_graph_declines(self.run_of([1.0], start="eager: the run is on the CPU")).ok)
        self.assertFalse(g.judge_graph_declines(self.run_of([1.0], self.graph("captured"), start=said)).ok)

    def test_a_resumed_captured_run_is_bit_for_bit_and_captures_again(self):
        whole = self.run_of([2.0, 1.5, 1.25, 1.0])
        cut = self.run_of([2.0, 1.5], self.graph("captured"))
        resumed = cut + [{"type": "start", "cuda_graph": "captured: ..."}, step(3, 1.25), step(4, 1.0),
                         self.graph("captured")]
        self.assertTrue(g.judge_graph_resume(whole, resumed, 130).ok)
        self.assertFalse(g.judge_graph_resume(whole, resumed, 0).ok, "not cut")
        drift = resumed[:-3] + [step(3, 1.2500001), step(4, 1.0), self.graph("captured")]
        self.assertFalse(g.judge_graph_resume(whole, drift, 130).ok)
        eager_after = resumed[:-1]
        self.assertFalse(g.judge_graph_resume(whole, eager_after, 130).ok, "no capture after the resume")

    def test_the_vit_l16_lora_row_needs_its_micro_batch_under_the_cap(self):
        steps = [dict(step(i + 1, 2.0 - i / 10), micro_batch=32) for i in range(3)]
        mem = {"memory": {"peak_reserved_bytes": 3 * GiB, "peak_allocated_bytes": 3 * GiB}}
        self.assertTrue(g.judge_vit_l16_lora(0, steps, mem, 4 * GiB).ok)
        self.assertFalse(g.judge_vit_l16_lora(0, steps, mem, 2 * GiB).ok, "over the cap")
        halved = steps + [dict(step(4, 1.5), micro_batch=16)]
        self.assertFalse(g.judge_vit_l16_lora(0, halved, mem, 4 * GiB).ok, "backed off")
        self.assertFalse(g.judge_vit_l16_lora(0, [dict(steps[0], loss=float("nan"))], mem, 4 * GiB).ok)

    def test_a_speed_row_fails_below_its_target_even_when_it_completes(self):
        def timed(seconds, *events):
            return [dict(step(i + 1, 1.0), seconds=seconds, samples=8) for i in range(10)] + list(events)
        eager, fast = timed(0.1), timed(0.04, self.graph("captured"))
        mem = {"memory": {"peak_reserved_bytes": GiB}}
        c = g.judge_graph_speed("x", eager, fast, mem, mem, 2.0)
        self.assertTrue(c.ok, c)
        self.assertIn("2.50x (target 2.00x)", c.seen)
        self.assertFalse(g.judge_graph_speed("x", eager, timed(0.08, self.graph("captured")), mem, mem, 2.0).ok)
        self.assertFalse(g.judge_graph_speed("x", eager, timed(0.04), mem, mem, 2.0).ok, "never captured")


class Offload(unittest.TestCase):
    def steps(self, losses, times=None, host=None):
        times = times or [float(i) for i in range(len(losses))]
        seconds = [times[0] or 1.0] + [b - a for a, b in zip(times, times[1:])]
        return [{"type": "step", "loss": l, "time": t, "seconds": d, "samples": 4, "host_update_seconds": host}
                for l, t, d in zip(losses, times, seconds)]

    def test_a_host_lever_passes_within_the_tolerance_under_the_cap_with_host_bytes(self):
        base = self.steps([2.0, 1.5, 1.2])
        summary = {"memory": {"peak_allocated_bytes": 100, "peak_host_bytes": 50}}
        c = g.judge_host_lever("state", base, self.steps([2.0, 1.5, 1.2 * (1 + 1e-6)]), summary, 200, "")
        self.assertTrue(c.ok, c)
        far = g.judge_host_lever("state", base, self.steps([2.0, 1.5, 1.3]), summary, 200, "")
        self.assertFalse(far.ok)
        over = g.judge_host_lever("state", base, base, summary, 50, "")
        self.assertFalse(over.ok)
        nothing_on_host = g.judge_host_lever("state", base, base, {"memory": {"peak_allocated_bytes": 1}}, 50, "")
        self.assertFalse(nothing_on_host.ok)
        warned = g.judge_host_lever("state", base, base, summary, 200,
                                    "ok\n[W1126 03:04:05.000 Memory.cpp:46] The argument 'device' is deprecated\n")
        self.assertFalse(warned.ok)
        self.assertIn("[W line", warned.seen)
        short = g.judge_host_lever("state", base, base, summary, 200, "", floor=51)
        self.assertFalse(short.ok)
        self.assertIn("at least 51 B", short.seen)

    def test_vit_parameters_count_torchvisions_vit(self):
        self.assertEqual(g.vit_parameters(dict(g.VIT_L16, num_classes=1000)), g.VIT_L16_PARAMETERS)
        tiny = {"image_size": 16, "patch_size": 4, "layers": 2, "heads": 2, "hidden_dim": 32, "mlp_dim": 64,
                "num_classes": 10}
        self.assertEqual(g.vit_parameters(tiny), 19626)

    def test_host_floor_holds_what_each_lever_must(self):
        p, act = 100, 1000
        self.assertEqual(g.host_floor({"optimizer_state"}, p, act), 800)
        self.assertEqual(g.host_floor({"gradients"}, p, act), 400)
        self.assertEqual(g.host_floor({"parameters"}, p, act), 400)
        self.assertEqual(g.host_floor({"activations"}, p, act), 1000)
        # The gradients and a block's input need not be on the host at once.
        self.assertEqual(g.host_floor({"optimizer_state", "gradients", "activations", "parameters"}, p, act), 2200)
        self.assertEqual(g.host_floor({"optimizer_state", "gradients", "activations", "parameters"}, p, 10), 1600)
        self.assertEqual(g.host_lever_floor(g.VIT, ['memory.gradients="host"'], ["train.batch_size=16"]),
                         4 * g.vit_parameters(tomllib.loads(g.VIT.format(device="cpu", dropout=0.0, samples=1,
                                                                          epochs=1))["model"]["vit"]))

    def test_wall_rate_sums_the_step_seconds_after_the_warm_up(self):
        records = self.steps([1, 1, 1, 1], times=[10.0, 11.0, 11.5, 12.0])
        self.assertAlmostEqual(g.wall_rate(records, 1), 12 / 2.0)
        self.assertIsNone(g.wall_rate(records, 4))
        # On CUDA a record is written once the next step is queued (the last at the run's end):
        # the steps' own seconds count, not the gaps between the records' times.
        late = [dict(r, seconds=1.0) for r in records]
        self.assertAlmostEqual(g.wall_rate(late, 1), 12 / 3.0)

    def test_the_language_model_rows_judge_what_they_claim(self):
        summary = {"device": g.DEVICE, "final": {"train_loss": 0.1, "train_perplexity": 1.1}}
        self.assertTrue(g.judge_llama_generate(0, summary, 0, "three four five six seven eight\n").ok)
        self.assertFalse(g.judge_llama_generate(0, summary, 0, "three four five six").ok, "stopped short")
        self.assertFalse(g.judge_llama_generate(0, dict(summary, device="elsewhere"), 0,
                                                "three four five six seven eight").ok, "not on the device")
        steps = [{"type": "step", "loss": 2.0, "seconds": 1.0}, {"type": "step", "loss": 1.9, "seconds": 1.1}]
        mem = {"memory": {"peak_reserved_bytes": 10 * g.GiB, "peak_allocated_bytes": 10 * g.GiB,
                          "peak_host_bytes": 16 * g.GiB}}
        self.assertTrue(g.judge_llama_streamed(0, steps, mem, 12 * g.GiB).ok)
        self.assertFalse(g.judge_llama_streamed(0, steps, mem, 8 * g.GiB).ok, "over the cap")
        nan = [dict(steps[0], loss=float("nan"))]
        self.assertFalse(g.judge_llama_streamed(0, nan, mem, 12 * g.GiB).ok, "a NaN loss")
        self.assertFalse(g.judge_llama_streamed(0, steps, {"memory": dict(mem["memory"], peak_host_bytes=0)},
                                                12 * g.GiB).ok, "nothing on the host: not streamed")
        full = g.judge_llama_full_1b(0, steps, mem, 12 * g.GiB)
        self.assertTrue(full.ok, full)
        self.assertIn("median step 1.1 s; losses fell", full.seen)
        self.assertIn("did not fall", g.judge_llama_full_1b(0, steps[::-1], mem, 12 * g.GiB).seen)
        self.assertFalse(g.judge_llama_full_1b(0, steps, mem, 4 * g.GiB).ok, "over the cap")
        self.assertFalse(g.judge_llama_full_1b(0, nan, mem, 12 * g.GiB).ok, "a NaN loss")
        self.assertFalse(g.judge_llama_full_1b(1, steps, mem, 12 * g.GiB).ok, "did not complete")
        self.assertTrue(g.judge_llama_streamed_generate(0, "1 2 3 4 | 17 9 9 250\n", 4).ok)
        self.assertFalse(g.judge_llama_streamed_generate(3, "", 4, "out of memory").ok, "out of memory")
        self.assertFalse(g.judge_llama_streamed_generate(0, "1 2 3 4 | 17 9\n", 4).ok, "stopped short")
        self.assertFalse(g.judge_llama_streamed_generate(0, "1 2 | 17 9 9 250\n", 4).ok, "not the prompt")

    def test_expandable_adds_the_setting_to_runs_and_fits_that_leave_the_allocator_alone(self):
        on = g.Runner("memtrain", "python3", "/tmp", 1, 1, expandable=True)
        self.assertEqual(on.with_expandable(["run", "s.toml"], None), ["run", "s.toml", "--set", g.EXPANDABLE])
        self.assertEqual(on.with_expandable(["fit", "s.toml"], None)[-1], g.EXPANDABLE)
        for args, env in ((["info", "--json"], None),
                          (["run", "s.toml", "--set", "memory.allocator.expandable_segments=false"], None),
                          (["run", "s.toml"], {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})):
            self.assertEqual(on.with_expandable(args, env), args, "left as the check wrote it")
        off = g.Runner("memtrain", "python3", "/tmp", 1, 1)
        self.assertEqual(off.with_expandable(["run", "s.toml"], None), ["run", "s.toml"])

    def test_the_language_model_speed_rows_judge_their_ratios(self):
        # The 8B shape (untied) streams its decoder layers and its input embedding: the published
        # 8,030,261,248 weights less the head (128256 x 4096) and the final norm, in bf16.
        self.assertEqual(g.streamed_bytes(g.LLAMA_8B), 2 * (8_030_261_248 - 128256 * 4096 - 4096))
        tied = dict(g.LLAMA_8B, tie_word_embeddings=True)
        self.assertEqual(g.streamed_bytes(tied), g.streamed_bytes(g.LLAMA_8B) - 2 * 128256 * 4096)
        steps = [{"type": "step", "seconds": s} for s in (9.0, 1.2, 1.0, 1.1)]
        # 2 x 10 GB at 20 GB/s: a floor of 1 s; the median step after the first, 1.1 s, is 1.10x.
        c = g.judge_llama_streamed_floor(steps, 10e9, 20.0)
        self.assertTrue(c.ok, c)
        self.assertIn("floor 1.000 s", c.seen)
        self.assertIn("= 1.10x (target <= 1.50x)", c.seen)
        self.assertFalse(g.judge_llama_streamed_floor(steps, 10e9, 50.0).ok, "2.75x the floor")
        unmeasured = g.judge_llama_streamed_floor(steps, 10e9, None)
        self.assertFalse(unmeasured.ok)
        self.assertIn("bandwidth not measured", unmeasured.seen)
        self.assertFalse(g.judge_llama_streamed_floor(steps[:1], 10e9, 20.0).ok, "no step after the first")
        twin = self.steps([1] * 4, times=[0.0, 1.0, 2.0, 3.0])
        capped = self.steps([1] * 4, times=[0.0, 1.2, 2.4, 3.6])
        c = g.judge_llama_1b_speed(0, twin, capped)
        self.assertTrue(c.ok, c)
        self.assertIn("0.83x (target 0.80x)", c.seen)
        slow = self.steps([1] * 4, times=[0.0, 2.0, 4.0, 6.0])
        self.assertFalse(g.judge_llama_1b_speed(0, twin, slow).ok, "0.50x: completing is not passing")
        self.assertFalse(g.judge_llama_1b_speed(3, [], capped).ok, "the twin did not run")

    def test_speed_rows_print_the_ratio_and_the_host_bandwidth(self):
        base = self.steps([1] * 4, times=[0.0, 1.0, 2.0, 3.0])
        host = self.steps([1] * 4, times=[0.0, 2.0, 4.0, 6.0], host=0.5)
        summary = {"memory": {"peak_allocated_bytes": 10}}
        c = g.judge_offload_speed("x", base, host, summary, 20, 1, 0.4, 1_000_000_000)
        self.assertTrue(c.ok, c)
        self.assertIn("0.50x (target 0.40x)", c.seen)
        self.assertIn("host update 56.0 GB/s", c.seen)
        self.assertFalse(g.judge_offload_speed("x", base, host, summary, 5, 1, 0.4, 1).ok)
        # Completing is not passing: a ratio under the target fails the row.
        slow = g.judge_offload_speed("x", base, host, summary, 20, 1, 0.6, 1_000_000_000)
        self.assertFalse(slow.ok, slow)
        self.assertIn("0.50x (target 0.60x)", slow.seen)


@unittest.skipUnless(os.environ.get("MEMTRAIN_BIN"), "MEMTRAIN_BIN names no built memtrain")
class Rehearsal(unittest.TestCase):
    """The runner and judges against this build, on the CPU: the checks whose meaning survives
    the move (CUDA's own figures are not there to compare with)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.r = g.Runner(os.environ["MEMTRAIN_BIN"], sys.executable, self.tmp.name, budget=300, cmd_timeout=240)
        self.saved = (g.DEVICE, g.VIT, g.RESNET, g.TWINS, g.STATIC_BILL_MLP)
        g.DEVICE, g.VIT, g.RESNET = "cpu", SMALL_VIT, SMALL_RESNET
        g.TWINS = [("darts", "darts_tiny"), ("vit", "vit")]
        g.STATIC_BILL_MLP = (2048, 4096)  # P = 32 MiB, the bill of tests/it/oom.rs's static_bill()

    def tearDown(self):
        g.DEVICE, g.VIT, g.RESNET, g.TWINS, g.STATIC_BILL_MLP = self.saved
        self.tmp.cleanup()

    def rows(self, fn):
        rows = fn(self.r, {})
        self.assertTrue(rows)
        return rows

    def test_a_nan_in_a_mapped_set_is_named(self):
        (c,) = self.rows(g.check_resident_nan)
        self.assertTrue(c.ok, c)

    def test_a_fine_tune_with_frozen_layers_and_groups_evaluates_to_its_own_figures(self):
        (c,) = self.rows(g.check_finetune)
        self.assertTrue(c.ok, c)

    def test_a_small_vit_lora_with_a_bf16_base_trains_under_its_cap(self):
        small = dict(image_size=32, patch_size=8, layers=2, heads=2, hidden_dim=32, mlp_dim=64)
        (c,) = g.check_vit_l16_lora(self.r, {}, vit=small, batch=8, cap=256 << 20)
        self.assertTrue(c.ok, c)

    def test_auto_beside_a_host_lever_runs_eager_and_names_it(self):
        (c,) = self.rows(g.check_graph_declines)
        self.assertTrue(c.ok, c)

    def test_a_small_decoder_trains_and_continues_its_sentence(self):
        (c,) = self.rows(g.check_llama_generate)
        self.assertTrue(c.ok, c)

    def test_a_lora_decoder_streams_its_base_under_the_cap(self):
        saved = g.LLAMA_8B
        g.LLAMA_8B = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          seq_len=32, cap=64 << 20, steps=3)
        try:
            trained, generated, floor = self.rows(g.check_llama_streamed)
        finally:
            g.LLAMA_8B = saved
        self.assertTrue(trained.ok, trained)
        self.assertTrue(generated.ok, generated)
        # No CUDA here: the step is timed, the bandwidth cannot be, and the row says so.
        self.assertIn("median step", floor.seen)
        self.assertIn("bandwidth not measured", floor.seen)

    def test_a_full_fine_tune_streams_its_layers_under_the_cap(self):
        saved = g.LLAMA_1B
        g.LLAMA_1B = dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          seq_len=64, cap=2 << 20, steps=3)
        try:
            c, speed = self.rows(g.check_llama_full_1b)
        finally:
            g.LLAMA_1B = saved
        self.assertTrue(c.ok, c)
        # The uncapped twin ran and the ratio was taken (its target is a GPU's, not this CPU's).
        self.assertIn("samples/s =", speed.seen)

    def test_the_graph_failure_and_between_rows_get_past_their_runs(self):
        """Nothing is captured on the CPU, so the rows fail here, but only at their judges: the
        specs, settings and test hook they hand the GPU machine are accepted by this build."""
        for fn in (g.check_graph_capture_failure, g.check_graph_between):
            (c,) = self.rows(fn)
            self.assertFalse(c.ok, c)
            self.assertIn("steps, losses equal the eager run's", c.seen)

    def test_fp16_inf(self):
        (c,) = self.rows(g.check_fp16_inf)
        self.assertTrue(c.ok, c)

    def test_one_rank_gloo_group(self):
        (c,) = self.rows(g.check_single_rank)
        self.assertEqual(c.name, "Gloo one-rank group")
        self.assertTrue(c.ok, c)

    def test_a_capped_one_rank_gloo_group_backs_off(self):
        (c,) = self.rows(g.check_group_oom)
        self.assertEqual(c.name, "Gloo group backs off")
        self.assertTrue(c.ok, c)

    def test_a_static_bill_offloads_or_stops_with_advice_that_works(self):
        rows = self.rows(g.check_static_bill) + self.rows(g.check_advice_resume)
        self.assertEqual([c.name for c in rows], [g.STATIC_OFFLOAD, g.STATIC_ADVICE, g.ADVICE_RESUME])
        for c in rows:
            self.assertTrue(c.ok, c)

    def test_an_oom_inside_a_gloo_collective(self):
        (c,) = self.rows(g.check_collective_oom)
        self.assertEqual(c.name, "Gloo collective OOM")
        self.assertTrue(c.ok, c)

    def test_resume_restores_the_generator(self):
        (c,) = self.rows(g.check_resume)
        self.assertTrue(c.ok, c)
        self.assertIn("rng/cpu", c.seen)

    def test_host_reads_pass_or_say_the_counter_is_missing(self):
        for c in self.rows(g.check_host_reads):
            self.assertTrue(c.ok or "binary has no host-read counter" in c.seen, c)

    def test_optimizers_pass_or_say_the_key_is_missing(self):
        rows = self.rows(g.check_optimizers)
        self.assertEqual([c.name for c in rows], [f"optimizer {i}" for i, _ in g.OPTIMIZER_IMPLS])
        for c in rows:
            if c.name == "optimizer fused":
                continue  # torch.optim's fused AdamW on the CPU is not what the GPU check compares
            self.assertTrue(c.ok or "binary has no train.optimizer_impl" in c.seen, c)

    def test_bn_retry_on_the_cpu(self):
        # At 32 px the weights' state outweighs the activations unless the stem keeps them large;
        # at 128 px on a GPU the activations dominate as they are.
        g.RESNET = SMALL_RESNET.replace("image_size = 32", "image_size = 32\nsmall_stem = true")
        (c,) = self.rows(g.check_bn_retry)
        self.assertTrue(c.ok, c)
        self.assertIn("1 backoff(s), micro-batch 64 -> 32", c.seen)

    def test_host_levers_match_the_all_device_run(self):
        for c in self.rows(g.check_host_levers):
            self.assertTrue(c.ok, c)

    def test_twins_agree_on_the_cpu(self):
        rows = self.rows(g.check_twins)
        self.assertEqual([c.name for c in rows], ["CPU vs PyTorch darts", "CPU vs PyTorch vit"])
        for c in rows:
            self.assertTrue(c.ok, c)

    def test_step_seconds_add_up_and_no_run_warns(self):
        c, requested = self.rows(g.check_step_time)
        self.assertTrue(c.ok, c)
        # The CPU's counting allocator keeps no requested figure: the CUDA-only row says so.
        self.assertFalse(requested.ok, requested)
        self.assertEqual([n for n, _ in self.r.stderrs], ["step-time"], "the run's stderr was kept")
        (w,) = self.rows(g.check_no_warnings)
        self.assertTrue(w.ok, w)

    def test_the_budget_stops_what_it_no_longer_covers(self):
        self.r.deadline = 0
        rows = g.run_checks(self.r, {}, {"backoff", "recompute"}, log=lambda m: None)
        self.assertEqual([c.name for c in rows], ["OOM backoff (1 GiB cap)", "recompute resnet18", "recompute vit"])
        self.assertTrue(all("not run: the time budget" in c.seen for c in rows), rows)


if __name__ == "__main__":
    unittest.main()
