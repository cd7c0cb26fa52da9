"""The float64 single-process reference for ``hf_worker.py``'s cells.

Given every rank's recorded micro-batches (each with the global step it belonged
to), a single process trains the same tiny model as one Trainer would on the
union of each step's batches: the loss of a step is the token mean over all of
its batches (``average_tokens_across_devices``; without it, each rank's window
normalized by its own tokens, the world size dividing the gradient as DDP
does; each loss divided by what Accelerate's backward divides it by: the
``gradient_accumulation_steps`` that older transformers, 5.3 among them, gives it), the
gradient is clipped to ``max_grad_norm``, AdamW steps with the Trainer's linear
schedule. Evaluation is the single-process Trainer's: the
evaluation set in its sequential batches, ``eval_loss`` the mean over the
samples of their batch's token mean (each sample once: the Trainer repeats a
batch's loss ``eval_batch_size`` times and Accelerate drops the repeats a
partial last batch does not have), the metrics over every sample.

Plain loops over the recorded tensors: no Trainer, no joinkit, no
torch.distributed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import hf_worker as w
import torch


def tokens(batch: dict[str, torch.Tensor], rule: str = "shifted") -> int:
    """The Trainer's count of a batch's label tokens by ``rule`` (``hf_worker.label_count``:
    ``_get_num_items_in_batch``'s rule in the installed transformers)."""
    if rule != "labels" and "shift_labels" in batch:
        return int(batch["shift_labels"].ne(-100).sum())
    labels = batch["labels"][..., 1:] if rule == "shifted" else batch["labels"]
    return int(labels.ne(-100).sum())


def token_loss_sum(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sum of the batch's token losses: TRL's fused head where the model has it
    (``-log_probs``, as SFTTrainer), else HF's causal LM loss with reduction sum."""
    if getattr(model, "_fused", False):
        return -model(**batch, fused_lm_head=True).log_probs.sum()
    return model(**batch, num_items_in_batch=torch.tensor(1.0, dtype=torch.float64)).loss


def _chunked_lm_head(model: Any) -> None:
    """TRL's ``loss_type="chunked_nll"`` forward on the reference model, as its SFTTrainer
    patches the trained one (the loss summed in float32 chunks, also for a float64 model;
    TRL's default in 1.8 to 1.14, an option in 1.4; 1.15 fuses the LM head instead)."""
    from trl.trainer import sft_trainer

    sft_trainer._patch_chunked_ce_lm_head(model, chunk_size=sft_trainer._CHUNKED_LM_HEAD_CHUNK_SIZE)


def train(records: list[dict[str, Any]], model_kind: str,
          evals: dict[int, Any] | None = None, sft: bool = False,
          totals: dict[int, int] | None = None) -> dict[str, Any]:
    """Train the reference on the ranks' recorded batches.

    Args:
        records: every rank's cell record (``recorded``, ``meta``).
        model_kind: ``"gpt2"`` or ``"llama"``.
        sft: the loss of TRL's SFTTrainer (its fused LM head).
        evals: global step -> an evaluation set (a list of rows) to evaluate after
            that step (``0``: before training is not used).
        totals: first global step -> the ``max_steps`` the linear schedule counts
            from that step on (a run resumed on another number of ranks counts its
            own); default: ``meta["max_steps"]`` throughout.

    Returns:
        ``params`` (name -> tensor), ``losses`` (logged loss per step), ``lrs``,
        ``evals`` (step -> metrics).
    """
    meta = records[0]["meta"]
    world = meta["world"]
    steps: dict[int, list[tuple[int, dict[str, torch.Tensor]]]] = defaultdict(list)
    for rank, record in enumerate(records):
        for step, batch in record["recorded"]:
            steps[step].append((rank, batch))
    model = w.tiny_model(model_kind)
    if sft:
        # TRL's SFTTrainer fuses the model's LM head (its metrics' outputs) from the
        # release that has ``add_fused_lm_head``; an older one (0.26 to 1.8) trains the
        # model as it is, and so does the reference. Every one forwards with
        # ``use_cache=False`` (its compute_loss): with a cache, transformers' mask does not
        # split the packed rows at their position_ids, and the loss differs (1e-3).
        from trl.trainer import utils as trl_utils

        model.config.use_cache = False
        if meta.get("loss_type") == "chunked_nll":
            _chunked_lm_head(model)

        if hasattr(trl_utils, "add_fused_lm_head"):
            trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
            model._fused = True
    model.train()
    defaults = meta["defaults"]
    optimizer: torch.optim.Optimizer
    if meta["optimizer"] == "SGD":
        optimizer = torch.optim.SGD(model.parameters(), lr=defaults["lr"],
                                    momentum=defaults.get("momentum", 0.0),
                                    weight_decay=meta["weight_decay"])
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=defaults["lr"],
                                      betas=tuple(defaults["betas"]), eps=defaults["eps"],
                                      weight_decay=meta["weight_decay"],
                                      fused=defaults.get("fused") or None)
    totals = totals or {0: meta["max_steps"]}
    base_lr = defaults["lr"]
    # Accelerate's backward divides the loss by this (hf_worker.backward_divisor).
    divisor = meta.get("backward_divisor", 1)
    losses, lrs, norms, evaluations = [], [], [], {}
    for step in sorted(steps):
        total = totals[max(first for first in totals if first <= step)]
        lr = base_lr * max(0.0, (total - step) / total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        batches = steps[step]
        logged = 0.0
        if meta["average_tokens"]:
            count = sum(tokens(batch, meta["label_count"]) for _, batch in batches)
            for _, batch in batches:
                loss = token_loss_sum(model, batch) / count
                (loss / divisor).backward()
                logged += float(loss.detach())
        else:
            by_rank: dict[int, list[dict[str, torch.Tensor]]] = defaultdict(list)
            for rank, batch in batches:
                by_rank[rank].append(batch)
            for own in by_rank.values():
                count = sum(tokens(batch, meta["label_count"]) for batch in own)
                rank_loss = 0.0
                for batch in own:
                    loss = token_loss_sum(model, batch) / count
                    (loss / (world * divisor)).backward()
                    rank_loss += float(loss.detach())
                logged += rank_loss / len(by_rank)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                              meta["max_grad_norm"] or float("inf"))
        norms.append(float(norm))
        optimizer.step()
        losses.append(logged)
        lrs.append(lr)
        if evals and step + 1 in evals:
            evaluations[step + 1] = evaluate(model, evals[step + 1], meta["label_count"],
                                             meta.get("eval_batch", 2))
            model.train()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "losses": losses, "lrs": lrs, "norms": norms, "evals": evaluations,
            "model": model}


def evaluate(model: Any, rows: list[dict[str, Any]], rule: str,
             batch_size: int = 2) -> dict[str, float]:
    """The single-process Trainer's evaluation: eval_loss (the mean over the samples of
    their batch's loss, normalized by its token count, ``tokens``) and
    ``hf_worker.metrics``."""
    model.eval()
    sample_losses, logits, labels = [], [], []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = w.collate(rows[start:start + batch_size])
            out = model(**batch)
            loss = float(token_loss_sum(model, batch)) / tokens(batch, rule)
            sample_losses += [loss] * len(batch["labels"])
            logits.append(out.logits)
            labels.append(batch["labels"])
    prediction = _Prediction(torch.cat(logits).numpy(), torch.cat(labels).numpy())
    result = {f"eval_{k}": v for k, v in w.metrics(prediction).items()}
    result["eval_loss"] = sum(sample_losses) / len(sample_losses)
    return result


class _Prediction:
    def __init__(self, predictions: Any, label_ids: Any) -> None:
        self.predictions = predictions
        self.label_ids = label_ids


def max_param_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max(float((got[n].double() - want[n].double()).abs().max()) for n in want)
