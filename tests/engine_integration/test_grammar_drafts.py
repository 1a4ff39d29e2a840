"""Trees that obey the grammar (issue 59 item 2; engine/lookup/grammar_copies.py, engine/grammar/drafts.py): the
copy source's candidates that the grammar refuses are dropped, the text it forces is drafted as a copy chain of its
own calibration buckets (no drafter row on it), the lookup-only plan the budget chooser prices carries that chain,
and every node of a hybrid tree is a token the grammar allows after its parent's path, with the greedy output still
constrained decoding's and the sampled output following the masked target (chi-square); a request without a grammar
drafts as before."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from grammar_trees import constrained_generate, nodes_allowed, record_trees
from families import pit_pvalue
from test_grammar import PET, Masked, fresh_mask, make_engine
from treeserve.engine.grammar.compiler import GrammarCompiler
from treeserve.engine.grammar.drafts import StepGrammar
from treeserve.engine.grammar.matchers import GrammarSessions
from treeserve.engine.grammar.spec import Grammar, GrammarKind
from treeserve.engine.lookup import LookupSources, Origin, match_bucket
from treeserve.engine.lookup.grammar_copies import GrammarCopies
from treeserve.engine.lookup.session import PRIOR_HIT_FORCED
from treeserve.engine.lookup.trees import plan_lookup
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.requests import GenerationRequest, SamplingParams
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.factory import in_process_engine
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.tree import Source


@pytest.fixture(scope="module")
def pair(tiny_target_dir, tiny_drafter_dir):
    return load_causal_lm(tiny_target_dir), load_causal_lm(tiny_drafter_dir).model


def copies_at(tok, vocab: int, prompt: list[int], output: list[int]):
    """(the grammar view, the lookup session seen through it, the session itself) of a PET request whose context
    is prompt + output."""
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(PET), prompt_tokens=len(prompt),
                      stop_ids=(tok.eos_token_id,))
    sessions = GrammarSessions(GrammarCompiler(tok, vocab))
    context = prompt + output
    view = StepGrammar(sessions, "s", grammar, context)
    session = LookupSources().session("s", context)
    return view, GrammarCopies(session, view), session, grammar


def test_forced_text_is_a_copy_chain_of_its_own_buckets(pair):
    """After '{"' the schema forces 'name": "': its tokens, the tokenizer's own, are the chain the root copies,
    each calibrated in the FORCED buckets by the tokens left (the prior first); below the chain's end the grammar
    forces nothing and the node's candidates are the lookup's again. The lookup-only plan carries the chain."""
    target, _ = pair
    tok = target.tokenizer
    prompt = tok.encode("Describe a pet.")
    output = tok.encode('{"')
    view, copies, session, _ = copies_at(tok, target.model.config.vocab_size, prompt, output)
    forced = tok.encode('name": "')
    assert view.forced(()) == tuple(forced) and len(forced) >= 2
    assert session.hit_rate(match_bucket(1, Origin.FORCED)) == pytest.approx(PRIOR_HIT_FORCED[0])
    state, path = copies.root_state(), ()
    for i, token in enumerate(forced):
        row = copies.row(state)
        left = len(forced) - i
        assert row.tokens == (token,) and state.forced == tuple(forced[i:])
        assert row.bucket == match_bucket(left, Origin.FORCED)
        assert row.values[0] == pytest.approx(session.hit_rate(row.bucket))
        path = path + (token,)
        state = copies.child_state(state, token, path)
    assert state.forced == ()  # the name's text is the model's to write
    plan = plan_lookup(copies, output[-1], 8, 0.02)
    assert plan.tokens[1:len(forced) + 1] == forced and plan.parents[1:len(forced) + 1] == list(range(len(forced)))
    assert plan.gains()[len(forced) - 1] > 1.0  # what the chooser prices a lookup-only step by
    # scored at the next sync like any copy: the emitted tokens follow the chain
    session.sync(prompt + output + forced[:2])
    assert session.observed >= 2 and session.hits[match_bucket(len(forced), Origin.FORCED)] == 1.0


def test_copies_the_grammar_refuses_are_cut(pair):
    """The prompt continues 'kind": "' with 'dog' and with 'zebra': at a root ending in 'kind": "' both are the
    lookup's candidates, and only 'dog' (an enum value) is left once the grammar has seen them."""
    target, _ = pair
    tok = target.tokenizer
    vocab = target.model.config.vocab_size
    prompt = tok.encode('Examples: "kind": "zebra" and "kind": "dog" and "kind": "zebra".')
    output = tok.encode('{"name": "Rex", "kind": "')
    _, copies, session, grammar = copies_at(tok, vocab, prompt, output)
    raw = session.row(session.root_state())
    row = copies.row(copies.root_state())
    dog = tok.encode('dog')[0]
    allowed = fresh_mask(GrammarCompiler(tok, vocab).compile(grammar), output, tok.eos_token_id, vocab)
    assert raw is not None and any(not bool(allowed[t]) for t in raw.tokens)
    assert row is not None and set(row.tokens) < set(raw.tokens)
    assert all(bool(allowed[t]) for t in row.tokens) and dog in row.tokens
    assert all(not bool(allowed[t]) for t in set(raw.tokens) - set(row.tokens))
    assert row.total == pytest.approx(sum(row.values))


