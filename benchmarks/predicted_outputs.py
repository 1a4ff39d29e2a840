"""Predicted outputs (OpenAI's `prediction`, engine/lookup/prediction.py) on file-edit requests: plain decoding,
the default hybrid without the prediction, and the hybrid with the original file as the prediction.

The requests are built here from the Python standard library's own sources (never the benchmark prompts): a
window of 60-100 lines starting at a top-level `def` or `class`, as long as it fits `--max-code-tokens`, and one
edit asked of it - rename a symbol, add a parameter to a function, or change one number on one line - with
"reply with the complete updated code". The prediction is the original code, as OpenAI's guide shows. Each arm
has an engine of its own (the per-tenant output index would otherwise let the second arm copy the first's
answer), arms alternate request by request (a drifting machine hits all alike), outputs must be identical.

In-process (default) or through a running service's OpenAI API (`--http-address HOST:PORT`: the arms are
`treeserve.method` autoregressive, the server's default method, and the default method with `prediction`, each
request under a `cache_salt` of its own so that no arm reuses another's cached prompt or output):

    python benchmarks/predicted_outputs.py [--requests 8] [--max-new-tokens 256] [--http-address 127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sysconfig
import time
from pathlib import Path

import torch

from treeserve.engine.factory import build_engine
from treeserve.engine.requests import GenerationRequest

ARMS = ("plain", "hybrid", "hybrid+prediction")
IDENTIFIER = re.compile(r"\b[a-z_][a-z0-9_]{3,}\b")
NUMBER = re.compile(r"(?<![\w.])(\d+)(?![\w.])")
KEYWORDS = {"self", "None", "True", "False", "return", "import", "from", "class", "def", "while", "raise", "except",
            "lambda", "yield", "with", "assert", "elif", "else", "pass", "break", "continue", "global", "finally",
            "print", "isinstance", "len", "str", "int", "list", "dict", "tuple", "range", "super", "object"}


def windows(path: Path, max_lines: int, min_lines: int) -> list[list[str]]:
    """Runs of min_lines..max_lines lines that start at a top-level def / class (cut at the next top-level
    statement past min_lines)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))]
    out = []
    for start in starts:
        end = min(len(lines), start + max_lines)
        for j in range(start + min_lines, end):
            if lines[j] and not lines[j][0].isspace() and not lines[j].startswith((")", "]", "}")):
                end = j
                break
        if end - start >= min_lines and all(len(line) < 160 for line in lines[start:end]):
            out.append(lines[start:end])
    return out


def edit(code: str, rng: random.Random) -> tuple[str, str] | None:
    """(instruction, the edited code) of one edit of `code`, or None when the chosen kind finds nothing."""
    kind = rng.choice(("rename", "parameter", "number"))
    if kind == "rename":
        counts: dict[str, int] = {}
        for name in IDENTIFIER.findall(code):
            counts[name] = counts.get(name, 0) + 1
        names = sorted(n for n, c in counts.items() if c >= 3 and n not in KEYWORDS)
        if not names:
            return None
        old = rng.choice(names)
        new = f"{old}_renamed" if rng.random() < 0.5 else f"new_{old}"
        return f"Rename `{old}` to `{new}` everywhere in this code.", re.sub(rf"\b{old}\b", new, code)
    if kind == "parameter":
        defs = [m for m in re.finditer(r"^(\s*def \w+\()([^)]*)(\))", code, flags=re.M)]
        if not defs:
            return None
        m = rng.choice(defs)
        name = re.search(r"def (\w+)", m.group(1)).group(1)
        inner = m.group(2).strip()
        added = f"{inner}, verbose=False" if inner else "verbose=False"
        return (f"Add a parameter `verbose=False` at the end of the parameters of `{name}`.",
                code[:m.start()] + m.group(1) + added + m.group(3) + code[m.end():])
    lines = code.split("\n")
    numbered = [i for i, line in enumerate(lines) if NUMBER.search(line) and not line.strip().startswith("#")]
    if not numbered:
        return None
    i = rng.choice(numbered)
    line = lines[i]
    old = NUMBER.search(line).group(1)
    lines[i] = NUMBER.sub(str(int(old) + 1), line, count=1)
    return f"On the line `{line.strip()}`, the number {old} should be {int(old) + 1}: fix it.", "\n".join(lines)


