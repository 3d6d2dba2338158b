//! `memtrain info`: versions, host memory, GPUs and who holds their memory, allocator settings.
use serde::Serialize;

use crate::human::human_bytes;
use crate::procs::{Proc, Stale};
use crate::{alloc_conf, registry, shim, sysmem};

/// The `info --json` object. Its field names are a stable interface (documented in docs/outputs.md).
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
    /// The memtrain runs (and data-parallel ranks) running now, from the registry.
    pub runs: Vec<RunProcess>,
}

/// A running memtrain process, as it registered itself.
#[derive(Debug, Clone, Serialize)]
pub struct RunProcess {
    pub pid: u32,
    pub rank: Option<usize>,
    pub job: String,
    pub run_dir: std::path::PathBuf,
    pub device: String,
    pub launcher_pid: u32,
    /// "stopped", "zombie" or "orphaned" (its launcher has gone); null for a healthy run.
    pub stale: Option<Stale>,
}

impl From<&registry::Entry> for RunProcess {
    fn from(e: &registry::Entry) -> Self {
        RunProcess {
            pid: e.pid,
            rank: e.rank,
            job: e.job.clone(),
            run_dir: e.run_dir.clone(),
            device: e.device.clone(),
            launcher_pid: e.launcher_pid,
            stale: e.stale(),
        }
    }
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
    /// The GPU's busy percentage over the driver's last sample period; null where NVML does not say.
    pub utilization_percent: Option<u32>,
    /// Processes holding memory on this GPU (NVML); empty when NVML is unavailable.
    pub processes: Vec<GpuProcess>,
}

#[derive(Debug, Serialize)]
pub struct GpuProcess {
    pub pid: u32,
    pub name: String,
    /// null where the driver does not report per-process usage.
    pub used_bytes: Option<u64>,
    /// The owner's login name; null when the process is not visible (another PID namespace).
    pub user: Option<String>,
    /// Why its memory is probably held for nothing: "stopped" (state T), "zombie" (Z), or
    /// "orphaned" (a memtrain run whose launcher has gone); null otherwise.
    pub stale: Option<Stale>,
}

impl GpuProcess {
    fn new(pid: u32, used_bytes: Option<u64>, runs: &[registry::Entry]) -> Self {
        let p = Proc::read(pid);
        let run = runs.iter().find(|e| e.pid == pid);
        GpuProcess {
            pid,
            name: p.as_ref().map_or_else(|| "?".into(), |p| p.name.clone()),
            used_bytes,
            user: p.as_ref().map(Proc::user),
            stale: match (p.as_ref().and_then(Proc::state), run) {
                (Some(s), _) => Some(s),
                (None, Some(e)) => e.orphaned().then_some(Stale::Orphaned),
                (None, None) => None,
            },
        }
    }
}

/// NVML's library names, in the order tried: driver-only machines and containers install only
/// the versioned `.so.1` (the unversioned name comes with the development package).
const NVML_LIBS: [&str; 2] = ["libnvidia-ml.so.1", "libnvidia-ml.so"];

pub(crate) fn nvml() -> Option<nvml_wrapper::Nvml> {
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
    let runs = registry::live();
    let gpus = match &nvml {
        Some(n) => nvml_gpus(n, device_count, &runs),
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
        runs: runs.iter().map(RunProcess::from).collect(),
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

/// Every GPU NVML sees, in its own order, without starting CUDA in this process (which would
/// itself take memory on each card): what `watch` and `clean` show.
pub fn gpus_without_cuda(n: &nvml_wrapper::Nvml, runs: &[registry::Entry]) -> Vec<GpuInfo> {
    nvml_gpus(n, 0, runs)
}

fn nvml_gpus(n: &nvml_wrapper::Nvml, cuda_devices: usize, runs: &[registry::Entry]) -> Vec<GpuInfo> {
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
                utilization_percent: d.utilization_rates().ok().map(|u| u.gpu),
                processes: procs
                    .into_iter()
                    .map(|p| GpuProcess::new(p.pid, used_bytes(&p), runs))
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
                utilization_percent: None,
                processes: vec![],
            })
        })
        .collect()
}

/// "  [STALE: stopped ...]" after a process that holds memory for nothing; `clean` ends them.
pub fn stale_note(s: Option<Stale>) -> String {
    match s {
        None => String::new(),
        Some(Stale::Stopped) => "  [STALE: stopped (state T); `kill -CONT` or `memtrain clean --pid`]".into(),
        Some(Stale::Zombie) => "  [STALE: zombie (state Z); its parent has not reaped it]".into(),
        Some(Stale::Orphaned) => "  [STALE: orphaned, its launcher has gone; `memtrain clean` ends it]".into(),
    }
}

pub fn print_human(i: &Info) -> anyhow::Result<()> {
    crate::outln!("memtrain {}  libtorch {}", i.memtrain, i.libtorch)?;
    crate::outln!(
        "CUDA runtime {}  cuDNN {}  driver {}",
        i.cuda.runtime.as_deref().unwrap_or("none"),
        i.cuda.cudnn.as_deref().unwrap_or("none"),
        i.cuda.driver.as_deref().unwrap_or("none"),
    )?;
    crate::outln!(
        "CPU: {} logical CPUs, libtorch uses {} threads",
        i.cpu.logical_cpus,
        i.cpu.torch_threads
    )?;
    crate::outln!(
        "Host RAM: {} total, {} available; this process {} RSS",
        human_bytes(i.host.ram_total_bytes),
        human_bytes(i.host.ram_available_bytes),
        human_bytes(i.host.process_rss_bytes)
    )?;
    if i.gpus.is_empty() {
        crate::outln!("GPUs: none available to libtorch (memtrain will train on the CPU)")?;
    }
    for g in &i.gpus {
        crate::outln!(
            "GPU {}: {}  {} total, {} used, {} free",
            g.index,
            g.name,
            human_bytes(g.total_bytes),
            human_bytes(g.used_bytes),
            human_bytes(g.free_bytes)
        )?;
        for p in &g.processes {
            let used = p.used_bytes.map(human_bytes).unwrap_or_else(|| "unknown".into());
            let user = p.user.as_deref().unwrap_or("?");
            crate::outln!("  pid {} ({}, {user}): {}{}", p.pid, p.name, used, stale_note(p.stale))?;
        }
    }
    if i.runs.is_empty() {
        crate::outln!("memtrain runs: none running (registry {})", registry::dir().display())?;
    } else {
        crate::outln!("memtrain runs (registry {}):", registry::dir().display())?;
    }
    for r in &i.runs {
        let rank = r.rank.map(|r| format!(" rank {r}")).unwrap_or_default();
        crate::outln!(
            "  pid {}{rank}: job {} on {}, {}{}",
            r.pid,
            r.job,
            r.device,
            r.run_dir.display(),
            stale_note(r.stale)
        )?;
    }
    let built = |on: bool| if on { "built" } else { "not built" };
    crate::outln!(
        "Data-parallel: Gloo (CPU) {}, NCCL (CUDA) {}",
        built(i.data_parallel.gloo),
        built(i.data_parallel.nccl)
    )?;
    let a = &i.allocator;
    let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "(unset)".into());
    crate::outln!(
        "Allocator: PYTORCH_CUDA_ALLOC_CONF={}  PYTORCH_ALLOC_CONF={}",
        show(&a.cuda_alloc_conf),
        show(&a.alloc_conf)
    )?;
    Ok(())
}
