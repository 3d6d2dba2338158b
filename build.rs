//! Compiles the C++ shim and fixes the link flags that tch's own build script cannot pass on.
use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/shim/shim.cpp");
    println!("cargo:rerun-if-changed=src/shim/cuda.cpp");
    println!("cargo:rerun-if-changed=src/shim/graph.cpp");
    println!("cargo:rerun-if-changed=src/shim/dist.cpp");
    println!("cargo:rerun-if-changed=src/shim/guard.h");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=MEMTRAIN_GLOO_INCLUDE");
    println!("cargo:rerun-if-env-changed=MEMTRAIN_NCCL_INCLUDE");
    println!("cargo:rerun-if-env-changed=MEMTRAIN_CUDA_INCLUDE");
    println!("cargo::rustc-check-cfg=cfg(memtrain_dist)");
    // torch-sys declares `links = "tch"` and prints `libtorch_lib`, which cargo hands to
    // direct dependents as DEP_TCH_LIBTORCH_LIB.
    let lib = PathBuf::from(
        env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not report libtorch's lib dir; is LIBTORCH set (see scripts/bootstrap)?"),
    );
    let root = lib.parent().expect("libtorch lib dir has a parent").to_path_buf();
    let have_cuda = lib.join("libtorch_cuda.so").exists();
    // Same ABI flag torch-sys compiles its own wrapper with; the PyTorch 2.11 wheels use the new ABI.
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());

    let cuda_include = have_cuda.then(|| cuda_include(&root)).flatten();
    let mut build = torch_cpp(&root, &abi);
    build
        .file("src/shim/shim.cpp")
        .file("src/shim/cuda.cpp")
        .file("src/shim/graph.cpp");
    if have_cuda {
        build.define("MEMTRAIN_HAVE_CUDA", None);
    }
    if let Some(dir) = &cuda_include {
        // The caching allocator's own interface (the cap as a fraction, the OOM observer).
        build.include(dir).define("MEMTRAIN_HAVE_CUDA_RUNTIME", None);
    } else if have_cuda {
        println!(
            "cargo:warning=memtrain: the CUDA runtime's headers were not found beside torch \
             (nvidia/cu13/include with crt/ and nv/target); building without NCCL and without setting \
             the CUDA allocator's fraction directly. scripts/bootstrap installs nvidia-cuda-crt and nvidia-cuda-cccl."
        );
    }
    build.compile("memtrain_shim");
    distributed(&root, &abi, cuda_include.as_deref());

    // RUNPATH (not RPATH) so that LD_LIBRARY_PATH can still point the binary at another
    // torch 2.11 install, such as a lab machine's own PyTorch.
    println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags,-rpath,{}", lib.display());
    if have_cuda {
        // Nothing in our code references libtorch_cuda symbols directly (the CUDA backend
        // registers itself in static constructors), so --as-needed would drop it and CUDA
        // would be silently "not available".
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-L{}", lib.display());
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-lc10_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}

/// The data-parallel part of the shim (src/shim/dist.cpp), when its headers are here: Gloo's
/// (Debian/Ubuntu: libgloo-dev; or MEMTRAIN_GLOO_INCLUDE) for the CPU, NCCL's (the nvidia-nccl
/// wheel PyTorch installs, found beside torch; or MEMTRAIN_NCCL_INCLUDE) for CUDA. libtorch
/// itself carries both backends' code; only their headers are missing from the wheel. Without
/// either, memtrain builds without data-parallel training and says so when asked for it.
fn distributed(root: &std::path::Path, abi: &str, cuda_include: Option<&std::path::Path>) {
    let found = |var: &str, candidates: &[PathBuf], probe: &str| -> Option<PathBuf> {
        env::var_os(var)
            .map(PathBuf::from)
            .into_iter()
            .chain(candidates.iter().cloned())
            .find(|d| d.join(probe).exists())
    };
    let gloo = found(
        "MEMTRAIN_GLOO_INCLUDE",
        &[PathBuf::from("/usr/include"), PathBuf::from("/usr/local/include")],
        "gloo/config.h",
    );
    let site = root.parent().map(PathBuf::from);
    let nccl = match cuda_include {
        Some(_) => {
            let candidates: Vec<PathBuf> = site.iter().map(|s| s.join("nvidia/nccl/include")).collect();
            found("MEMTRAIN_NCCL_INCLUDE", &candidates, "nccl.h")
        }
        _ => None,
    };
    if cuda_include.is_some() && nccl.is_none() {
        println!("cargo:warning=memtrain: NCCL's nccl.h was not found beside torch (nvidia/nccl/include) or in MEMTRAIN_NCCL_INCLUDE; building without data-parallel training on CUDA");
    }
    if gloo.is_none() && nccl.is_none() {
        println!(
            "cargo:warning=memtrain: neither Gloo's headers (libgloo-dev) nor NCCL's were found; \
             building without data-parallel training (run --nproc)"
        );
        return;
    }
    let mut build = torch_cpp(root, abi);
    build.file("src/shim/dist.cpp");
    if let Some(dir) = &gloo {
        build
            .include(dir)
            .define("USE_C10D_GLOO", None)
            .define("MEMTRAIN_HAVE_GLOO", None);
    }
    if let Some(dir) = &nccl {
        build
            .include(dir)
            .define("USE_C10D_NCCL", None)
            .define("MEMTRAIN_HAVE_NCCL", None);
        build
            .include(cuda_include.expect("checked with nccl"))
            .define("USE_CUDA", None);
    }
    build.compile("memtrain_dist");
    println!("cargo:rustc-cfg=memtrain_dist");
}

/// The CUDA runtime's headers, which ProcessGroupNCCL.hpp and the caching allocator's header
/// need: cuda_runtime.h with its crt/ (the nvidia-cuda-crt wheel) and <nv/target>
/// (nvidia-cuda-cccl). scripts/bootstrap installs both beside torch, under nvidia/cu13/include; a
/// CUDA toolkit's include dir serves as well.
fn cuda_include(root: &std::path::Path) -> Option<PathBuf> {
    let site = root.parent().map(PathBuf::from);
    env::var_os("MEMTRAIN_CUDA_INCLUDE")
        .map(PathBuf::from)
        .into_iter()
        .chain(site.iter().map(|s| s.join("nvidia/cu13/include")))
        .chain([PathBuf::from("/usr/local/cuda/include")])
        .find(|d| d.join("crt/host_config.h").exists() && d.join("nv/target").exists())
}

/// A C++ build against libtorch's headers, with the flags torch-sys compiles its own wrapper with.
fn torch_cpp(root: &std::path::Path, abi: &str) -> cc::Build {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT");
    build
}
