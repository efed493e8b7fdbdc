"""Tokens per verified tree against its rows, for each candidate selection rule, offline.

Greedy answers to held-out prompts (the training's evaluation prompts, or with `--serving` the
serving benchmarks' chat prompts) are generated plainly; then at every answer position the
speculator drafts its whole top-k tree from the base model's state there, and each rule's trees
of every size are matched against the tokens that really followed (a tree gains 1 + the longest
prefix of them it holds). "nodes" trees of any size; "coverage" and "joint" trees of their first
k candidate paths (their mean rows shown). Writes bench/results/tree_rules.json
(tree_rules_serving.json with `--serving`).

    python -m bench.tree_rules --speculator PATH [--prompts 40] [--new-tokens 96] [--serving]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from bench.chat_prompts import SERVING_PROMPTS
from engine import LLM
from engine.config import CANDIDATE_SELECTIONS
from engine.paths import default_model_path
from engine.spec_decode.candidates import num_candidates
from engine.spec_decode.loader import load_speculator
from engine.spec_decode.proposer import use_engine_linears
from engine.spec_decode.tree import DraftTree
from engine.step_io import SequenceInput
from training.prompts import chat_prompt_ids, eval_prompts

RESULTS = Path(__file__).parent / "results" / "tree_rules.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--speculator", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument(
        "--serving", action="store_true", help="the serving benchmarks' prompts, not eval's"
    )
    args = parser.parse_args()

    llm = LLM(args.model, dtype="float32", max_num_tokens=8192)
    runner, kv = llm.runner, llm.kv
    speculator = load_speculator(
        args.speculator,
        hidden_size=runner.config.hidden_size,
        vocab_size=runner.config.vocab_size,
        dtype=torch.float32,
        device="cpu",
    )
    use_engine_linears(speculator)  # as the server drafts: int8 heads on a CPU
    top_k = speculator.config.top_k_tokens_per_head
    n = speculator.config.n_candidates
    depth = len(top_k)
    texts = SERVING_PROMPTS if args.serving else eval_prompts()
    prompts = chat_prompt_ids(llm.tokenizer, texts[: args.prompts])
    answers = llm.generate(prompts, max_new_tokens=args.new_tokens)
    gained: dict[str, dict[int, list[float]]] = {s: defaultdict(list) for s in CANDIDATE_SELECTIONS}
    rows: dict[str, dict[int, list[float]]] = {s: defaultdict(list) for s in CANDIDATE_SELECTIONS}
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        seq = [*prompt, *answer.token_ids]
        kv.allocate_slots(("rules", i), len(seq))
        out = runner.execute(
            [
                SequenceInput(
                    seq, 0, kv.block_table(("rules", i)), logits_indices=list(range(len(seq)))
                )
            ]
        )
        kv.free(("rules", i))
        positions = range(len(prompt) - 1, len(seq) - depth - 1)  # state t chose token t + 1
        states = out.hidden_states[list(positions)]  # [P, hidden]
        roots = torch.tensor([seq[t + 1] for t in positions])
        for selection in CANDIDATE_SELECTIONS:
            paths, _ = speculator.draft_candidates(states, roots, top_k, n, selection)
            for t, candidates in zip(positions, paths.tolist(), strict=True):
                tree = DraftTree.from_paths([[x for x in p if x >= 0] for p in candidates])
                followed = seq[t + 2 : t + 2 + depth]
                best = 0
                for k, length in enumerate(tree.match_lengths(followed), 1):
                    best = max(best, length)
                    gained[selection][k].append(best + 1)
                    rows[selection][k].append(max(tree.leaves[:k]) + 1)
    result = {
        "model": args.model.name,
        "prompts": "serving" if args.serving else "eval",
        "top_k": list(top_k),
        "n_candidates": n,
        "rules": {},
    }
    for selection in CANDIDATE_SELECTIONS:
        print(f"{selection}: k, rows, tokens per tree")
        table = []
        for k in range(1, num_candidates(top_k, n, selection) + 1):
            cell = {
                "k": k,
                "rows": float(np.mean(rows[selection][k])),
                "tokens": float(np.mean(gained[selection][k])),
            }
            table.append(cell)
            print(f"  {k:>2} {cell['rows']:6.2f} {cell['tokens']:6.3f}")
        result["rules"][selection] = table
    print(f"{len(gained['nodes'][1])} positions")
    path = RESULTS.with_name("tree_rules_serving.json") if args.serving else RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