def test_hybrid_trees_obey_the_grammar_and_copy_forced_text(pair):
    """Through the engine (c2t+lookup, a context holding JSON to copy): every drafted node is a token the grammar
    allows after its parent's path, a tree whose root the grammar forces text after copies it from the root as
    LOOKUP nodes (no model row there), and the greedy output is transformers' generate with xgrammar's processor."""
    target, _ = pair
    engine = make_engine(pair, "c2t+lookup", 10)
    tok = target.tokenizer
    prompt = engine.encode_chat('Like {"name": "Tom", "kind": "cat", "legs": 4}, describe a pet as JSON.')
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(PET))
    trees = record_trees(engine)
    result = engine.generate([GenerationRequest(prompt, max_new_tokens=30, grammar=grammar)])[0]
    eos = sorted(engine.eos_ids)
    compiled = engine.grammars.compile(grammar)
    assert result.token_ids == constrained_generate(target.model, compiled, prompt, 30, eos)
    chains = 0
    for context, tree in trees:
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=eos)
        assert all(matcher.accept_token(t) for t in context[len(prompt):])
        if matcher.is_terminated():
            continue
        forced = tok.encode(matcher.find_jump_forward_string(), add_special_tokens=False)
        if len(forced) >= 2:  # e.g. 'name": "' after '{"': copied from the root as a chain of LOOKUP nodes
            assert tree.token_list[1:3] == forced[:2] and tree.parent_list[1:3] == [0, 1]
            assert int(tree.sources[1]) == int(tree.sources[2]) == int(Source.LOOKUP)
            chains += 1
    checked = nodes_allowed(trees, len(prompt), compiled, eos, tok)
    assert checked > len(trees) and chains >= 2



def test_sampled_hybrid_with_forced_copies_follows_the_masked_target(pair):
    """Forced and grammar-cut copies are deterministic children of DySpec's sampled parents, tested first by the
    point-mass rule (docs/design.md section 5): the sampled output still follows the masked, warped target."""
    target, _ = pair
    engine = make_engine(pair, "dyspec+lookup", 6)
    trees = record_trees(engine)
    prompt = engine.encode_chat('Like {"name": "Tom", "kind": "cat", "legs": 4}, describe a pet as JSON.')
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(PET))
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    outputs, accepted = [], 0
    for seed in range(6):
        result = engine.generate([GenerationRequest(prompt, 20, sampling=sampling, seed=seed, grammar=grammar)])[0]
        outputs.append(result.token_ids)
        accepted += sum(s.accepted for s in result.steps)
    copies = sum(int((tree.sources == int(Source.LOOKUP)).sum()) for _, tree in trees if tree.sources is not None)
    assert copies >= 6 and accepted > 0  # '{"name": "' at least, once per request
    masked = Masked(target.model, engine.grammars.compile(grammar), len(prompt), sorted(engine.eos_ids))
    pvalue, tokens = pit_pvalue(masked, prompt, outputs, sampling)
    assert tokens >= 6 * 10 and pvalue > 1e-3


def test_requests_without_a_grammar_draft_the_same_trees(pair):
    """A drafter that reads grammars (given the target's tokenizer) drafts a request without one exactly as a drafter
    that cannot: the same trees step by step, the same output."""
    target, drafter = pair
    vocab = target.model.config.vocab_size
    prompt = target.tokenizer.encode("one two three four. one two three four. one two")
    runs = []
    for tokenizer in (target.tokenizer, None):
        engine = in_process_engine(TargetRunner(target.model, tokenizer=target.tokenizer),
                                   LocalDrafter(DrafterRunner(drafter, vocab, tokenizer=tokenizer)), target.tokenizer,
                                   TreeConfig(method="c2t+lookup", budget=10), 2048)
        trees = record_trees(engine)
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
        runs.append((result.token_ids, [(t.token_list, t.parent_list) for _, t in trees]))
    assert runs[0] == runs[1] and len(runs[0][1]) > 1


def test_trees_drafted_ahead_and_batched_copy_chains_obey_the_grammar(pair):
    """Run-ahead trees (drafted below a guessed path and bonus token: the grammar is asked after that prefix) and
    batched steps' copy chains see the copies through the grammar too: every node allowed, outputs still
    constrained decoding's."""
    target, drafter = pair
    tok = target.tokenizer
    vocab = target.model.config.vocab_size
    local = LocalDrafter(DrafterRunner(drafter, vocab, tokenizer=tok))
    engine = in_process_engine(TargetRunner(target.model, tokenizer=tok), local, tok,
                               TreeConfig(method="c2t+lookup", budget=10), 2048, run_ahead=True)
    ahead = []
    draft_ahead = local.draft_ahead

    def spy(lane=""):
        done = draft_ahead(lane)
        ahead.extend((list(a.context), a.tree) for trees in local.run_ahead.trees.values() for a in trees)
        return done

    local.draft_ahead = spy
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(PET))
    eos = sorted(engine.eos_ids)
    compiled = engine.grammars.compile(grammar)
    prompts = [engine.encode_chat('Like {"name": "Tom", "kind": "cat", "legs": 4}, describe a pet as JSON.'),
               engine.encode_chat('A dog, as JSON like {"name": "Rex", "kind": "dog", "legs": 4}.')]
    single = engine.generate([GenerationRequest(prompts[0], max_new_tokens=30, grammar=grammar)])[0]
    assert single.token_ids == constrained_generate(target.model, compiled, prompts[0], 30, eos)
    assert ahead
    assert nodes_allowed(ahead, len(prompts[0]), compiled, eos, tok) > len(ahead)
    trees = record_trees(engine)
    batched = engine.generate([GenerationRequest(p, max_new_tokens=30, grammar=grammar) for p in prompts])
    for prompt, result in zip(prompts, batched):
        assert result.token_ids == constrained_generate(target.model, compiled, prompt, 30, eos)
    assert any(int(s.batch_size) == 2 for s in batched[0].steps)
    drafted = [(c, t) for c, t in trees if t.num_nodes > 1]
    first = [(c, t) for c, t in drafted if c[:len(prompts[0])] == prompts[0]]
    assert first and nodes_allowed(first, len(prompts[0]), compiled, eos, tok) > 0
