//! The counting CPU allocator. Its cap is process-wide and its counts must be exact, so no other
//! test may allocate while it runs: the test runs alone, in a process of its own.
use crate::common::alone;

#[test]
fn the_counting_allocator_counts_caps_and_recovers() {
    alone(
        "cpu_allocator::the_counting_allocator_counts_caps_and_recovers",
        counts_caps_and_recovers,
    );
}

fn counts_caps_and_recovers() {
    use memtrain::shim::*;
    use tch::{kind::FLOAT_CPU, Tensor};
    cpu_alloc_install().unwrap();
    cpu_alloc_install().unwrap();
    assert!(cpu_alloc_stats().installed);

    let t = Tensor::zeros([1 << 20], FLOAT_CPU); // 4 MiB
    let s = cpu_alloc_stats();
    assert_eq!(s.allocated, 4 << 20, "only this test allocates: the count is exact");
    assert!(s.allocated >= 4 << 20 && s.peak_allocated >= s.allocated, "{s:?}");
    drop(t);
    assert_eq!(cpu_alloc_stats().allocated, 0, "every byte comes back");
    // A cap below what one more 64 MiB tensor needs: a clean, classified error, no abort.
    let before = cpu_alloc_stats();
    cpu_alloc_set_cap(Some(before.allocated + (1 << 20)));
    let r = Tensor::f_zeros([16 << 20], FLOAT_CPU);
    cpu_alloc_set_cap(None);
    let e = r.expect_err("64 MiB must not fit under a 1 MiB margin").to_string();
    assert!(e.contains("CPU out of memory"), "{e}");
    assert!(cpu_alloc_stats().num_ooms > before.num_ooms);
    // No cap: the same allocation succeeds, and its bytes come back when it is dropped.
    let big = Tensor::zeros([16 << 20], FLOAT_CPU);
    assert!(cpu_alloc_stats().peak_allocated >= 64 << 20);
    drop(big);
    // raw_allocate/raw_deallocate paths (e.g. from_slice copies) still work.
    let v = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
    assert_eq!(v.sum(tch::Kind::Float).double_value(&[]), 6.0);
}
