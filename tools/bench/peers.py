"""What a user would pick instead of TreeServe, run by `treeserve bench --peers hf` in the same run.

Three Hugging Face `generate` configurations on the same target model object (same weights, same kernels,
same threads), the same prompts, the same interleaved repeats and the same greedy check as TreeServe's
methods:

- `hf-generate`: plain greedy `model.generate` (the reference every speedup can also be read against);
- `hf-pld`: prompt-lookup decoding, `prompt_lookup_num_tokens=10` (transformers' n-gram drafting: candidates
  are copied from the prompt / earlier output, one argument to switch on);
- `hf-compiled`: greedy `generate` with a static KV cache (`cache_implementation="static"`), which transformers
  compiles with `torch.compile(mode="reduce-overhead")` (CUDA graphs) on a GPU: the gpt-fast recipe as
  transformers ships it (on a CPU it does not compile, so there it is the static cache alone). The first
  prompts of each new length compile: the bench's warm-up prompts take most of that;
- `hf-assisted:NAME`: assisted generation (`assistant_model=`) with a shipped drafter. transformers can run
  the distilled drafter (`default`: a Llama trunk whose head covers a sub-vocabulary) once its head is
  widened to the full vocabulary (every other token gets the dtype's lowest logit, so its greedy proposals
  are its own); an EAGLE drafter reads the target's hidden states, which assisted generation cannot pass,
  and a parallel drafter needs mask tokens: those are skipped with the reason printed.

Steps and accepted lengths are counted from the target's own forwards (a pre-forward hook): forward i
starts at position p_i (its first position id); the committed sequence before it is the prompt (i = 0) or
p_i + 1 tokens (its last token not yet in the cache), so forward i emitted c_{i+1} - c_i tokens and scored
`input length - unfed committed tokens` candidates. MAL = tokens / target forwards, as for TreeServe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from treeserve.engine.drafters.models.base import DrafterModel
from treeserve.engine.drafters.models.loading import load_drafter
from treeserve.engine.drafters.models.parallel import is_parallel_drafter
from treeserve.engine.drafters.registry import drafter_dir
from treeserve.engine.models.hf_cache import cache_keyword

from .options import PEER_SETS

PLD_TOKENS = 10  # prompt_lookup_num_tokens: transformers' documented example value, the one users copy


@dataclass
class Outcome:
    """One generation of one prompt by a TreeServe method or a peer, in the bench's common terms."""

    token_ids: list[int]
    text: str
    wall_time_s: float
    accept_lengths: list[int]  # tokens emitted by each target forward (bonus included); sums to len(token_ids)
    candidates: list[int]  # draft tokens scored by each target forward
    drafter_forwards: int = 0  # drafter model forwards
    drafter_tokens: int = 0  # tokens fed to the drafter over those forwards
    step_ms: dict[str, float] = field(default_factory=dict)  # engine-only timings (draft/model/forward/overhead)


class ForwardLog:
    """Records (first position id, input length) of every forward of `module` while active."""

    def __init__(self, module):
        self.module = module
        self.calls: list[tuple[int, int]] = []
        self._handle = None

    def _hook(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("position_ids")
        cache = kwargs.get(cache_keyword(type(self.module)))
        if positions is not None:
            start = int(positions.reshape(-1)[0])
        elif cache is not None and hasattr(cache, "get_seq_length"):
            start = int(cache.get_seq_length())
        else:
            start = 0
        self.calls.append((start, int(ids.shape[-1]) if ids is not None else 0))

    def __enter__(self) -> "ForwardLog":
        self.calls = []
        self._handle = self.module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def step_counts(calls: list[tuple[int, int]], prompt_len: int, new_tokens: int) -> tuple[list[int], list[int]]:
    """(tokens emitted, candidates scored) per target forward from (start position, input length) records
    (module docstring). The last forward emits what is left (generation may stop inside its accepted run)."""
    if not calls:
        return [], []
    committed = [prompt_len] + [start + 1 for start, _ in calls[1:]] + [prompt_len + new_tokens]
    emitted = [committed[i + 1] - committed[i] for i in range(len(calls))]
    candidates = [length - (committed[i] - start) for i, (start, length) in enumerate(calls)]
    return emitted, candidates


class FullVocabHead(nn.Module):
    """A sub-vocabulary head (`vocab_ids`) widened to full-vocabulary logits: every other token gets the
    dtype's lowest logit, so greedy proposals are the drafter's own."""

    def __init__(self, head: nn.Module, vocab_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head = head
        self.register_buffer("vocab_ids", vocab_ids.clone(), persistent=False)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = self.head(hidden)
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), torch.finfo(sub.dtype).min)
        return out.index_copy(-1, self.vocab_ids, sub)


