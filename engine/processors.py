"""Penalties and biases on the target's logits at every tree node, and the log-probabilities of emitted tokens.

A tree node's row is the target's next-token distribution after the node's own path: the sequence's context
(prompt + emitted tokens, its last token the root) followed by the node's ancestors below the root and the node
itself. So every penalty is computed per node from that path, each branch counting its own tokens, exactly what
decoding one token at a time would have seen there: verification (greedy or sampled, docs/design.md section 5)
then compares the draft with the distribution the plain decoder would have drawn from, which keeps the output
lossless. The semantics are vLLM's (`LogitsProcessors` in engine/requests.py): presence / frequency over the
generated tokens, the repetition penalty over prompt and generated tokens, logit_bias added, the stop tokens at
-inf while fewer than min_tokens tokens were generated; order bias, min_tokens, repetition, frequency, presence.

The work is one [N, V] pass per active field, on the device the logits are on, only for requests that set one.

Log-probabilities are the raw model's (log_softmax of the unprocessed logits, before penalties and the warp), as
vLLM returns by default: an evaluation harness gets the model's own scores whatever the sampling settings. On
request they are the processed ones instead (vLLM's `processed_logprobs`): of the distribution the token was
drawn from, after penalties, biases and the warp.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .requests import LogitsProcessors, SamplingParams, TokenLogprob
from .sampling import warp_probs
from .tree import TokenTree


def path_tokens(tree: TokenTree) -> tuple[list[int], list[int]]:
    """(row, token) pairs: for every node its own token and its ancestors' below the root, the tokens a node's
    row has seen beyond the context. O(nodes x depth) with plain lists (trees hold tens of nodes)."""
    parents, tokens = tree.parent_list, tree.token_list
    rows, toks = [], []
    for node in range(1, len(tokens)):
        walk = node
        while walk > 0:
            rows.append(node)
            toks.append(tokens[walk])
            walk = parents[walk]
    return rows, toks


def apply_processors(logits: Tensor, tree: TokenTree, context: list[int], processors: LogitsProcessors) -> Tensor:
    """logits [N, V] of `tree`'s nodes (row i: after node i) -> float32 logits with the penalties and biases of
    `processors` applied at every node from its own path; `context` ends with the tree's root."""
    rows, toks = path_tokens(tree)
    return _apply(logits, rows, toks, tree.depth.tolist(), context, processors)


def apply_to_paths(logits: Tensor, paths: list[list[int]], context: list[int],
                   processors: LogitsProcessors) -> Tensor:
    """apply_processors for rows known by their paths (row i after context + paths[i]): a drafter's rows, fed a
    few nodes at a time (engine/drafters/model_runner.py)."""
    rows = [i for i, path in enumerate(paths) for _ in path]
    return _apply(logits, rows, [t for path in paths for t in path], [len(p) for p in paths], context, processors)


def _apply(logits: Tensor, rows: list[int], toks: list[int], depths: list[int], context: list[int],
           processors: LogitsProcessors) -> Tensor:
    """The processors on logits [N, V]: row i has also seen the tokens `toks[j]` where rows[j] == i, and
    depths[i] of them."""
    out = logits.float().clone()
    if not processors.active:
        return out
    num, vocab = out.shape
    device = out.device
    path_rows = torch.tensor(rows, dtype=torch.long, device=device)
    path_toks = torch.tensor(toks, dtype=torch.long, device=device)
    if processors.logit_bias:
        ids = torch.tensor([t for t, _ in processors.logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in processors.logit_bias], dtype=out.dtype, device=device)
        out[:, ids] += bias
    generated = len(context) - processors.prompt_tokens  # tokens generated before the root's row
    if processors.min_tokens and processors.stop_ids:
        held = [i for i, d in enumerate(depths) if generated + d < processors.min_tokens]
        if held:
            stops = torch.tensor(processors.stop_ids, dtype=torch.long, device=device)
            out[torch.tensor(held, device=device)[:, None], stops[None, :]] = float("-inf")
    if processors.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(context, dtype=torch.long, device=device)] = True
        mask = seen.expand(num, vocab).clone()
        mask[path_rows, path_toks] = True
        penalty = processors.repetition_penalty
        out = torch.where(mask, torch.where(out < 0, out * penalty, out / penalty), out)
    if processors.presence_penalty or processors.frequency_penalty:
        counts = torch.zeros(vocab, dtype=out.dtype, device=device)
        output = context[processors.prompt_tokens:]
        if output:
            counts.index_put_((torch.tensor(output, dtype=torch.long, device=device),),
                              torch.ones(len(output), dtype=out.dtype, device=device), accumulate=True)
        counts = counts.expand(num, vocab).clone()
        if rows:
            counts.index_put_((path_rows, path_toks), torch.ones(len(rows), dtype=out.dtype, device=device),
                              accumulate=True)
        if processors.frequency_penalty:
            out -= processors.frequency_penalty * counts
        if processors.presence_penalty:
            out -= processors.presence_penalty * (counts > 0).to(out.dtype)
    return out


def path_logprobs(logits: Tensor, nodes: list[int], tokens: list[int], top: int,
                  warp: SamplingParams | None = None) -> list[TokenLogprob]:
    """The log-probability of each emitted token and its `top` most likely alternatives: token k read from
    row nodes[k] of logits [N, V] (the root, then the accepted nodes). One log_softmax over the path's rows
    and one device-to-host copy of [E] + [E, top] values, never [N, V] rows. `warp` (processed log-probabilities,
    of the processed logits): the log of the warped distribution the token was drawn from at temperature > 0
    (-inf outside top-k / top-p), the processed logits' log_softmax at temperature 0."""
    picked = logits[torch.tensor(nodes, device=logits.device)].float()
    if warp is not None and not warp.is_greedy:
        rows = torch.log(warp_probs(picked, warp))
    else:
        rows = torch.log_softmax(picked, dim=-1)
    chosen = rows.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].cpu().tolist()
    if top:
        values, ids = rows.topk(min(top, rows.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.cpu().tolist(), values.cpu().tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, alt) for t, lp, alt in zip(tokens, chosen, tops)]
