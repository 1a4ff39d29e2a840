"""The training loop every drafter trainer runs (autoregressive, EAGLE, EAGLE-3, parallel): a trainer builds
its model, optimiser and batches and hands over a step function that turns a batch into a loss; the loop owns
the wall-clock budget, the learning-rate schedule, the optimiser step, the progress bar and periodic reports.

Training here is bounded by minutes, not epochs (`SequenceBatches` cycles the training sequences for as long
as the budget lasts), so a run's length follows the machine it runs on.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from .batches import SequenceBatches, cosine_lr


@dataclass
class StepLoss:
    """What a trainer's step function returns for one batch."""

    loss: torch.Tensor  # scalar the optimiser minimises
    tokens: int  # tokens the step counts as seen
    shown: dict[str, float] = field(default_factory=dict)  # further values for the progress bar and reports


@dataclass
class LoopSettings:
    """How the shared loop steps and reports."""

    lr: float  # peak learning rate: cosine decay to a tenth of it over the budget (`cosine_lr`)
    minutes: float  # wall-clock training budget
    desc: str  # progress bar label
    warmup_steps: int = 0  # the learning rate rises linearly over this many first steps (0: no warm-up)
    grad_clip: float = 1.0  # gradient norm clipped to this, over every parameter the optimiser holds
    report_every_steps: int = 0  # call `report` after every this many steps (0: not by steps)
    report_every_seconds: float = 0.0  # call `report` once this many seconds passed since the last (0: not by time)
    progress: bool = True  # show the progress bar


@dataclass
class LoopResult:
    """What the loop did."""

    steps: int  # optimiser steps taken
    tokens_seen: int  # sum of the steps' `StepLoss.tokens`
    seconds: float  # wall time from the loop's start to its end
    first_loss: float  # loss of the first step (NaN when no step ran)
    final_loss: float  # loss of the last step (NaN when no step ran)


def run_training(optimizer: torch.optim.Optimizer, batches: SequenceBatches,
                 step_loss: Callable[[list[int], int], StepLoss | None], settings: LoopSettings,
                 report: Callable[[int, StepLoss], None] | None = None) -> LoopResult:
    """Step until `settings.minutes` are spent: set the learning rate (a param group's optional "scale"
    multiplies it), draw a batch (sequence ids, tokens), ask `step_loss` for its loss (None: nothing to learn
    from this batch, no step), then backward, clip and step. `report(steps, step)` runs at the intervals
    `settings` asks for (held-out checks, log lines)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    budget = settings.minutes * 60
    start = last_report = time.time()
    steps = tokens_seen = 0
    first_loss = final_loss = float("nan")
    bar = tqdm(total=int(budget), desc=settings.desc, unit="s", disable=not settings.progress)
    while (elapsed := time.time() - start) < budget:
        lr = cosine_lr(settings.lr, elapsed, budget)
        if settings.warmup_steps:
            lr *= min(1.0, (steps + 1) / settings.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("scale", 1.0)
        out = step_loss(*batches.next())
        if out is None:
            continue
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        steps += 1
        tokens_seen += out.tokens
        final_loss = out.loss.item()
        first_loss = final_loss if steps == 1 else first_loss
        bar.update(int(min(budget, time.time() - start)) - bar.n)
        bar.set_postfix(loss=f"{final_loss:.3f}", **{k: f"{v:.3f}" for k, v in out.shown.items()}, step=steps,
                        refresh=False)
        due = (settings.report_every_steps and steps % settings.report_every_steps == 0) or (
            settings.report_every_seconds and time.time() - last_report > settings.report_every_seconds)
        if report is not None and due:
            last_report = time.time()
            report(steps, out)
    bar.close()
    return LoopResult(steps, tokens_seen, time.time() - start, first_loss, final_loss)


def holdout_split(count: int, fraction: float, generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Shuffle sequence ids 0..count-1 and keep max(1, count * fraction) of them out of training:
    (held out, training)."""
    order = torch.randperm(count, generator=generator).tolist()
    n_hold = max(1, int(len(order) * fraction))
    return order[:n_hold], order[n_hold:]


def growing_corpus_holdout(count: int, n_hold: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(held out, training) ids of sequences 0..count-1 of a corpus that grows by appending: the `n_hold` ids
    whose seeded hash is smallest. A sequence's hash never changes and the cut only falls as the corpus grows,
    so a drafter continued on a larger corpus (`--init-from`) is never measured on a sequence an earlier run
    trained on (a fresh permutation of the larger corpus would hold out ~all-old sequences)."""
    def rank(i: int) -> bytes:
        return hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()

    order = sorted(range(count), key=rank)
    held = set(order[:n_hold])
    return sorted(held), [i for i in range(count) if i not in held]


def target_to_draft_map(vocab_ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[target_vocab] LongTensor: a target token id's row in the drafter's restricted head, -1 outside it."""
    mapping = torch.full((target_vocab,), -1, dtype=torch.long)
    mapping[vocab_ids] = torch.arange(len(vocab_ids))
    return mapping
