//! Log lines on a pipe carry no ANSI colour codes, with or without `NO_COLOR`.

use std::process::Command;

/// A plan whose SMP config holds a key that has no effect on planning: a WARN line results.
fn warn_run(no_color: Option<&str>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("smp.json");
    std::fs::write(&config, r#"{"pipeline_parallel_degree": 2, "ddp": true}"#).unwrap();
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2.onnx");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_smp-partition"));
    cmd.args([model, "--cluster", "h100-80gb:2", "--seq-len", "16", "--global-batch", "4", "--config"]).arg(&config);
    cmd.env_remove("NO_COLOR");
    if let Some(v) = no_color {
        cmd.env("NO_COLOR", v);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn warnings_on_a_pipe_are_plain_text() {
    for no_color in [None, Some("1")] {
        let err = warn_run(no_color);
        assert!(err.contains("WARN"), "expected a WARN line about `ddp`: {err}");
        assert!(err.contains("ddp"), "{err}");
        assert!(!err.contains('\u{1b}'), "ANSI escape in piped stderr (NO_COLOR={no_color:?}): {err:?}");
    }
}
