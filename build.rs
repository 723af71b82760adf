//! Build script: with feature `runner`, compile the c10d, autograd and device shims
//! (csrc/c10d_shim.cpp, csrc/autograd_shim.cpp, csrc/device_shim.cpp, csrc/memory_shim.cpp) against libtorch's headers and bake libtorch's library directory into the binaries' rpath so
//! `smp-runner` runs without LD_LIBRARY_PATH (`SMP_TORCH_RPATH` replaces it: the wheel's relative one).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_RUNNER").is_none() {
        return;
    }
    #[cfg(feature = "runner")]
    runner::build();
}

#[cfg(feature = "runner")]
mod runner {
    use std::path::{Path, PathBuf};

    /// `csrc/NAME` beside this build script (scripts/gpu-check builds the same sources from
    /// another package directory).
    fn csrc(name: &str) -> PathBuf {
        Path::new(file!()).parent().unwrap_or(Path::new("")).join("csrc").join(name)
    }

    pub fn build() {
        for f in ["c10d_shim.cpp", "autograd_shim.cpp", "device_shim.cpp", "memory_shim.cpp", "shim_error.h"] {
            println!("cargo:rerun-if-changed={}", csrc(f).display());
        }
        // torch-sys declares `links = "tch"` and exports its library directory to dependents.
        println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
        let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
            println!("cargo:warning=DEP_TCH_LIBTORCH_LIB not set by torch-sys; cannot build the c10d shim");
            return;
        };
        let lib = PathBuf::from(lib);
        let include = lib.join("../include");
        let mut build = cc::Build::new();
        build
            .cpp(true)
            .std("c++17")
            .file(csrc("c10d_shim.cpp"))
            .file(csrc("autograd_shim.cpp"))
            .file(csrc("device_shim.cpp"))
            .file(csrc("memory_shim.cpp"))
            .include(&include)
            .include(include.join("torch/csrc/api/include"))
            .define("_GLIBCXX_USE_CXX11_ABI", "1")
            .define("USE_C10D_GLOO", None)
            .flag_if_supported("-Wno-unused-parameter")
            .flag_if_supported("-Wno-deprecated-declarations")
            .warnings(false);
        if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
            // NCCL process groups: needs a CUDA toolkit's headers (CUDA_HOME, /usr/local/cuda, or
            // the NVIDIA wheels beside torch's: `make cuda-headers`).
            println!("cargo:rerun-if-env-changed=CUDA_HOME");
            build.define("USE_C10D_NCCL", None).define("SMP_WITH_NCCL", None);
            for dir in cuda_includes(&lib) {
                build.include(dir);
            }
            println!("cargo:rustc-link-lib=dylib=torch_cuda");
        }
        build.compile("smp_c10d_shim");
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-lib=dylib=torch_cpu");
        println!("cargo:rustc-link-lib=dylib=c10");
        // `make wheel` bakes a path relative to the binary instead (`$ORIGIN/../../torch/lib`:
        // the torch wheel installed beside the package), not this build's venv
        println!("cargo:rerun-if-env-changed=SMP_TORCH_RPATH");
        let rpath = std::env::var("SMP_TORCH_RPATH").unwrap_or_else(|_| lib.display().to_string());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{rpath}");
    }

    /// Include directories for CUDA and NCCL headers: `CUDA_HOME` if set, else /usr/local/cuda
    /// if it exists, plus every `include` of the NVIDIA wheels installed beside torch
    /// (`site-packages/nvidia/*/include`: runtime, crt, cccl, nccl).
    fn cuda_includes(torch_lib: &std::path::Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        match std::env::var("CUDA_HOME") {
            Ok(home) => out.push(PathBuf::from(home).join("include")),
            Err(_) if std::path::Path::new("/usr/local/cuda/include").is_dir() => out.push(PathBuf::from("/usr/local/cuda/include")),
            Err(_) => {}
        }
        // torch/lib → site-packages/nvidia
        let wheels = torch_lib.join("../../nvidia");
        if let Ok(entries) = std::fs::read_dir(&wheels) {
            let mut dirs: Vec<PathBuf> = entries.flatten().map(|e| e.path().join("include")).filter(|p| p.is_dir()).collect();
            dirs.sort();
            out.extend(dirs);
        }
        out
    }
}