def hf_assistant(name: str, target_model):
    """An assistant model transformers' assisted generation can run, built from drafter `name`, or
    (None, reason) when it cannot run this drafter."""
    from transformers import LlamaForCausalLM, PreTrainedModel

    if is_parallel_drafter(drafter_dir(name)):
        return None, f"{name} is a parallel drafter (mask tokens; assisted generation feeds plain tokens)"
    drafter = load_drafter(name, target_model)
    if isinstance(drafter, DrafterModel) and drafter.reads_target_features:
        return None, (f"{name} is an EAGLE drafter: it reads the target's hidden states, which transformers' "
                      "assisted generation does not pass to an assistant")
    if isinstance(drafter, PreTrainedModel):
        return drafter, ""
    # A TreeServe drafter over a restricted vocabulary: its trunk under a full-vocabulary head.
    if not isinstance(drafter, DrafterModel) or drafter.vocab_ids is None:
        return None, f"{name}: {type(drafter).__name__} is not a causal LM transformers can drive"
    import copy

    config = copy.deepcopy(drafter.config)
    config.tie_word_embeddings = False
    config.vocab_size = target_model.config.vocab_size
    wrapper = LlamaForCausalLM(config)
    wrapper.model = drafter.model
    wrapper.lm_head = FullVocabHead(drafter.head, drafter.vocab_ids, target_model.config.vocab_size)
    wrapper.generation_config = copy.deepcopy(target_model.generation_config)
    weight = next(target_model.parameters())
    return wrapper.to(device=weight.device, dtype=weight.dtype).eval(), ""


class HFPeer:
    """One Hugging Face `generate` configuration on the target model (module docstring)."""

    def __init__(self, key: str, target, assistant=None):
        self.key = key
        self.target = target  # LoadedModel
        self.assistant = assistant
        self.drafter = "-"  # the assistant's drafter name or path
        self.kwargs: dict = {}
        if key.startswith("hf-pld"):
            self.kwargs = {"prompt_lookup_num_tokens": PLD_TOKENS}
        elif key == "hf-compiled":
            self.kwargs = {"cache_implementation": "static"}
        elif key.startswith("hf-assisted"):
            self.kwargs = {"assistant_model": assistant}

    def generate(self, prompt: list[int], max_new_tokens: int) -> Outcome:
        model = self.target.model
        ids = torch.tensor([prompt], device=model.device)
        drafter_log = ForwardLog(self.assistant) if self.assistant is not None else None
        with torch.inference_mode(), ForwardLog(model) as log:
            if drafter_log:
                drafter_log.__enter__()
            try:
                started = time.perf_counter()
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, top_p=None, top_k=None, temperature=None, **self.kwargs)
                wall = time.perf_counter() - started
            finally:
                if drafter_log:
                    drafter_log.__exit__()
        # transformers < 5.14's assisted decoding (prompt lookup, an assistant) can accept past max_new_tokens in
        # its last step (greedy tokens all the same); 5.14 crops them, as this does for the versions before.
        tokens = out[0, len(prompt):len(prompt) + max_new_tokens].tolist()
        emitted, candidates = step_counts(log.calls, len(prompt), len(tokens))
        text = self.target.tokenizer.decode(tokens, skip_special_tokens=True)
        return Outcome(tokens, text, wall, emitted, candidates,
                       drafter_forwards=len(drafter_log.calls) if drafter_log else 0,
                       drafter_tokens=sum(n for _, n in drafter_log.calls) if drafter_log else 0)


def build_peers(names: list[str], target, assistant_drafter: str) -> tuple[list[HFPeer], list[str]]:
    """Peers for `--peers` names ('hf' = all three) -> (peers, printed reasons for the skipped ones)."""
    wanted: list[str] = []
    for name in names:
        if name not in PEER_SETS:
            raise ValueError(f"unknown peer set {name!r}; choose from {', '.join(PEER_SETS)}")
        wanted += [p for p in PEER_SETS[name] if p not in wanted]
    peers, skipped = [], []
    for name in wanted:
        if name == "hf-assisted":
            assistant, reason = hf_assistant(assistant_drafter, target.model)
            if assistant is None:
                skipped.append(f"hf-assisted skipped: {reason}")
                continue
            short = Path(assistant_drafter).name if "/" in assistant_drafter else assistant_drafter
            peers.append(HFPeer(f"hf-assisted:{short}", target, assistant))
            peers[-1].drafter = assistant_drafter
        else:
            peers.append(HFPeer(name, target))
    return peers, skipped
