//! Models exported at test time by a Python script with the project venv, cached under the
//! target dir by the content of the script and of the export code it imports.

use std::path::PathBuf;
use std::process::Command;

use sha2::{Digest, Sha256};

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The venv's Python (or `$SMP_PYTHON`).
pub fn python() -> PathBuf {
    std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo().join(".venv/bin/python"))
}

/// The parameter record's one implementation (in the Python package; `scripts/param_record.py`
/// is a shim that loads it), which every export script's output depends on.
pub const PARAM_RECORD: &str = "python/smp_partition/param_record.py";

/// The directory `tests/<script> DIR` exports into, run only when DIR lacks `marker`; DIR is
/// keyed by the script and the export code it may import (the parameter record,
/// `scripts/export_models.py`, `make_graph_only.py`, `onnx_build.py`).
pub fn exported(script: &str, marker: &str) -> PathBuf {
    exported_in(script, marker, "")
}

/// [`exported`] with `salt` added to the key.
fn exported_in(script: &str, marker: &str, salt: &str) -> PathBuf {
    let path = repo().join("tests").join(script);
    let mut h = Sha256::new();
    let scripts = ["export_models.py", "make_graph_only.py", "onnx_build.py"].map(|s| repo().join("scripts").join(s));
    for f in std::iter::once(&path).chain(&scripts).chain(std::iter::once(&repo().join(PARAM_RECORD))) {
        h.update(std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display())));
    }
    h.update(salt.as_bytes());
    let key: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    let stem = script.trim_end_matches(".py");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(stem).join(key);
    if !dir.join(marker).exists() {
        let r = Command::new(python()).arg(&path).arg(&dir).output().unwrap_or_else(|e| panic!("run tests/{script}: {e}; run `make venv`"));
        assert!(r.status.success(), "tests/{script} failed: {}", String::from_utf8_lossy(&r.stderr));
    }
    dir
}

/// [`exported`] keyed also by `extra` files (paths relative to the repository), for scripts
/// that export through code outside `scripts/` (the front door's `python/smp_partition`).
pub fn exported_with(script: &str, marker: &str, extra: &[&str]) -> PathBuf {
    let mut h = Sha256::new();
    for f in extra {
        h.update(std::fs::read(repo().join(f)).unwrap_or_else(|e| panic!("{f}: {e}")));
    }
    let key: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    exported_in(script, marker, &key)
}
