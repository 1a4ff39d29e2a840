"""Token-for-token comparison with the target's own greedy `generate`, where a divergence is allowed only at
a near-tie of the top-2 logits (fp32 round-off may flip the argmax there). Used by the in-process bench and the
service bench (services/bench_service.py)."""

from __future__ import annotations

from dataclasses import dataclass

TIE_GAP = 1e-4  # top-2 logit gap below which fp32 round-off may legitimately flip the argmax


@dataclass
class GreedyCheck:
    """Token-for-token comparison with `model.generate`; divergence is allowed only at near-ties."""

    compared: int = 0
    mismatches: int = 0  # divergences NOT at a near-tie (must be 0)
    tie_divergences: int = 0  # divergences at a near-tie position
    tie_positions: int = 0  # reference positions whose top-2 logits are within TIE_GAP

    def compare(self, reference: list[int], gaps: list[float], produced: list[int]) -> None:
        self.compared += 1
        for i, (want, got) in enumerate(zip(reference, produced)):
            if want != got:
                if gaps[i] < TIE_GAP:
                    self.tie_divergences += 1
                else:
                    self.mismatches += 1
                return
        if len(reference) != len(produced):  # one stopped (EOS) where the other went on: not a tie
            self.mismatches += 1


def greedy_reference(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """The target's own greedy continuation and, per position, the gap between its top-2 logits."""
    import torch

    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens,
                             do_sample=False, top_p=None, top_k=None, temperature=None, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = [float(t.topk(2, dim=-1).values[0].diff().abs()) for t in out.logits]
    return tokens, gaps
