//! Compiles the C++ shim and fixes the link flags that tch's own build script cannot pass on.
use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/shim/shim.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
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

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("src/shim/shim.cpp");
    if have_cuda {
        build.define("MEMTRAIN_HAVE_CUDA", None);
    }
    build.compile("memtrain_shim");

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
