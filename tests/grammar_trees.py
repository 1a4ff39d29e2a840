"""What the grammar tests share (tests/engine_integration/test_grammar*.py, tests/parallel/test_parallel_grammar.py):
the reference constrained decoder, the trees a drafter hands the engine with the context each was drafted at, and
the check that every node is a token the grammar allows after its parent's path."""

from __future__ import annotations

import torch
import xgrammar as xgr
from transformers import LogitsProcessorList
from xgrammar.contrib.hf import LogitsProcessor as XgrammarProcessor


def constrained_generate(model, compiled, prompt: list[int], n: int, eos: list[int]) -> list[int]:
    """The reference: transformers' greedy `generate` with xgrammar's own logits processor."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=0, logits_processor=LogitsProcessorList([XgrammarProcessor(compiled)]))
    return out[0, len(prompt):].tolist()


def record_trees(engine) -> list:
    """A list that fills with (context, tree) for every tree the engine's drafter drafts from now on."""
    trees = []
    draft = engine.drafter.local.draft

    def spy(requests, *args, **kwargs):
        drafted = draft(requests, *args, **kwargs)
        trees.extend((list(r.context), tree) for r, tree in zip(requests, drafted.trees))
        return drafted

    engine.drafter.local.draft = spy
    return trees


def nodes_allowed(trees, prompt_tokens: int, compiled, eos: list[int], tokenizer) -> int:
    """Asserts that each drafted node's token is one a fresh matcher fed the output and the node's ancestors accepts
    (nodes below a stop token are never verified, and skipped); returns how many nodes were checked."""
    checked = 0
    for context, tree in trees:
        output = context[prompt_tokens:]
        tokens, parents = tree.token_list, tree.parent_list
        for node in range(1, len(tokens)):
            path, p = [], node
            while p > 0:
                path.append(tokens[p])
                p = parents[p]
            path.reverse()
            matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=eos)
            for t in output + path:
                if matcher.is_terminated():
                    break
                assert matcher.accept_token(t), (tokenizer.decode(output + path), tokenizer.decode([t]))
            else:
                checked += 1
    return checked
