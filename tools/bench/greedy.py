"""The target's own greedy answer for the bench's greedy check: the reference tokens and, per position, the top-2
logit gap that engine/greedy_rule.py's near-tie rule reads."""

from __future__ import annotations


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
