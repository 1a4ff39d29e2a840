"""How often a drafter's top-1 / top-k equals the target's greedy next token (teacher-forced).

The target greedily answers a prompt; the drafter is then teacher-forced on the same sequence, and at every
answer position its top-1 and top-k are compared with the target's token. This is the per-token acceptance
a greedy chain sees. `treeserve agreement` and `treeserve check-drafter` report it; tools/training/
chain_acceptance.py adds the acceptance at deeper chain positions.
"""

from __future__ import annotations
from treeserve.engine.drafters.models.base import DrafterModel

from .chain_acceptance import target_features


def greedy_sequence(target, prompt_ids: list[int], max_new_tokens: int):
    """[len(prompt_ids) + answer] the prompt followed by the target's greedy answer (Hugging Face `generate`,
    sampling switched off whatever the model's generation config says)."""
    import torch

    return target.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                           top_p=None, top_k=None, temperature=None)[0]


class Counts:
    """Top-1 / top-k hits of one drafter over the target's answer positions."""

    def __init__(self) -> None:
        self.hit1 = self.hitk = self.total = 0
        self.per_category: dict[str, list[int]] = {}

    def add(self, drafter, sequence, prompt_len: int, top_k: int, category: str, target=None) -> None:
        """Teacher-force `drafter` on prompt + target answer `sequence` [T] and count its hits (`target`: the
        target model, whose features an EAGLE drafter reads)."""
        import torch

        # TreeServe's drafter models declare their features and head; a plain causal LM reads neither.
        own = isinstance(drafter, DrafterModel)
        answer = sequence[prompt_len:]
        inputs = {"input_ids": sequence[None, :-1]}
        if own and drafter.reads_target_features:
            # EAGLE: every position reads the target's feature of the position before (the first token
            # of a draft tree, whose parent is the root, sees exactly this); EAGLE-3 fuses several layers.

            features = drafter.project_target_features(target_features(target, drafter, sequence[:-1])[None])
            inputs["parent_features"] = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
        logits = drafter(**inputs).logits[0, prompt_len - 1:]
        top = logits.topk(top_k, dim=-1).indices
        if own and drafter.vocab_ids is not None:
            top = drafter.vocab_ids[top]
        hits = int((top[:, 0] == answer).sum())
        self.hit1 += hits
        self.hitk += int((top == answer[:, None]).any(-1).sum())
        self.total += len(answer)
        cat = self.per_category.setdefault(category, [0, 0])
        cat[0] += hits
        cat[1] += len(answer)

    def result(self, num_prompts: int, max_new_tokens: int, top_k: int) -> dict:
        return {"prompts": num_prompts, "positions": self.total, "max_new_tokens": max_new_tokens,
                "top1": round(self.hit1 / self.total, 4), f"top{top_k}": round(self.hitk / self.total, 4),
                "top1_by_category": {k: round(h / n, 4) for k, (h, n) in sorted(self.per_category.items())}}


def depth_table(chains: dict, depth: int) -> str:
    """Markdown table: acceptance at chain depth 1..depth (EAGLE-3's n-alpha, n = depth - 1) per drafter."""
    head = "| drafter | " + " | ".join(f"depth {d} ({d - 1}-alpha)" for d in range(1, depth + 1)) + " |"
    lines = [head, "|---" * (depth + 1) + "|"]
    for name, counts in chains.items():
        cells = [f"{r:.1%} ({n})" if r is not None else "-" for r, n in zip(counts.rates(), counts.reached)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
