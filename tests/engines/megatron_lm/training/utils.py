"""The helpers Megatron-LM's arguments.py imports from megatron/training/utils.py, as written there
(whose other imports need a GPU build); the device architecture is the plans' (README.md)."""
import warnings

import torch

from megatron.core._rank_utils import safe_get_rank as _safe_get_rank


def print_rank_0(message, rank=None):
    if rank is not None:
        if rank == 0:
            print(message, flush=True)
    elif _safe_get_rank() == 0:
        print(message, flush=True)


def warn_rank_0(message, rank=None):
    if rank is not None:
        if rank == 0:
            warnings.warn(message)
    elif _safe_get_rank() == 0:
        warnings.warn(message)


def get_device_arch_version():
    # the plans' devices (H100: Hopper, 9) where this machine has none
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device("cuda:0")).major
    return 9


def update_use_dist_ckpt(args):
    args.use_dist_ckpt = args.ckpt_format != "torch"

def is_rank0():
    return _safe_get_rank() == 0
