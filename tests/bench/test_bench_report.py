"""`treeserve bench` on the tiny pair: Spec-Bench answers that Spec-Bench's speed.py arithmetic reads, the HF
peers (same tokens as greedy generate), pictures, the projection's cost model, and a documented --help."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch

from treeserve.cli import bench
from treeserve.tools.bench import peers as peers_module
from treeserve.tools.bench.greedy import greedy_reference
from treeserve.tools.bench.peers import ForwardLog, HFPeer, build_peers, hf_assistant, step_counts
from treeserve.tools.bench.report import MethodStats, summarize
from treeserve.tools.bench.runner import AR_KEY, HF_KEY
from treeserve.engine.drafters.models.base import DrafterModel
from treeserve.engine.models.loading import chat_ids


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from treeserve.engine.models.loading import load_causal_lm

    torch.set_num_threads(1)
    return load_causal_lm(tiny_target_dir)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [(81, "writing", "Write a short poem about the sea."), (131, "extraction", "List the names: Ann met Bo."),
            (321, "qa", "Why is the sky blue?")]
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t, "second turn"]}) + "\n"
                            for i, c, t in rows))
    return path


def speed_py(jsonl_file, jsonl_file_base, tokenizer, task="overall"):
    """The arithmetic of Spec-Bench's evaluation/speed.py `speed()` (hemingkx/Spec-Bench), line for line."""
    mt_bench_list = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]

    def load(path):
        data = []
        with open(path, "r", encoding="utf-8") as file:
            for line in file:
                obj = json.loads(line)
                if task == "overall" or (task == "mt_bench" and obj["category"] in mt_bench_list) \
                        or obj["category"] == task:
                    data.append(obj)
        return data

    speeds, accept_lengths_list = [], []
    for datapoint in load(jsonl_file):
        tokens = sum(datapoint["choices"][0]["new_tokens"])
        times = sum(datapoint["choices"][0]["wall_time"])
        accept_lengths_list.extend(datapoint["choices"][0]["accept_lengths"])
        speeds.append(tokens / times)
    speeds0 = []
    for datapoint in load(jsonl_file_base):
        tokens = sum(len(tokenizer(i).input_ids) - 1 for i in datapoint["choices"][0]["turns"])
        speeds0.append(tokens / sum(datapoint["choices"][0]["wall_time"]))
    return (np.array(speeds).mean(), np.array(speeds0).mean(), np.array(speeds).mean() / np.array(speeds0).mean(),
            np.mean(accept_lengths_list))


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, prompts_file, tiny_target_dir, tiny_drafter_dir):
    out = tmp_path_factory.mktemp("bench")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--prompts", str(prompts_file), "--num-prompts", "3", "--max-new-tokens", "12",
                              "--target", str(tiny_target_dir), "--drafter", str(tiny_drafter_dir),
                              "--peer-drafter", str(tiny_drafter_dir), "--threads", "1", "--warmup-prompts", "0",
                              "--drafter-dtype", "bfloat16",  # a bfloat16 drafter for the float32 target: lossless
                              "--methods", "autoregressive", "chain:4", "--check-greedy",
                              "--peers", "hf", "--answers-dir", str(out / "answers"), "--json-out",
                              str(out / "bench.json"), "--plot", str(out / "plots"), "--sweep-methods", "eagle2",
                              "--sweep-budgets", "4", "8", "--sweep-prompts", "2"])
    assert bench.run(args) == 0
    return out, json.loads((out / "bench.json").read_text())


