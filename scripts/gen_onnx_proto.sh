#!/usr/bin/env bash
# Regenerates src/frontend/onnx/proto.rs from proto/onnx.proto with prost-build + protox
# (pure Rust: no protoc binary, no build-time codegen). Run once after updating onnx.proto.
# Usage: scripts/gen_onnx_proto.sh   (needs cargo and crates.io; builds in a throwaway dir)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${GEN_ONNX_PROTO_DIR:-/tmp/gen_onnx_proto}"
mkdir -p "$work/src" "$work/out"
cat > "$work/Cargo.toml" <<'TOML'
[package]
name = "gen_onnx_proto"
version = "0.0.0"
edition = "2021"

[dependencies]
prost-build = "0.14"
protox = "0.10"
TOML
cat > "$work/src/main.rs" <<'RS'
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (proto_dir, out_dir) = (&args[1], &args[2]);
    let fds = protox::compile([format!("{proto_dir}/onnx.proto")], [proto_dir]).expect("protox");
    // raw_data as `Bytes`: decoded from a memory-mapped file, it points into the map (no copy)
    prost_build::Config::new().out_dir(out_dir).bytes([".onnx.TensorProto.raw_data"]).compile_fds(fds).expect("prost-build");
}
RS
(cd "$work" && cargo run --release --quiet -- "$repo/proto" "$work/out")
{
  echo "// Generated from proto/onnx.proto (onnx 1.23.2, IR 14) by scripts/gen_onnx_proto.sh:"
  echo "// prost-build 0.14 with protox 0.10 (no protoc). Do not edit by hand; rerun the script."
  echo
  cat "$work/out/onnx.rs"
} > "$repo/src/frontend/onnx/proto.rs"
echo "wrote $repo/src/frontend/onnx/proto.rs"
