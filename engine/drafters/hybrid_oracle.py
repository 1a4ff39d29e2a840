"""`HybridOracle`: a draft oracle mixing a model drafter's rows with copy-from-context candidates, so the
tree builders weigh both sources on one scale. Overview: engine/lookup/."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from ..builders.base import DraftOracle, RowSummary
from ..c2t_classifier import top_entropy
from ..lookup.grammar_copies import GrammarCopies
from ..lookup.session import AheadLookup, LookupSession
from ..lookup.suffix_index import LookupRow, LookupState
from ..lookup.trees import LookupPlan, plan_lookup
from ..sampling import topk_rows
from ..tree import Source
from .model_runner import SessionOracle
from .run_ahead import OffsetOracle


class _Node:
    __slots__ = ("state", "row", "path", "model", "inherit", "top1")

    def __init__(self, state: LookupState, row: LookupRow | None, path: tuple[int, ...], model: bool,
                 inherit: bool) -> None:
        self.state, self.row, self.path, self.model = state, row, path, model
        self.inherit = inherit  # whether the model drafts below it (again after a forced chain: `model` is off there)
        self.top1 = -1  # the model's most probable next token, once its row was read


class HybridOracle(DraftOracle):
    """DraftOracle (with `summarize`) over a model oracle and a LookupSession: rows are (1 - w) q + c where the
    node has lookup candidates c (w = sum c), q alone where it has none, c alone where the model gives no row
    (`model_backed` False: the model is off this step, or an ancestor or the node itself has a lookup candidate
    at least `skip_model_above` probable; or the request's grammar forces the node's next tokens, copied for free as
    a chain from it, below whose end the model drafts again: engine/lookup/grammar_copies.py). It is its own
    `lookup` (a builders.base.LookupSource): `candidates`, `model_backed`, `model_probs` (sampled builders),
    `source_of` (PartialTree labels children) and `plan` (lookup-only trees) read the same per-node state as its
    rows."""

    def __init__(self, model, session: LookupSession | AheadLookup | GrammarCopies, vocab_size: int,
                 model_enabled: bool = True,
                 head_index: dict[int, int] | None = None) -> None:
        self.model = model  # a DraftOracle, or None for lookup-only drafting
        self.session = session
        self.settings = session.settings
        self.vocab_size = vocab_size
        self.model_enabled = model_enabled and model is not None
        self._head_index = head_index  # target id -> row of the model's head (a SessionOracle with vocab_ids)
        self._nodes: dict[int, _Node] = {}

    @property
    def lookup(self) -> "HybridOracle":
        """`DraftOracle.lookup`: this oracle (a property, not an attribute holding itself: no reference cycle
        keeping a step's rows alive until the garbage collector runs)."""
        return self

    # ------------------------------------------------------------------ lookup side (LookupSource)
    def _node(self, tokens: Sequence[int], parents: Sequence[int], node: int) -> _Node:
        info = self._nodes.get(node)
        if info is not None:
            return info
        pending = []
        while node not in self._nodes and node > 0:
            pending.append(node)
            node = parents[node]
        if 0 not in self._nodes:
            state = self.session.root_state()
            self._nodes[0] = self._make(state, (), self.model_enabled, root=True)
        for n in reversed(pending):
            parent = self._nodes[parents[n]]
            path = parent.path + (tokens[n],)
            state = self.session.child_state(parent.state, tokens[n], path)
            self._nodes[n] = self._make(state, path, parent.inherit)
        return self._nodes[pending[0] if pending else 0]

    def _make(self, state: LookupState, path: tuple[int, ...], inherit: bool, root: bool = False) -> _Node:
        row = self.session.row(state)
        if row is not None:
            self.session.predict(path, row)
            if not root and not state.forced and row.values[0] >= self.settings.skip_model_above:
                inherit = False
        # Where the grammar forces the next tokens the model's row is not needed: the forced chain is drafted as
        # copies, and the model's first row below it feeds the chain in the same forward.
        return _Node(state, row, path, inherit and not state.forced, inherit)

    def candidates(self, tokens: Sequence[int], parents: Sequence[int], node: int) -> LookupRow | None:
        return self._node(tokens, parents, node).row

    def model_backed(self, tokens: Sequence[int], parents: Sequence[int], node: int) -> bool:
        return self._node(tokens, parents, node).model

    def source_of(self, parent: int, token: int) -> int:
        """Source of a child `token` of `parent` (a node this oracle has seen)."""
        info = self._nodes.get(parent)
        if info is None or info.row is None or token not in info.row.tokens:
            return int(Source.MODEL)
        return int(Source.BOTH) if info.top1 == token else int(Source.LOOKUP)

    def plan(self, root_token: int, max_nodes: int, min_value: float) -> LookupPlan:
        return plan_lookup(self.session, root_token, max_nodes, min_value)

    # ------------------------------------------------------------------ rows
    def _split(self, tokens, parents, node_ids) -> tuple[list[_Node], list[int]]:  # type: ignore[no-untyped-def]
        infos = [self._node(tokens, parents, n) for n in node_ids]
        return infos, [n for n, info in zip(node_ids, infos) if info.model]

    def model_probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        """The model drafter's own rows [k, V] (model-backed nodes only)."""
        infos, backed = self._split(tokens, parents, node_ids)
        if len(backed) != len(node_ids):
            raise ValueError("model_probs: a node without a model row (lookup-only)")
        rows = self.model.probs(tokens, parents, node_ids)
        for info, row in zip(infos, rows):
            info.top1 = int(row.argmax())
        return rows

    def probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        """Mixed rows [k, V] (see the class docstring); a lookup-only row sums to w < 1."""
        infos, backed = self._split(tokens, parents, node_ids)
        model_rows = dict(zip(backed, self.model_probs(tokens, parents, backed).unbind(0))) if backed else {}
        out = []
        for node, info in zip(node_ids, infos):
            row = model_rows.get(node)
            if row is None:
                mixed = torch.zeros(self.vocab_size)
            elif info.row is None:
                out.append(row)
                continue
            else:
                mixed = row.float() * (1.0 - info.row.total)
            if info.row is not None:
                mixed[list(info.row.tokens)] += torch.tensor(info.row.values, dtype=mixed.dtype)
            out.append(mixed)
        return torch.stack(out)

    def summarize(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int], k: int,
                  entropy: bool) -> RowSummary:
        """Top-k (and the C2T entropy) of the mixed rows, summarised on the model's head where it has one."""
        infos, backed = self._split(tokens, parents, node_ids)
        count = len(node_ids)
        values = torch.zeros(count, k)
        toks = torch.zeros(count, k, dtype=torch.long)
        ent = torch.zeros(count) if entropy else None
        model_summary = self._model_summary(tokens, parents, backed, k, entropy) if backed else None
        j = 0
        for i, info in enumerate(infos):
            if info.model:
                values[i], toks[i] = model_summary.values[j], model_summary.tokens[j]
                if ent is not None:
                    ent[i] = model_summary.entropy[j]
                j += 1
            elif info.row is not None:
                m = min(k, len(info.row.tokens))
                values[i, :m] = torch.tensor(info.row.values[:m])
                toks[i, :m] = torch.tensor(info.row.tokens[:m])
                if ent is not None:
                    ent[i] = -sum(c * math.log(c) for c in info.row.values if c > 0)
        return RowSummary(values, toks, ent)

    def _model_summary(self, tokens, parents, nodes: list[int], k: int, entropy: bool) -> RowSummary:  # type: ignore[no-untyped-def]
        infos = [self._nodes[n] for n in nodes]
        fast = self._head_rows(tokens, parents, nodes)
        if fast is None:  # any oracle: mix the full rows, summarise them
            mixed = self.probs(tokens, parents, nodes)
            vals, toks = topk_rows(mixed, k)
            return RowSummary(vals, toks, top_entropy(mixed) if entropy else None)
        head, model = fast
        index = self._head_index
        extras: dict[int, list[tuple[float, int]]] = {}
        for i, info in enumerate(infos):
            if info.row is None:
                continue
            head[i].mul_(1.0 - info.row.total)
            for token, c in zip(info.row.tokens, info.row.values):
                j = token if index is None else index.get(token, -1)
                if j >= 0:
                    head[i, j] += c
                else:  # outside the drafter's head: q = 0 there, the mixed value is c
                    extras.setdefault(i, []).append((c, token))
        width = k + max((len(e) for e in extras.values()), default=0)
        summary = model.summarize_head(head, width, entropy)
        if not extras:
            return summary if width == k else RowSummary(summary.values[:, :k], summary.tokens[:, :k], summary.entropy)
        vals, toks = summary.values[:, :k].clone(), summary.tokens[:, :k].clone()
        ent = summary.entropy
        for i, extra in extras.items():
            merged = sorted(list(zip(summary.values[i].tolist(), summary.tokens[i].tolist())) + extra,
                            key=lambda vt: -vt[0])[:k]
            vals[i] = torch.tensor([v for v, _ in merged])
            toks[i] = torch.tensor([t for _, t in merged])
            if ent is not None:  # their terms join the head's top-1000 entropy (exact up to that cut)
                ent[i] += -sum(c * math.log(c) for c, _ in extra if c > 0)
        return RowSummary(vals, toks, ent)

    def _head_rows(self, tokens, parents, nodes: list[int]):  # type: ignore[no-untyped-def]
        """([n, V_draft] copies of the model's head rows, the model) for a SessionOracle (or an OffsetOracle over
        one, drafting ahead below a guessed path), else None; records each node's model top-1 (for BOTH labels)."""
        model = self.model
        if not isinstance(model, (SessionOracle, OffsetOracle)):
            return None
        head = model.head_rows(tokens, parents, nodes)
        for n, t in zip(nodes, model.target_ids(head.argmax(dim=1)).tolist()):
            self._nodes[n].top1 = t
        return head, model


def head_index(vocab_ids: Tensor | None) -> dict[int, int] | None:
    """Target token id -> row of a restricted drafter head (`vocab_ids`), None for a full head."""
    return None if vocab_ids is None else {int(t): i for i, t in enumerate(vocab_ids.tolist())}
