//! `memtrain info`: versions, host memory, GPUs and who holds their memory, allocator settings.
use serde::Serialize;

use crate::human::human_bytes;
use crate::{alloc_conf, shim, sysmem};

/// The `info --json` object. Its field names are a stable interface (documented in README).
#[derive(Debug, Serialize)]
pub struct Info {
    pub memtrain: String,
    pub libtorch: String,
    pub cuda: CudaInfo,
    pub cpu: CpuInfo,
    pub host: HostInfo,
    pub gpus: Vec<GpuInfo>,
    pub allocator: alloc_conf::EnvSettings,
    pub data_parallel: DataParallelInfo,
}

#[derive(Debug, Serialize)]
pub struct CudaInfo {
    /// Whether libtorch can use a CUDA device in this process.
    pub available: bool,
    pub device_count: usize,
    /// CUDA runtime libtorch was built with, e.g. "13.0"; null for a CPU-only libtorch.
    pub runtime: Option<String>,
    pub cudnn: Option<String>,
    /// NVIDIA driver version from NVML; null without a driver.
    pub driver: Option<String>,
}

/// The c10d backends this binary was built with: Gloo for the CPU, NCCL for CUDA.
#[derive(Debug, Serialize)]
pub struct DataParallelInfo {
    pub gloo: bool,
    pub nccl: bool,
}

#[derive(Debug, Serialize)]
pub struct CpuInfo {
    pub logical_cpus: usize,
    pub torch_threads: i32,
}

