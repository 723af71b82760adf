//! Build script: with feature `runner`, bake libtorch's library directory into the binaries'
//! rpath so `smp-runner` runs without LD_LIBRARY_PATH.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_RUNNER").is_none() {
        return;
    }
    // torch-sys declares `links = "tch"` and exports its library directory to dependents.
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    match std::env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(lib) => println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}"),
        Err(_) => println!(
            "cargo:warning=DEP_TCH_LIBTORCH_LIB not set by torch-sys; smp-runner will need LD_LIBRARY_PATH"
        ),
    }
}