def file_edits(tokenizer, count: int, seed: int = 0, max_code_tokens: int = 800) -> list[dict]:
    """`count` edit requests from the standard library: {"prompt", "prediction", "reference", "source"}."""
    rng = random.Random(seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng.shuffle(files)
    out = []
    for path in files:
        found = windows(path, max_lines=100, min_lines=60)
        if not found:
            continue
        code = "\n".join(rng.choice(found)) + "\n"
        if len(tokenizer.encode(code)) > max_code_tokens:
            continue
        asked = edit(code, rng)
        if asked is None:
            continue
        instruction, reference = asked
        prompt = f"{instruction} Reply with the complete updated code only.\n\n```python\n{code}```"
        out.append({"prompt": prompt, "prediction": code, "reference": reference, "source": path.name})
        if len(out) == count:
            break
    return out


def in_process(rows: list[dict], max_new_tokens: int) -> dict[str, dict]:
    engines = {"plain": build_engine(method="autoregressive"), "hybrid": build_engine(),
               "hybrid+prediction": build_engine()}
    tokenizer = engines["plain"].tokenizer
    totals = {arm: {"seconds": 0.0, "tokens": 0, "steps": 0, "accepted_prediction": 0, "rejected_prediction": 0}
              for arm in ARMS}
    warm = engines["plain"].encode_chat("Write one line of Python.")
    for engine in engines.values():
        engine.generate([GenerationRequest(warm, max_new_tokens=16)])
    mismatches = 0
    for row in rows:
        prompt = engines["plain"].encode_chat(row["prompt"])
        prediction = tuple(tokenizer.encode(row["prediction"], add_special_tokens=False))
        outputs = []
        for arm in ARMS:
            request = GenerationRequest(prompt, max_new_tokens=max_new_tokens,
                                        prediction=prediction if arm == "hybrid+prediction" else ())
            started = time.perf_counter()
            result = engines[arm].generate([request])[0]
            t = totals[arm]
            t["seconds"] += time.perf_counter() - started
            t["tokens"] += len(result.token_ids)
            t["steps"] += len(result.steps)
            t["accepted_prediction"] += result.accepted_prediction_tokens
            t["rejected_prediction"] += result.rejected_prediction_tokens
            outputs.append(result.token_ids)
        mismatches += any(o != outputs[0] for o in outputs)
    for t in totals.values():
        t["mismatches"] = mismatches
    return totals


def through_service(rows: list[dict], max_new_tokens: int, address: str) -> dict[str, dict]:
    from openai import OpenAI  # the official client: what an application sends

    client = OpenAI(base_url=f"http://{address}/v1", api_key="none", timeout=600)
    arms = {"plain": {"treeserve": {"method": "autoregressive"}}, "hybrid": {}, "hybrid+prediction": {}}
    totals = {arm: {"seconds": 0.0, "tokens": 0, "accepted_prediction": 0, "rejected_prediction": 0} for arm in ARMS}
    model = client.models.list().data[0].id
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    mismatches = 0
    for i, row in enumerate(rows):
        outputs = []
        for arm, extra in arms.items():
            kwargs = {"prediction": {"type": "content", "content": row["prediction"]}} \
                if arm == "hybrid+prediction" else {}
            # A scope of its own per arm and request: no arm reuses another's prompt KV, nor drafts from the
            # answer another arm left in the tenant's output index.
            body = {**extra, "cache_salt": f"{arm}-{i}"}
            started = time.perf_counter()
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": row["prompt"]}], max_tokens=max_new_tokens,
                temperature=0, extra_body=body, **kwargs)
            t = totals[arm]
            t["seconds"] += time.perf_counter() - started
            t["tokens"] += reply.usage.completion_tokens
            details = reply.usage.completion_tokens_details
            if details is not None:
                t["accepted_prediction"] += details.accepted_prediction_tokens or 0
                t["rejected_prediction"] += details.rejected_prediction_tokens or 0
            outputs.append(reply.choices[0].message.content)
        mismatches += any(o != outputs[0] for o in outputs)
    for t in totals.values():
        t["mismatches"] = mismatches
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--http-address", default=None, help="a running service's OpenAI API (HOST:PORT)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_engine(method="autoregressive").tokenizer
    rows = file_edits(tokenizer, args.requests, args.seed)
    totals = (through_service(rows, args.max_new_tokens, args.http_address) if args.http_address
              else in_process(rows, args.max_new_tokens))
    plain = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    for arm, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        t["tokens_per_s"], t["speedup"] = round(rate, 2), round(rate / plain, 3)
        mal = f", MAL {t['tokens'] / t['steps']:.2f}" if t.get("steps") else ""
        print(f"{arm:18s} {rate:6.2f} tok/s  {rate / plain:5.2f}x{mal}  prediction tokens accepted "
              f"{t['accepted_prediction']} rejected {t['rejected_prediction']}")
    print(f"{len(rows)} requests ({', '.join(r['source'] for r in rows)}), {args.max_new_tokens} tokens at most; "
          f"requests whose outputs differ between arms: {totals['plain']['mismatches']}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"requests": len(rows), "max_new_tokens": args.max_new_tokens,
                                             "arms": totals}, indent=2) + "\n")


if __name__ == "__main__":
    main()
