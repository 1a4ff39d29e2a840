"""Structured output over speculative trees (engine/grammar/): the grammar's mask at every tree node from that node's
own matcher state. Each node's mask equals a fresh matcher's after the node's path; the greedy output is
Hugging Face `generate`'s with xgrammar's transformers logits processor (the reference constrained decoder) for
sampled trees (a JSON schema, a regex and an EBNF grammar) and deterministic trees with copies (the schema); the
drafter's rows are masked from each node's path too; sampled output follows the masked, warped target
distribution (chi-square on the probability integral transforms); a bad grammar is refused before decoding, naming
the problem."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from families import pit_pvalue
from grammar_trees import constrained_generate
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.grammar.compiler import XGRAMMAR_INSTALL, GrammarCompiler
from treeserve.engine.grammar.matchers import GrammarSessions, allowed_tokens, tree_links
from treeserve.engine.grammar.spec import Grammar, GrammarKind
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import GenerationRequest, SamplingParams
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.factory import in_process_engine
from treeserve.engine.tree import TokenTree
from treeserve.engine.tree_config import TreeConfig

PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                        "kind": {"enum": ["cat", "dog", "parrot"]},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                                        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                 "maxItems": 2}},
       "required": ["name", "kind", "legs"]}
GRAMMARS = {
    "json_schema": Grammar(GrammarKind.JSON_SCHEMA, json.dumps(PET)),
    "regex": Grammar(GrammarKind.REGEX, r"(yes|no|maybe), because [a-z ]{1,30}\."),
    "ebnf": Grammar(GrammarKind.EBNF, 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9] | "x" [a-z]'),
}


@pytest.fixture(scope="module")
def pair(tiny_target_dir, tiny_drafter_dir):
    return load_causal_lm(tiny_target_dir), load_causal_lm(tiny_drafter_dir).model


def make_engine(pair, method: str, budget: int) -> SpeculativeEngine:
    target, drafter = pair
    local = None if method == "autoregressive" else LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size,
                                                                                tokenizer=target.tokenizer))
    return in_process_engine(TargetRunner(target.model, tokenizer=target.tokenizer), local, target.tokenizer,
                             TreeConfig(method=method, budget=budget or 1), 2048)


def fresh_mask(compiled, tokens: list[int], eos: int, vocab: int) -> torch.Tensor:
    """Bool [vocab]: what a new matcher fed `tokens` allows next."""
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[eos])
    for t in tokens:
        assert matcher.accept_token(t)
    mask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask)
    return allowed_tokens(mask, vocab)[0]


def test_each_node_is_masked_from_its_own_path(pair):
    """Every node of a branching tree whose path the grammar accepts gets the mask of a fresh matcher fed the output
    and that path; the root's is the output's; a context that changed under the session rolls its matcher back."""
    target, _ = pair
    tok = target.tokenizer
    compiler = GrammarCompiler(tok, target.model.config.vocab_size)
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(PET), prompt_tokens=2, stop_ids=(tok.eos_token_id,))
    output = tok.encode('{"name": "Rex", "kind": "')
    a, b = tok.encode("dog")[0], tok.encode("cat")[0]
    comma = tok.encode('", "')[0]
    # root -> dog -> '", "' , root -> cat, root -> "zzz" (refused by the grammar), root -> dog again (duplicate)
    tree = TokenTree.build([output[-1], a, b, tok.encode("zzz")[0], comma, a], [-1, 0, 0, 0, 1, 0])
    sessions = GrammarSessions(compiler)
    context = [1, 2, *output]
    masks = sessions.tree_masks("s", grammar, context, tree)
    compiled = compiler.compile(grammar)
    for node, path in [(0, []), (1, [a]), (2, [b]), (4, [a, comma]), (5, [a])]:
        fresh = xgr.GrammarMatcher(compiled, override_stop_tokens=[tok.eos_token_id])
        for t in output + path:
            assert fresh.accept_token(t)
        want = xgr.allocate_token_bitmask(1, compiler.vocab_size)
        fresh.fill_next_token_bitmask(want)
        assert torch.equal(masks[node], want[0]), node
    allowed = allowed_tokens(masks, compiler.vocab_size)
    assert bool(allowed[0, a]) and bool(allowed[0, b]) and not bool(allowed[0, tok.encode("zzz")[0]])
    # the session's matcher follows the context: a shorter one rolls it back, a foreign token is refused
    again = sessions.tree_masks("s", grammar, context[:-2], TokenTree.build([context[-3]], [-1]))
    fresh = xgr.GrammarMatcher(compiled, override_stop_tokens=[tok.eos_token_id])
    for t in output[:-2]:
        fresh.accept_token(t)
    want = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    fresh.fill_next_token_bitmask(want)
    assert torch.equal(again[0], want[0])
    with pytest.raises(ValueError, match="does not follow the request's json_schema grammar"):
        sessions.tree_masks("s", grammar, [1, 2, tok.encode("hello")[0]], TokenTree.build([0], [-1]))
    assert tree_links([-1, 0, 0, 1]) == ([1, 3, -1, -1], [-1, 2, -1, -1])


# A sampled tree with every grammar kind; a deterministic tree with copies with the schema.
@pytest.mark.parametrize("method,budget,names", [("dyspec", 6, ("json_schema", "regex", "ebnf")),
                                                 ("c2t+lookup", 8, ("json_schema",))])
def test_greedy_equals_generate_with_xgrammar(pair, method, budget, names):
    target, _ = pair
    engine = make_engine(pair, method, budget)
    prompt = engine.encode_chat("Describe a pet as JSON.")
    eos = sorted(engine.eos_ids)
    accepted = 0
    for name in names:
        grammar = GRAMMARS[name]
        n = 24 if name == "json_schema" else 12
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=n, grammar=grammar)])[0]
        expected = constrained_generate(target.model, engine.grammars.compile(grammar), prompt, n, eos)
        assert result.token_ids == expected, name
        accepted += sum(s.accepted for s in result.steps)
    assert accepted > 0  # tree paths were accepted: the per-node masks, not only the roots', were used


def test_grammar_output_parses_and_validates(pair):
    """The tiny target, held to the schema, writes a JSON object that validates (finish reason EOS: the grammar
    completed, then only the stop token was allowed); a token limit inside it ends with LENGTH."""
    target, _ = pair
    engine = make_engine(pair, "c2t+lookup", 8)
    prompt = engine.encode_chat("A pet, please.")
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
              "required": ["kind", "ok"]}
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    done = engine.generate([GenerationRequest(prompt, max_new_tokens=40, grammar=grammar)])[0]
    value = json.loads(done.text)
    assert done.finish_reason.value == "eos" and value["kind"] in ("cat", "dog") and isinstance(value["ok"], bool)
    cut = engine.generate([GenerationRequest(prompt, max_new_tokens=3, grammar=grammar)])[0]
    assert cut.finish_reason.value == "length" and len(cut.token_ids) == 3


class Masked(torch.nn.Module):
    """The target with the grammar's mask applied at every position (position t after prompt + output[:t]): the
    distribution constrained decoding draws from, for `pit_pvalue`."""

    def __init__(self, model, compiled, prompt_tokens: int, eos: list[int]):
        super().__init__()
        self.model, self.compiled, self.prompt_tokens, self.eos = model, compiled, prompt_tokens, eos

    def forward(self, ids):
        logits = self.model(ids).logits[0].float()
        matcher = xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.eos)
        mask = xgr.allocate_token_bitmask(1, logits.shape[-1])
        for t in range(self.prompt_tokens - 1, ids.shape[1] - 1):  # the rows pit_pvalue reads
            if t >= self.prompt_tokens:
                matcher.accept_token(int(ids[0, t]))
            matcher.fill_next_token_bitmask(mask)
            logits[t] = logits[t].masked_fill(~allowed_tokens(mask, logits.shape[-1])[0], float("-inf"))
        return type("Out", (), {"logits": logits[None]})()


def test_sampled_follows_the_masked_target(pair):
    """DySpec's sampled children with the residual rule: the masked target row is p, the drafter's unmasked q."""
    target, _ = pair
    engine = make_engine(pair, "dyspec", 4)
    prompt = engine.encode_chat("Say yes or no, and why.")
    grammar = Grammar(GrammarKind.REGEX, r"(yes|no|maybe), because [a-z ]{10,60}\.")
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    eos = sorted(engine.eos_ids)
    outputs, accepted = [], 0
    for seed in range(5):
        result = engine.generate([GenerationRequest(prompt, 16, sampling=sampling, seed=seed, grammar=grammar)])[0]
        outputs.append(result.token_ids)
        accepted += sum(s.accepted for s in result.steps)
    masked = Masked(target.model, engine.grammars.compile(grammar), len(prompt), eos)
    pvalue, tokens = pit_pvalue(masked, prompt, outputs, sampling)
    assert tokens >= 5 * 12 and accepted > 0  # at least 'yes, because' and 10 letters each
    assert pvalue > 1e-3


def test_bad_grammars_are_refused_before_decoding(pair):
    engine = make_engine(pair, "autoregressive", 0)
    prompt = engine.encode_chat("hi")
    cases = [(Grammar(GrammarKind.JSON_SCHEMA, '{"type": "objectx"}'), 'Unsupported type "objectx"'),
             (Grammar(GrammarKind.JSON_SCHEMA, '{"type": '), "the schema is not JSON"),
             (Grammar(GrammarKind.JSON_SCHEMA, '[1, 2]'), "a schema is an object or a boolean"),
             (Grammar(GrammarKind.REGEX, "a("), "parenthesis is not closed"),
             (Grammar(GrammarKind.EBNF, 'start ::= "a"'), 'root rule with name "root" is not found')]
    for grammar, message in cases:
        with pytest.raises(ValueError, match="invalid .* grammar: .*" + message.replace("(", r"\(")):
            engine.validate(GenerationRequest(prompt, 8, grammar=grammar))
    with pytest.raises(ValueError, match="needs a stop token"):
        engine.validate(GenerationRequest(prompt, 8, grammar=GRAMMARS["regex"], ignore_eos=True))
    with pytest.raises(ValueError, match="needs its source"):
        Grammar(GrammarKind.REGEX, " ")
    with pytest.raises(ValueError, match="takes no source"):
        Grammar(GrammarKind.JSON_OBJECT, "{}")


def test_the_xgrammar_pins_agree():
    """The Makefile and the Dockerfile install the xgrammar the error message names (--no-deps), and it is this one."""
    root = Path(__file__).resolve().parents[2]
    pins = XGRAMMAR_INSTALL.removeprefix("pip install --no-deps ")
    assert f"pip install -q --no-deps {pins}" in (root / "Makefile").read_text()
    assert f"pip install --no-deps {pins}" in (root / "Dockerfile").read_text()
    assert f"xgrammar=={version('xgrammar')}" in pins


def test_the_drafter_drafts_from_masked_rows(pair):
    """The drafter's rows are masked as the target's, each from its node's path: no probability on a token the
    grammar forbids there, so its trees spend no node on one (engine/drafters/model_runner.py)."""
    target, drafter = pair
    tok = target.tokenizer
    vocab = target.model.config.vocab_size
    runner = DrafterRunner(drafter, vocab, tokenizer=tok)
    output = tok.encode('{"name": "Rex", "kind": "')
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(PET), prompt_tokens=2, stop_ids=(tok.eos_token_id,))
    context = [1, 2, *output]
    oracle = runner.begin("d", context, SamplingParams(temperature=1.0), grammar=grammar)
    dog = tok.encode("dog")[0]
    root, child = runner.extend_many([oracle], [[0, 1]], [[output[-1], dog]], [[-1, 0]])[0]
    compiled = runner.grammars.compiler.compile(grammar)
    for row, path in ((root, []), (child, [dog])):
        allowed = fresh_mask(compiled, output + path, tok.eos_token_id, vocab)
        assert float(row[~allowed].sum()) == 0.0 and abs(float(row[allowed].sum()) - 1.0) < 1e-4
    runner.release("d")
    assert len(runner.grammars) == 0
