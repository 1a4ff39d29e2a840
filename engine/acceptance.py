"""Expected accepted length E(A) of a draft tree under the draft-as-target assumption.

Assume the target's next token after every node is distributed like the draft's q there. Then a
draft node is accepted iff every token on its root path is the one the target would emit, which
happens with probability prod_{j in path} q(t_j) = exp(log_joint) -- OPT-Tree eq. (3), the sum of
p-hat over the tree. For children drawn without replacement DySpec reaches the same per-node value:
eq. (6)-(10) give P[verify_i | path_i] * draft_{t_i} = (1 - sum_{earlier siblings} d) *
d_{t_i} / (1 - sum_{earlier siblings} d) = d_{t_i}, so eq. (11) with rho = 1 is again the sum of
the path products. Hence one formula covers every ChildDraw.

Counting (docs/design.md section 7): MAL counts the bonus/recovered token, so

    expected_accepted_length(tree) = 1 + sum_{i >= 1} exp(log_joint[i])

i.e. OPT-Tree's E(A) (which excludes the root and the bonus token) plus one. Use
`expected_accepted_drafts` for the paper's value without the bonus token (as C2T counts).
"""

from __future__ import annotations

from .tree import TokenTree


def expected_accepted_drafts(tree: TokenTree) -> float:
    """OPT-Tree eq. (3) / DySpec eq. (11): expected number of accepted draft tokens (bonus excluded)."""
    return float(tree.log_joint[1:].double().exp().sum())


def expected_accepted_length(tree: TokenTree) -> float:
    """Expected tokens emitted per target forward (accepted drafts + the bonus token), MAL units."""
    return 1.0 + expected_accepted_drafts(tree)
