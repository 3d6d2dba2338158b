use super::{Bound, Remedy, CHANGE_MODEL, CHANGE_RESUME};
use crate::human::few;

fn bound(message: &str) -> Bound {
    Bound::of(crate::oom::classify(message), message)
}

#[test]
fn a_cuda_oom_is_bound_by_the_cap_only_when_libtorch_says_what_it_allowed() {
    // An H100's message under memtrain's cap (per_process_memory_fraction), and without one.
    let capped = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.18 GiB \
                  of which 77.86 GiB is free. Including non-PyTorch memory, this process has 1.31 GiB memory \
                  in use. 657.09 MiB allowed; Of the allocated memory 600.00 MiB is allocated by PyTorch";
    assert_eq!(bound(capped), Bound::Cap);
    assert_eq!(bound(&capped.replace(" 657.09 MiB allowed;", "")), Bound::Device("GPU"));
    let text = |r: &Remedy, b| r.text(b);
    assert!(text(&CHANGE_MODEL, Bound::Cap)
        .starts_with("raise memory.limit (memory.fraction on a GPU), or use a smaller model"));
    assert!(text(&CHANGE_MODEL, Bound::Device("GPU"))
        .starts_with("no memory.limit bound it, so the GPU's own memory ran out: end what other processes hold there"));
    let async_cap = "CUDA out of memory: Allocation on device 0 would exceed allowed memory. (out of memory)";
    assert_eq!(bound(async_cap), Bound::Cap);
    let cpu = "CPU out of memory: can't allocate memory: tried to allocate 1.00 MiB with 2.00 MiB of tensors \
               already allocated under the run's 3.00 MiB cap (memory.limit / memory.fraction)";
    assert_eq!(bound(cpu), Bound::Cap);
    let malloc = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 16000000000064 bytes.";
    assert_eq!(bound(malloc), Bound::Device("machine"), "a cap set but not reached");
    assert_eq!(
        text(&CHANGE_RESUME, Bound::Cap),
        "the checkpoint is untouched: raise memory.limit (memory.fraction on a GPU); then run --resume again"
    );
}

#[test]
fn few_names_and_a_count_of_the_rest() {
    assert_eq!(few(&["a", "b"], ", "), "a, b");
    let many: Vec<String> = (0..11).map(|i| format!("n{i}")).collect();
    assert_eq!(
        few(&many, "; "),
        "n0; n1; n2; n3; n4; n5; n6; n7; … and 3 more (11 in all)"
    );
}
