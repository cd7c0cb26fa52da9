"""DeepSpeed ZeRO-2 with uneven inputs: ``Join([engine])``, and a joined rank replays.

Without the Join, the rank with fewer batches leaves while the other waits in
its next step's gradient reduction (on gloo: "Connection closed by peer").
With it, the rank that ran out replays each of its peer's steps through the
engine on an empty batch (a zero loss), so ZeRO's reductions, the clipping norm
and the partitioned optimizer step happen on both ranks, and both end with
the same model: the one a single process training on all 8 batches (each
step's gradient averaged over the 2 ranks) ends with.

Run it with 2 processes (on a machine without GPUs DeepSpeed needs
``DS_ACCELERATOR=cpu``, which this example sets; its first import takes a
while)::

    deepspeed --num_gpus 2 examples/deepspeed_uneven.py
    torchrun --nproc-per-node 2 examples/deepspeed_uneven.py
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402

from joinkit import Join  # noqa: E402


def main() -> None:
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    generator = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(5 if rank == 0 else 3):  # uneven: 5 and 3 batches
        x = torch.randn(2, 3, generator=generator).to(engine.device)
        batches.append((x, x.sum(dim=1, keepdim=True)))

    with Join([engine]):
        for x, y in batches:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()

    print(f"Rank {rank} trained on all {len(batches)} of its batches!")


if __name__ == "__main__":
    main()
