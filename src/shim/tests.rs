use super::*;

#[test]
fn a_device_uuid_is_written_as_nvml_writes_it() {
    let f = CudaDeviceFacts {
        total_bytes: 0,
        uuid: [
            0x5a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x71, 0x82, 0x93, 0xa4, 0xb5, 0xc6, 0xd7, 0xe8, 0xf9,
        ],
    };
    assert_eq!(f.nvml_uuid(), "GPU-5a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9");
}

#[test]
fn backtrace_is_cut_from_errors() {
    let msg = "CUDA out of memory. Tried to allocate 2 GiB\nException raised from malloc at x.cpp:1";
    assert_eq!(first_line(msg), "CUDA out of memory. Tried to allocate 2 GiB");
    let cpu = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory\nframe #0: c10::ThrowEnforceNotMet";
    assert_eq!(
        first_line(cpu),
        "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"
    );
}

#[test]
fn versions_name_libtorch_2_11() {
    assert_eq!(versions().libtorch, "2.11.0");
}

#[test]
fn cpu_only_answers_are_clean() {
    if accelerator_available() {
        return; // the CPU answers below are what this test is about
    }
    assert_eq!(device_count().unwrap(), 0);
    assert_eq!(device_stats(0).unwrap(), None);
    assert_eq!(memory_info(0).unwrap(), None);
    assert!(!empty_cache().unwrap());
    assert!(!reset_peak_stats(0).unwrap());
    assert!(!synchronize(0).unwrap());
    let err = memory_snapshot().unwrap_err().to_string();
    assert!(err.contains("needs a CUDA device"), "{err}");
}

#[test]
fn autocast_casts_matmuls_on_the_cpu_and_restores_the_state() {
    use tch::{kind::FLOAT_CPU, Device, Kind, Tensor};
    let a = Tensor::ones([2, 2], FLOAT_CPU);
    for dtype in [Kind::BFloat16, Kind::Half] {
        {
            let _g = Autocast::enter(Device::Cpu, dtype).unwrap();
            assert!(autocast_enabled(Device::Cpu));
            assert_eq!(a.matmul(&a).kind(), dtype);
        }
        assert!(!autocast_enabled(Device::Cpu));
        assert_eq!(a.matmul(&a).kind(), Kind::Float);
    }
}

#[test]
fn generator_state_round_trips() {
    use tch::{kind::FLOAT_CPU, Device, Tensor};
    let s = rng_state(Device::Cpu).unwrap();
    let a = Tensor::randn([8], FLOAT_CPU);
    set_rng_state(Device::Cpu, &s).unwrap();
    let b = Tensor::randn([8], FLOAT_CPU);
    assert!(a.equal(&b), "the same state draws the same numbers");
}
