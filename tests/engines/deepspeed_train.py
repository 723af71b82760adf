"""The `train.py` of the DeepSpeed launch line `smp-partition emit --engine deepspeed` writes,
for the tiny Llama (tiny_llama.py): the pipeline module of the emitted deepspeed_pipeline.py
over the model's layers, the emitted ds_config.json with the runner's optimizer (AdamW, lr 1e-3,
weight decay 0.01) and no gradient clipping (DeepSpeed's pipeline engine, in fp32 with the
optimizer given, clips by the norm of the first stage's gradients alone; the runner by all),
one global batch repeated every step. Rank 0 writes the step losses as JSON. Run under torchrun on the CPU with Gloo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--emitted", required=True, help="the directory emit wrote")
    ap.add_argument("--weights", required=True, help="initial weights, Hugging Face names (.safetensors)")
    ap.add_argument("--data", required=True, help="one global batch (.npz, input_ids)")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import deepspeed
    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, args.emitted)
    import tiny_llama
    from deepspeed_pipeline import PlannedPipeline

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(0)
    named = tiny_llama.layers()
    # the runner names them as the exported wrapper holds the Hugging Face model: `model.` first
    tiny_llama.load(named, {k.removeprefix("model."): v for k, v in load_file(args.weights).items()})
    ds_config = str(Path(args.emitted) / "ds_config.json")
    config = json.loads(Path(ds_config).read_text())
    config["gradient_clipping"] = 0.0
    net = PlannedPipeline([m for _, m in named], ds_config=ds_config, loss_fn=tiny_llama.causal_lm_loss)
    opt = torch.optim.AdamW([p for p in net.parameters()], lr=1e-3, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    ids = torch.from_numpy(np.load(args.data)["input_ids"]).long()
    mbs, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]

    def batches():
        while True:
            for i in range(gas):
                x = ids[i * mbs:(i + 1) * mbs]
                yield x, x

    it = batches()
    losses = [float(engine.train_batch(data_iter=it)) for _ in range(args.steps)]
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"losses": losses, "parts": list(net.parts)}))
    # both ranks leave together and close Gloo's threads first: a rank exiting while its peer
    # still talks aborts in Gloo's teardown ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