#[derive(Debug, Serialize)]
pub struct HostInfo {
    pub ram_total_bytes: u64,
    pub ram_available_bytes: u64,
    pub process_rss_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct GpuInfo {
    pub index: usize,
    pub name: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub used_bytes: u64,
    /// Processes holding memory on this GPU (NVML); empty when NVML is unavailable.
    pub processes: Vec<GpuProcess>,
}

#[derive(Debug, Serialize)]
pub struct GpuProcess {
    pub pid: u32,
    pub name: String,
    /// null where the driver does not report per-process usage.
    pub used_bytes: Option<u64>,
}

/// NVML's library names, in the order tried: driver-only machines and containers install only
/// the versioned `.so.1` (the unversioned name comes with the development package).
const NVML_LIBS: [&str; 2] = ["libnvidia-ml.so.1", "libnvidia-ml.so"];

fn nvml() -> Option<nvml_wrapper::Nvml> {
    NVML_LIBS.iter().find_map(|lib| {
        nvml_wrapper::Nvml::builder()
            .lib_path(std::ffi::OsStr::new(lib))
            .init()
            .ok()
    })
}

pub fn collect() -> anyhow::Result<Info> {
    let v = shim::versions();
    let host = sysmem::host_memory()?;
    let available = shim::accelerator_available();
    let device_count = if available { shim::device_count()? } else { 0 };
    let nvml = nvml();
    let gpus = match &nvml {
        Some(n) => nvml_gpus(n, device_count),
        None => shim_gpus(device_count),
    };
    Ok(Info {
        memtrain: env!("CARGO_PKG_VERSION").into(),
        libtorch: v.libtorch,
        cuda: CudaInfo {
            available,
            device_count,
            runtime: v.cuda,
            cudnn: v.cudnn,
            driver: nvml.as_ref().and_then(|n| n.sys_driver_version().ok()),
        },
        cpu: CpuInfo {
            logical_cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            torch_threads: tch::get_num_threads(),
        },
        host: HostInfo {
            ram_total_bytes: host.ram_total_bytes,
            ram_available_bytes: host.ram_available_bytes,
            process_rss_bytes: sysmem::rss().0,
        },
        gpus,
        allocator: alloc_conf::EnvSettings::from_env(),
        data_parallel: {
            let b = shim::dist::backends();
            DataParallelInfo {
                gloo: b.gloo,
                nccl: b.nccl,
            }
        },
    })
}

/// Device memory this process holds on `cuda:index` as the driver counts it (context, library
/// workspaces and the caching allocator's reservations together); None without NVML or when
/// the driver does not report it (some containers).
pub fn process_device_bytes(index: usize) -> Option<u64> {
    let n = nvml()?;
    let uuid = shim::cuda_device_facts(index).ok().flatten()?.nvml_uuid();
    let d = n.device_by_uuid(uuid).ok()?;
    let me = std::process::id();
    let p = d.running_compute_processes().ok()?.into_iter().find(|p| p.pid == me)?;
    used_bytes(&p)
}

/// A process's device memory as NVML reports it; None where the driver does not say.
fn used_bytes(p: &nvml_wrapper::struct_wrappers::device::ProcessInfo) -> Option<u64> {
    match p.used_gpu_memory {
        nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
        nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
    }
}

/// NVML's devices in CUDA's order, matched by UUID: NVML numbers every GPU of the machine in
/// PCI order and ignores CUDA_VISIBLE_DEVICES, so its index 0 need not be the `cuda:0` a spec
/// names. Without CUDA in this process (or when a UUID cannot be matched), NVML's own order.
fn cuda_ordered(n: &nvml_wrapper::Nvml, cuda_devices: usize) -> Vec<(usize, nvml_wrapper::Device<'_>)> {
    let matched: Option<Vec<_>> = (0..cuda_devices)
        .map(|i| {
            let facts = shim::cuda_device_facts(i).ok().flatten()?;
            n.device_by_uuid(facts.nvml_uuid()).ok().map(|d| (i, d))
        })
        .collect();
    match matched {
        Some(m) if cuda_devices > 0 => m,
        _ => (0..n.device_count().unwrap_or(0))
            .filter_map(|i| n.device_by_index(i).ok().map(|d| (i as usize, d)))
            .collect(),
    }
}

fn nvml_gpus(n: &nvml_wrapper::Nvml, cuda_devices: usize) -> Vec<GpuInfo> {
    cuda_ordered(n, cuda_devices)
        .into_iter()
        .filter_map(|(i, d)| {
            let mem = d.memory_info().ok()?;
            let mut procs = d.running_compute_processes().unwrap_or_default();
            procs.extend(d.running_graphics_processes().unwrap_or_default());
            procs.sort_by_key(|p| p.pid);
            procs.dedup_by_key(|p| p.pid);
            Some(GpuInfo {
                index: i,
                name: d.name().unwrap_or_else(|_| "unknown".into()),
                total_bytes: mem.total,
                free_bytes: mem.free,
                used_bytes: mem.used,
                processes: procs
                    .into_iter()
                    .map(|p| GpuProcess {
                        pid: p.pid,
                        name: std::fs::read_to_string(format!("/proc/{}/comm", p.pid))
                            .map(|s| s.trim().to_owned())
                            .unwrap_or_else(|_| "?".into()),
                        used_bytes: used_bytes(&p),
                    })
                    .collect(),
            })
        })
        .collect()
}

/// Without NVML: what libtorch itself can tell (no names, no processes).
fn shim_gpus(count: usize) -> Vec<GpuInfo> {
    (0..count)
        .filter_map(|i| {
            let (free, total) = shim::memory_info(i).ok()??;
            Some(GpuInfo {
                index: i,
                name: format!("CUDA device {i}"),
                total_bytes: total,
                free_bytes: free,
                used_bytes: total - free,
                processes: vec![],
            })
        })
        .collect()
}

pub fn print_human(i: &Info) {
    println!("memtrain {}  libtorch {}", i.memtrain, i.libtorch);
    println!(
        "CUDA runtime {}  cuDNN {}  driver {}",
        i.cuda.runtime.as_deref().unwrap_or("none"),
        i.cuda.cudnn.as_deref().unwrap_or("none"),
        i.cuda.driver.as_deref().unwrap_or("none"),
    );
    println!(
        "CPU: {} logical CPUs, libtorch uses {} threads",
        i.cpu.logical_cpus, i.cpu.torch_threads
    );
    println!(
        "Host RAM: {} total, {} available; this process {} RSS",
        human_bytes(i.host.ram_total_bytes),
        human_bytes(i.host.ram_available_bytes),
        human_bytes(i.host.process_rss_bytes)
    );
    if i.gpus.is_empty() {
        println!("GPUs: none available to libtorch (memtrain will train on the CPU)");
    }
    for g in &i.gpus {
        println!(
            "GPU {}: {}  {} total, {} used, {} free",
            g.index,
            g.name,
            human_bytes(g.total_bytes),
            human_bytes(g.used_bytes),
            human_bytes(g.free_bytes)
        );
        for p in &g.processes {
            let used = p.used_bytes.map(human_bytes).unwrap_or_else(|| "unknown".into());
            println!("  pid {} ({}): {}", p.pid, p.name, used);
        }
    }
    let built = |on: bool| if on { "built" } else { "not built" };
    println!(
        "Data-parallel: Gloo (CPU) {}, NCCL (CUDA) {}",
        built(i.data_parallel.gloo),
        built(i.data_parallel.nccl)
    );
    let a = &i.allocator;
    let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "(unset)".into());
    println!(
        "Allocator: PYTORCH_CUDA_ALLOC_CONF={}  PYTORCH_ALLOC_CONF={}",
        show(&a.cuda_alloc_conf),
        show(&a.alloc_conf)
    );
}
