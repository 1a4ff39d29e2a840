"""Structured output: a request's grammar (a JSON schema, any JSON object, a regex or an EBNF grammar) masks the
target's distribution at every tree node from that node's own matcher state (docs/design.md section 5).

- spec.py (torch-free): what a request asks for, `Grammar`, as the wire and the front ends carry it;
- compiler.py: the grammar compiled with xgrammar for one tokenizer (compiled grammars cached per tokenizer and
  grammar by xgrammar's compiler), errors as ValueError naming the problem;
- matchers.py: a session's matcher kept at its context (the Target's state, rebuilt from the context when
  missing) and the per-node token masks of a tree, from xgrammar's tree traversal (accept, fill, roll back).

Nothing is imported here: spec.py is read by torch-free modules (engine/requests.py), the rest needs torch.
"""
