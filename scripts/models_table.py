#!/usr/bin/env python3
"""Prints the models table of docs/models.md (markdown) from models/manifest.json."""

import json
from pathlib import Path

MANIFEST = Path(__file__).resolve().parent.parent / "models" / "manifest.json"


def main():
    data = json.loads(MANIFEST.read_text())
    print("| file | kind | layers | hidden | heads (KV) | seq | vocab | float initializer "
          "elements | torch / formula params | file size |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = sorted(data.values(), key=lambda r: (r["graph_only"], r["float_initializer_elements"]))
    for r in rows:
        cfg = r.get("config", r)
        hidden = cfg.get("hidden", cfg.get("hidden_size", cfg.get("n_embd", "")))
        heads = cfg.get("heads", cfg.get("num_attention_heads", cfg.get("n_head", "")))
        kv = cfg.get("kv_heads", cfg.get("num_key_value_heads"))
        heads = f"{heads} ({kv})" if kv and kv != heads else f"{heads}"
        if r["graph_only"]:
            seq, vocab = r["seq"], r["vocab"]
        else:
            seq = "sym" if any(isinstance(d, str) and d != "batch"
                               for i in r["inputs"] for d in i["shape"]) else "—"
            vocab = cfg.get("vocab_size", "—") if r["kind"] != "vit" else "—"
        params = r.get("torch_parameters", r.get("formula_params"))
        print(f"| `{r['file']}` | {r['kind']}{' (graph-only)' if r['graph_only'] else ''} | "
              f"{r['layers']} | {hidden} | {heads} | {seq} | {vocab} | "
              f"{r['float_initializer_elements']:,} | {params:,} | "
              f"{r['file_bytes'] / 1e3:,.0f} kB |")


if __name__ == "__main__":
    main()
