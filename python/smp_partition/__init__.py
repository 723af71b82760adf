"""smp_partition: the PyTorch front door of smp-partition.

    import smp_partition as smp
    plan = smp.plan(model, example_inputs, cluster="cpu:2", global_batch=8,
                    config={"pipeline_parallel_degree": 2, "microbatches": 4})
    print(plan)                                  # smp-partition inspect's table
    run = smp.launch(plan, data=batch, steps=100, checkpoint_dir="ckpt")
    smp.load_trained(model, run)                 # trained weights back into the module
    smp.sweep(model, example_inputs, clusters=["a100-80gb:256,512", "h100-80gb:256,512"])
    smp.estimate(model, example_inputs, cluster="h100-80gb:8", pp=2, microbatches=4)  # will it fit?
    plan.emit("megatron", "mlm/")                # the plan as Megatron-LM arguments (or torchtitan, ...)

Pure Python around the built binaries (`smp-partition`, `smp-runner`), found in $SMP_BIN_DIR,
on PATH, or in the repository's target/. Needs torch==2.13.0 (the binaries link against it).
"""

from ._binaries import find_binary
from .estimate import DeviceMemory, Estimate, RankEstimate, estimate
from .errors import CommandError, ExportError, RankFailed, SmpError
from .export import Exported, export
from .launch import Run, launch, launch_command, verify_plan
from .plan import EngineConfig, Gap, Parallel, Plan, Predicted, plan
from .sweep import Sweep, sweep
from .trained import export_trained, load_trained

__all__ = [
    "CommandError", "DeviceMemory", "EngineConfig", "Estimate", "ExportError", "Exported", "Gap", "Parallel", "Plan", "Predicted", "RankEstimate", "RankFailed", "Run", "SmpError", "Sweep",
    "estimate", "export", "export_trained", "find_binary", "launch", "launch_command", "load_trained", "plan", "sweep", "verify_plan",
]
