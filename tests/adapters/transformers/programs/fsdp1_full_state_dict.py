"""FSDP1's full state dict of a CPU model, torch alone (no Trainer, no Accelerate, no joinkit).

Run by ``test_transformers.py`` as ``torchrun --nproc-per-node 2
fsdp1_full_state_dict.py OFFLOAD``: a two-layer model wrapped in
``FullyShardedDataParallel`` on CPU processes (gloo), one forward and backward, then
``model.state_dict()`` under ``StateDictType.FULL_STATE_DICT`` with
``FullStateDictConfig(offload_to_cpu=OFFLOAD == "1")`` (Accelerate's ``get_state_dict``,
which the Trainer's ``save_model`` calls under FSDP1, always offloads). Each rank prints
``rank R state dict: KEYS`` when it returns.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main(offload: bool) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                 device_id=torch.device("cpu"), use_orig_params=True)
    model(torch.randn(3, 4)).sum().backward()
    config = FullStateDictConfig(offload_to_cpu=offload, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    print(f"rank {dist.get_rank()} state dict: {sorted(state)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] == "1")
