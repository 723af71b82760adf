//! Ranks on two hosts: two Linux network namespaces joined by a veth pair stand for two
//! machines (each sees only its own loopback and its end of the link). A pp2 × dp2 plan runs
//! as two ranks per namespace, one `smp-runner launch --nnodes 2` in each, and trains within
//! 1e-9 (f64) of one process: Gloo must bind the interface that reaches MASTER_ADDR, since
//! loopback addresses published by one namespace lead nowhere from the other (checked: with
//! GLOO_SOCKET_IFNAME=lo the job fails to connect). Where network
//! namespaces cannot be made (no root, no `ip`), the test says why and skips.
#![cfg(feature = "runner")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const SEQ: &str = "16";
const BATCH: &str = "8";
const STEPS: &str = "6";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn model() -> PathBuf {
    repo().join("models/gpt2.onnx")
}

fn ip(args: &[&str]) -> Result<(), String> {
    let r = Command::new("ip").args(args).output().map_err(|e| format!("cannot run `ip` ({e})"))?;
    if r.status.success() {
        Ok(())
    } else {
        Err(format!("`ip {}` failed: {}", args.join(" "), String::from_utf8_lossy(&r.stderr).trim()))
    }
}

/// Two namespaces joined by a veth pair, removed on drop.
struct Hosts {
    names: [String; 2],
    addrs: [String; 2],
}

impl Hosts {
    fn new() -> Result<Hosts, String> {
        let pid = std::process::id();
        let names = [format!("smp{pid}a"), format!("smp{pid}b")];
        // each namespace has its own addresses: fixed ones cannot collide with other tests'
        let addrs = ["10.200.0.1".to_string(), "10.200.0.2".to_string()];
        ip(&["netns", "add", &names[0]])?;
        let hosts = Hosts { names: names.clone(), addrs: addrs.clone() };
        ip(&["netns", "add", &names[1]])?;
        ip(&["link", "add", "veth0", "netns", &names[0], "type", "veth", "peer", "name", "veth1", "netns", &names[1]])?;
        for (i, dev) in ["veth0", "veth1"].iter().enumerate() {
            ip(&["-n", &names[i], "addr", "add", &format!("{}/30", addrs[i]), "dev", dev])?;
            ip(&["-n", &names[i], "link", "set", dev, "up"])?;
            ip(&["-n", &names[i], "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

fn ok(what: &str, r: &Output) {
    assert!(r.status.success(), "{what} failed ({:?}): {}", r.status, String::from_utf8_lossy(&r.stderr));
}

fn losses(stdout: &[u8]) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_slice(stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(stdout)));
    v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect()
}

fn plan(dir: &Path) -> PathBuf {
    let out = dir.join("pp2dp2.json");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .arg(model())
        .args(["--cluster", &common::cluster_arg("cpu:4"), "--seq-len", SEQ, "--global-batch", BATCH, "-o"])
        .arg(&out)
        .args(["--pp", "2", "--tp", "1", "--dp", "2", "--schedule", "1f1b", "--microbatches", "2"])
        .output()
        .unwrap();
    ok("planning pp2 × dp2", &r);
    out
}

const COMMON: [&str; 7] = ["--steps", STEPS, "--dtype", "f64", "--threads", "1", "--json"];

#[test]
fn pp2_dp2_across_two_network_namespaces_matches_one_process() {
    let hosts = match Hosts::new() {
        Ok(h) => h,
        Err(why) => {
            eprintln!("SKIPPED: cannot make two network namespaces joined by a veth pair here: {why} (needs root and iproute2)");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path());
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .arg("train")
        .arg(model())
        .args(["--batch", BATCH, "--seq-len", SEQ, "--microbatches", "4"])
        .args(COMMON)
        .output()
        .unwrap();
    ok("the single-process run", &r);
    let want = losses(&r.stdout);

    // one launcher per "host"; node 0's address is the rendezvous. `iface`: GLOO_SOCKET_IFNAME
    // on each host (None: the interface that reaches MASTER_ADDR)
    let run = |iface: [Option<&str>; 2], timeout: &str| {
        let node = |i: usize| {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &hosts.names[i], env!("CARGO_BIN_EXE_smp-runner"), "launch", "--nproc", "2", "--nnodes", "2"])
                .args(["--node-rank", &i.to_string(), "--master-addr", &hosts.addrs[0], "--master-port", "29500"])
                .arg(&p)
                .args(COMMON)
                .args(["--timeout", timeout])
                .env_remove("GLOO_SOCKET_IFNAME")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if let Some(name) = iface[i] {
                c.env("GLOO_SOCKET_IFNAME", name);
            }
            c.spawn().unwrap()
        };
        let (a, b) = (node(0), node(1));
        (a.wait_with_output().unwrap(), b.wait_with_output().unwrap())
    };
    for (how, iface) in [("the route to MASTER_ADDR", [None, None]), ("GLOO_SOCKET_IFNAME", [Some("veth0"), Some("veth1")])] {
        let (a, b) = run(iface, "60");
        ok(&format!("node 0 ({how})"), &a);
        ok(&format!("node 1 ({how})"), &b);
        let got = losses(&a.stdout);
        let worst = got.iter().zip(&want).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max);
        eprintln!("pp2 × dp2 over two namespaces, Gloo bound by {how}: max relative loss difference {worst:.3e} over {} steps", got.len());
        assert_eq!(got.len(), want.len());
        assert!(worst <= 1e-9, "{how}: losses {got:?} vs one process {want:?}");
    }
    // bound to loopback (as before this test), the hosts cannot reach each other
    let (a, b) = run([Some("lo"), Some("lo")], "10");
    assert!(!a.status.success() && !b.status.success(), "ranks bound to loopback on two hosts should not connect");
    // refused or timed out, depending on timing: either way Gloo names it
    let err = String::from_utf8_lossy(&b.stderr);
    assert!(err.contains("Gloo"), "the failure names Gloo: {err}");
}
