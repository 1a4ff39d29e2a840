"""Drafting: everything that proposes draft tokens for the target to verify.

- base.py: the `Drafter` protocol (what the engine and the services read from a drafter) and DraftRequest;
- registry.py: drafter kinds (kind -> Drafter class) and the shipped drafters' names (-> weights/<name>);
- loading.py: `build_local_drafter`, a ready drafter for a target from a kind and a path;
- dtype_choice.py: drafter dtype "auto", the faster of the target's dtype and bfloat16 on this machine;
- autoregressive.py: `LocalDrafter`, one drafter forward per tree depth, trees shaped by engine/builders;
- model_runner.py: `DrafterRunner`, the drafter model over its KV cache as the builders' oracle;
- batched_c2t_chains.py: C2T chains drafted together above batch size 1;
- parallel.py and parallel_tree_search.py: ParallelSpec's drafter and its tree search over k+1 positions;
- models/: the drafter models, their shared base and on-disk layout, loading and the pair check.

Kept import-light: the protocol and the registry load no drafter model (config validation reads the registry
without torch).
"""
