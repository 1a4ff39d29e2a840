"""Structured output under the parallel drafter (issue 59 item 3; engine/drafters/parallel.py): q_1 is masked with
the grammar's state at the root, and the tree search skips candidates the grammar refuses after their parent's
path, so no node goes to a token the target's mask gives probability 0; the greedy output is still transformers'
generate with xgrammar's logits processor."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from grammar_trees import constrained_generate, nodes_allowed, record_trees
from treeserve.engine.drafters.base import DraftRequest
from treeserve.engine.drafters.parallel import ParallelTreeDrafter
from treeserve.engine.factory import build_engine
from treeserve.engine.grammar.matchers import allowed_tokens
from treeserve.engine.grammar.spec import Grammar, GrammarKind
from treeserve.engine.requests import GenerationRequest, SamplingParams
from treeserve.engine.tree_config import TreeConfig

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "parrot"]},
                                           "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
          "required": ["kind", "legs"]}


@pytest.mark.parametrize(("method", "budget"), [("opt_tree", 12), ("static", 16)])
def test_parallel_trees_obey_the_grammar(tiny_target, parallel_drafter_dir, method, budget):
    engine = build_engine(drafter_path=str(parallel_drafter_dir), method=method, budget=budget, target=tiny_target,
                          drafter_kind="parallel", static_tree="eagle1_25")
    assert isinstance(engine.drafter.local, ParallelTreeDrafter) and engine.drafter.local.grammars is not None
    trees = record_trees(engine)
    prompt = engine.encode_chat("Describe a pet as JSON.")
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    result = engine.generate([GenerationRequest(prompt, max_new_tokens=24, grammar=grammar)])[0]
    eos = sorted(engine.eos_ids)
    compiled = engine.grammars.compile(grammar)
    assert result.token_ids == constrained_generate(tiny_target.model, compiled, prompt, 24, eos)
    assert nodes_allowed(trees, len(prompt), compiled, eos, tiny_target.tokenizer) > len(trees)


def test_the_first_position_is_masked_at_the_root(tiny_target, parallel_drafter_dir):
    """q_1 after '{"kind": "' holds mass only on what the enum allows there; a request without a grammar keeps the
    drafter's own row."""
    engine = build_engine(drafter_path=str(parallel_drafter_dir), method="opt_tree", budget=8, target=tiny_target,
                          drafter_kind="parallel")
    drafter = engine.drafter.local
    tok = tiny_target.tokenizer
    prompt = engine.encode_chat("A pet.")
    output = tok.encode('{"kind": "')
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA), prompt_tokens=len(prompt),
                      stop_ids=tuple(sorted(engine.eos_ids)))
    request = DraftRequest("g", prompt + output, SamplingParams(), TreeConfig(method="opt_tree", budget=8), 0,
                           grammar=grammar)
    masked = drafter.position_probs([request])[0][0]
    plain = drafter.position_probs([DraftRequest("p", prompt + output, SamplingParams(),
                                                 TreeConfig(method="opt_tree", budget=8), 0)])[0][0]
    matcher = xgr.GrammarMatcher(engine.grammars.compile(grammar), override_stop_tokens=list(grammar.stop_ids))
    assert all(matcher.accept_token(t) for t in output)
    mask = xgr.allocate_token_bitmask(1, drafter.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    allowed = allowed_tokens(mask, drafter.vocab_size)[0][drafter.vocab_ids]
    assert float(masked[~allowed].sum()) == 0.0 and abs(float(masked.sum()) - 1.0) < 1e-4
    assert float(plain[~allowed].sum()) > 0.0  # what the drafter would have spent nodes on
    tree = drafter.draft([request]).trees[0]
    assert all(bool(allowed_tokens(mask, drafter.vocab_size)[0][t]) for t, p in
               zip(tree.token_list[1:], tree.parent_list[1:]) if p == 0)
