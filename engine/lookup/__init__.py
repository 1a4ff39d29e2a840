"""Copy-from-context drafting (this package): a draft source with no model, and the hybrid oracle that merges its candidates
with a model drafter's distributions in one dynamic token tree.

Answers often copy their prompt (summaries, extraction, retrieval-augmented answers, code edits) or repeat
themselves. Prompt lookup decoding (Saxena 2023; transformers' `PromptLookupCandidateGenerator`, vLLM's n-gram
proposer) drafts by matching the sequence's last n-gram in the context and copying what followed;
SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975; ArcticInference's suffix trees) matches the longest
suffix, counts every continuation of the match and expands the most probable ones into a tree. Here:

- `SuffixIndex`: every n-gram (n <= max_ngram) of the request's tokens (prompt + output) maps to the positions
  where it ends, extended in O(max_ngram) per appended token, never rescanned. A match longer than max_ngram
  is measured by extending it backwards at each occurrence, and a tree path that keeps copying carries its
  occurrences along (`LookupState`: the end positions of the longest match, shifted by one per copied token),
  so match lengths are exact along copy chains. Continuations of the longest match, counted over its
  occurrences (SuffixDecoding's counts), are the node's candidates (`LookupRow`).
- Probabilities: a candidate's probability is P(the target's next token is one of the candidates | match
  length) times its share of the counts. That probability is calibrated online per request from what the
  target actually emitted after each node of an accepted path (a Beta posterior per match-length bucket),
  with a prior pooled over the drafter's earlier requests (`LookupStats`), itself starting from a fixed
  prior. Builders then weigh lookup candidates against model drafts on one scale.
- `HybridOracle`: a DraftOracle whose rows are the mixture (1 - w) q + c, q the model drafter's row and c the
  lookup candidates' probabilities (w = sum c): the top-k builders (EAGLE-2, OPT-Tree, C2T, DySpec at T = 0,
  chains) rank merged candidates with no change (shared prefixes are merged by construction: a token both
  sources propose is one child). Nodes whose continuation the lookup knows confidently, and everything below
  them, get no model row at all (the drafter forward is skipped there). Sampled builders (DySpec, SpS chains
  at T > 0) add lookup candidates as deterministic children first and sample the model's children from q
  without those tokens; the verifier applies the point-mass rule to the former (engine/verify.py).
- `SharedOutputs` (optional, off by default: `LookupSettings.shared_tokens`): SuffixDecoding's global tree, an
  index of the drafter's recent requests' outputs bounded in tokens; a node drafts from them where their
  best candidate is more probable than its own context's, calibrated in buckets of their own.
- `PredictedOutput`: the request's predicted output (OpenAI's Predicted Outputs) as a third index, read in order:
  the output's position in it is tracked token by token and found again past an edit (nearest occurrence ahead),
  so a node's candidate is the next predicted token, calibrated in buckets of its own.
- `GrammarCopies`: a request with a grammar (structured output) sees its copies through it: candidates the grammar
  refuses at a node are dropped, and the text it forces there (xgrammar's jump-forward string, tokenized) is a copy
  chain of its own (`Origin.FORCED`, calibrated in buckets of its own), drafted without a model row.
- `LookupPlan`: the lookup-only tree, best-first by path probability (SuffixDecoding's tree expansion), whose
  cumulative values are the expected accepted tokens the hardware-aware chooser prices a step without the
  model drafter by (engine/budget.py).

Every lookup candidate is a deterministic function of the context, so verification stays lossless.

Modules: suffix_index (the index, match states and candidate rows), session (per-request calibration and
predictions, pooled prior, settings), shared_outputs (the cross-request index), prediction (the predicted
output and OpenAI's usage counts of it), grammar_copies (the copies a grammar allows and forces), trees
(lookup-only trees and chains). The package exports only the torch-free parts (the Serve config validates `speculation.lookup` without
torch): import the trees from `lookup.trees`. The mixing oracle drives a drafter model, so it lives with the
drafters (engine/drafters/hybrid_oracle.py).
"""

from .session import (MATCH_BUCKETS, PRIOR_HIT, PRIORS, AheadLookup, LookupSession, LookupSettings, LookupSources,
                      LookupStats, match_bucket)
from .prediction import PredictedOutput, prediction_usage
from .shared_outputs import SharedOutputs
from .suffix_index import NO_MATCH, SEPARATOR, LookupRow, LookupState, Origin, SuffixIndex

__all__ = [
    "MATCH_BUCKETS", "PRIOR_HIT", "PRIORS", "NO_MATCH", "SEPARATOR", "AheadLookup", "LookupRow", "LookupSession",
    "LookupSettings", "LookupSources", "LookupState", "LookupStats", "Origin", "PredictedOutput", "SharedOutputs",
    "SuffixIndex", "match_bucket", "prediction_usage",
]