def test_answer_files_are_spec_bench_format(bench_run, tiny):
    out, _ = bench_run
    answers = out / "answers"
    base = answers / "autoregressive-auto.jsonl"
    for path in sorted(answers.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert [a["question_id"] for a in lines] == [81, 131, 321]
        for a in lines:
            choice = a["choices"][0]
            assert {"question_id", "category", "answer_id", "model_id", "tstamp"} <= set(a)
            assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == 1
            assert all(isinstance(n, int) and n >= 1 for n in choice["accept_lengths"])  # ONE flat list
            assert sum(choice["accept_lengths"]) == choice["new_tokens"][0]
            assert len(choice["accept_lengths"]) == choice["decoding_steps"][0]
        # speed.py's arithmetic runs on the file as written, for each of its tasks that has rows here.
        for task in ("overall", "mt_bench", "qa"):
            tps, tps_base, ratio, mal = speed_py(path, base, tiny.tokenizer, task)
            assert tps > 0 and tps_base == tps_base and ratio > 0 and mal >= 1
        if path == base:
            assert speed_py(path, base, tiny.tokenizer)[3] == 1.0  # plain decoding: one token per forward


def test_rows_name_drafters_and_compare_with_peers(bench_run, tiny_drafter_dir):
    _, report = bench_run
    rows = {r["key"]: r for r in report["rows"]}
    assisted = f"hf-assisted:{tiny_drafter_dir.name}"
    assert set(rows) == {"autoregressive:auto", "chain:4", "hf-generate", "hf-pld", assisted}
    assert rows[assisted]["drafter"] == str(tiny_drafter_dir)
    assert rows["chain:4"]["drafter"] == f"{tiny_drafter_dir} (bfloat16)"
    assert rows["autoregressive:auto"]["drafter"] == "-"
    for key, row in rows.items():
        assert row["greedy_mismatches"] == 0, key  # peers pass the same greedy check
        assert row["speedup"] > 0 and row["speedup_vs_hf"] > 0
        assert set(row["category_speedups"]) == {"writing", "extraction", "qa"}
        assert set(row["category_speedups_vs_hf"]) == {"writing", "extraction", "qa"}
    assert rows["autoregressive:auto"]["speedup"] == pytest.approx(1.0)
    assert rows["hf-generate"]["speedup_vs_hf"] == pytest.approx(1.0)
    assert rows["hf-generate"]["mal"] == pytest.approx(1.0) and rows["hf-generate"]["candidates_per_step"] == 0
    assert rows["chain:4"]["drafter_forwards_per_step"] > 0 and rows[assisted]["drafter_forwards_per_step"] > 0
    projected = {p["key"]: p for p in report["projection"]}
    assert set(projected) == {"autoregressive:auto", "chain:4"}  # measured TreeServe methods only
    for name in ("projected_speedup[Llama-2-70B 4xA100]", "projected_speedup[Vicuna-33B 4xA100]"):
        assert projected["autoregressive:auto"][name] == pytest.approx(1.0)
    assert [(s["method"], s["budget"]) for s in report["sweep"]] == [("eagle2", 4), ("eagle2", 8)]


def test_plots_are_written(bench_run):
    out, _ = bench_run
    for name in ("speedup_by_category.png", "mal_vs_candidates.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_counts_from_target_forwards():
    # prompt 5 tokens; forward 0 = prefill + 3 candidates, 2 accepted (+1 bonus); forward 1 feeds the last
    # committed token + 2 candidates; forward 2 a plain step; generation stopped after 6 new tokens.
    calls = [(0, 8), (7, 3), (9, 1)]
    assert step_counts(calls, prompt_len=5, new_tokens=6) == ([3, 2, 1], [3, 2, 0])
    plain = [(0, 5), (5, 1), (6, 1)]
    assert step_counts(plain, prompt_len=5, new_tokens=3) == ([1, 1, 1], [0, 0, 0])
    assert step_counts([], 5, 0) == ([], [])


def test_hf_assisted_runs_a_restricted_vocabulary_drafter(tmp_path, tiny):
    """A drafter with a sub-vocabulary head drives transformers' assisted generation once widened; the output
    is the target's greedy output and the drafter's forwards are counted."""
    from treeserve.engine.drafters.models.distilled import RestrictedVocabDrafter
    vocab = tiny.model.config.vocab_size
    ids = torch.unique(torch.cat([torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:vocab // 2],
                                  torch.arange(8)]))
    RestrictedVocabDrafter.from_target(tiny.model, [0], ids).save(tmp_path / "restricted")
    assistant, reason = hf_assistant(str(tmp_path / "restricted"), tiny.model)
    assert assistant is not None, reason
    with torch.inference_mode():
        logits = assistant(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == vocab
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[ids] = False
    assert bool((logits[0, :, outside] == torch.finfo(logits.dtype).min).all())
    prompt = chat_ids(tiny.tokenizer, "Tell me about rivers.")
    reference, _ = greedy_reference(tiny.model, prompt, 10)
    outcome = HFPeer("hf-assisted:restricted", tiny, assistant).generate(prompt, 10)
    assert outcome.token_ids == reference
    assert sum(outcome.accept_lengths) == len(reference) and outcome.drafter_forwards > 0


def test_eagle_drafter_is_skipped_with_a_reason(tiny, monkeypatch):
    """transformers cannot feed an EAGLE drafter the target's hidden states: hf-assisted is skipped, the reason
    printed, the other peers still run."""
    class FeatureReader(DrafterModel):
        reads_target_features = True

    monkeypatch.setattr(peers_module, "load_drafter", lambda name, target: FeatureReader())
    peers, skipped = build_peers(["hf"], tiny, "eagle")
    assert [p.key for p in peers] == ["hf-generate", "hf-pld"]
    assert len(skipped) == 1 and "EAGLE" in skipped[0] and "hidden states" in skipped[0]
    with pytest.raises(ValueError, match="unknown peer set"):
        build_peers(["vllm"], tiny, "distilled")
    # one peer named alone, or sets overlapping: each peer once, in the sets' order
    assert [p.key for p in build_peers(["hf-pld"], tiny, "eagle")[0]] == ["hf-pld"]
    assert [p.key for p in build_peers(["hf-pld", "hf-generate", "hf-pld"], tiny, "eagle")[0]] == ["hf-pld", "hf-generate"]


def test_forward_log_reads_first_position(tiny):
    with torch.inference_mode(), ForwardLog(tiny.model) as log:
        tiny.model(input_ids=torch.tensor([[1, 2, 3]]), position_ids=torch.tensor([[4, 5, 6]]))
    assert log.calls == [(4, 3)]


def test_projection_cost_model():
    from treeserve.tools.bench import projection as bp

    layouts = bp.load_layouts()
    assert [lay.name for lay in layouts] == ["Llama-2-70B 4xA100", "Vicuna-33B 4xA100"]
    seventy = layouts[0]
    assert seventy.target.layers == 80 and seventy.drafter.layers == 32
    plain = bp.Measured(mal=1.0, candidates=0.0, router_ms=0.2)
    assert bp.projected_speedup(seventy, plain, plain, 300) == pytest.approx(1.0)
    small = bp.Measured(mal=1.5, candidates=4, drafter_forwards=1, drafter_tokens_per_forward=2, drafted_share=1,
                        router_ms=1.0)
    # More accepted tokens at the same cost project faster; more drafter forwards at the same MAL slower.
    assert bp.projected_speedup(seventy, bp.Measured(**{**small.__dict__, "mal": 2.5}), plain, 300) > \
        bp.projected_speedup(seventy, small, plain, 300)
    assert bp.projected_speedup(seventy, bp.Measured(**{**small.__dict__, "drafter_forwards": 5}), plain, 300) < \
        bp.projected_speedup(seventy, small, plain, 300)
    # A 70B TP=4 forward is weight-bandwidth bound: 64 tokens cost about what one costs; 4096 do not.
    one, many, huge = (bp.forward_s(seventy.target, n, 300, 4) for n in (1, 64, 4096))
    assert many < 1.1 * one and huge > 2 * one
    # Every constant of the model is stated with its source in the module docstring.
    for name in ("2.039e12", "312e12", "300e9", "0.75", "0.5", "20e-6", "40e-6", "1e-3", "datasheet", "ASSUMED",
                 "docs/design.md section 3", "engine/tp.py"):
        assert name in bp.__doc__, name


def test_summaries_compare_with_both_baselines():
    from treeserve.tools.bench.peers import Outcome

    stats = {AR_KEY: MethodStats("autoregressive", "auto"), HF_KEY: MethodStats("hf-generate", "-", "peer"),
             "c2t:auto": MethodStats("c2t", "auto", drafter="eagle")}
    for key, seconds in ((AR_KEY, [2.0, 1.0]), (HF_KEY, [4.0, 1.0]), ("c2t:auto", [1.0, 1.0])):
        for category, s in zip(("qa", "extraction"), seconds):
            stats[key].add(Outcome(list(range(10)), "", s, [2] * 5, [3] * 5), category)
    rows = {r["key"]: r for r in summarize(stats)}
    assert rows["c2t:auto"]["category_speedups"] == {"qa": 2.0, "extraction": 1.0}
    assert rows["c2t:auto"]["category_speedups_vs_hf"] == {"qa": 4.0, "extraction": 1.0}
    assert rows["c2t:auto"]["speedup"] == pytest.approx(1.5) and rows["c2t:auto"]["speedup_vs_hf"] == pytest.approx(2.5)
    assert rows["c2t:auto"]["worst_category_speedup"] == 1.0 and rows["c2t:auto"]["mal"] == 2.0
    # the mean over categories weighs each category the same (Spec-Bench's overall): (2 + 1) / 2
    assert rows["c2t:auto"]["category_mean_speedup"] == pytest.approx(1.5)
    assert rows[AR_KEY]["category_mean_speedup"] == pytest.approx(1.0)
    assert not math.isnan(rows[HF_KEY]["speedup"])


def test_help_documents_every_option():
    from treeserve.cli import agreement, bench as bench_command

    for module in (bench_command, agreement):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{action.option_strings} has no help"
        assert parser.parse_args([]).prompts.is_file()  # the vendored dev questions


def test_hf_compiled_peer_is_greedy_generate_on_a_static_cache(tiny):
    """The gpt-fast recipe as transformers ships it (static cache; compiled with CUDA graphs on a GPU only):
    on the CPU it must still decode the target's greedy output, one forward per token."""
    prompt = chat_ids(tiny.tokenizer, "Name three rivers.")
    reference, _ = greedy_reference(tiny.model, prompt, 8)
    peer = build_peers(["hf-compiled"], tiny, "eagle")[0][0]
    outcome = peer.generate(prompt, 8)
    assert peer.key == "hf-compiled" and outcome.token_ids == reference
    assert outcome.accept_lengths == [1] * len(reference)
