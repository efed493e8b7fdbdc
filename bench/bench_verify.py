"""Cost of verifying a draft tree at batch 1: the verify step vs the bare matrix products for
the same number of rows, and vs a plain decode step, measured in one run.

The tree is what the MLP speculator proposes with top-k [5, 3, 2] and 5 candidates, on a chat
prompt's real final hidden state: a trained speculator's (`--speculator PATH`, drafting from its
draft vocabulary when it has one) or a random one of the same shape over the whole vocabulary;
`--worst-case` uses five disjoint paths instead (16 rows). It is verified whole and cut to its
first `--rows` rows (4 and 8 by default), as the scheduler
trims trees. Per tree size the speculator's drafting time is reported too, as the engine drafts
a tree it verifies whole (`MLPProposer.propose` asked for that many drafts), timed right after
that tree's verify step as the engine drafts (on the caches the step left), and
(verify + drafting) / plain: what a step that gains tokens by speculation costs against a plain
step. All of these are timed in one interleaved run, and reported as each one's fastest run;
"paired" is the median over the run's rounds of that round's (verify + drafting) / plain,
which a host whose speed drifts during the run (the fastest runs then come from different
spells) leaves fair. With `--temperature`, the speculator's
tokens per verified tree on the held-out prompts is reported for greedy decoding and for
sampling at that temperature and `--top-p`.
Last, one pass over the model's linear layers at 1, 4, 8 and 16 rows: with the kernels the engine
chose, and with the "rows" kernel (engine/kernels/rows_gemm.c) on every layer.

    python -m bench.bench_verify [--model PATH] [--speculator PATH] [--top-k 5 3 2]
                                 [--candidates 5] [--rows 4 8] [--temperature 0.7 --top-p 0.9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.common import best_of, engine_step, interleaved_min, interleaved_rounds, matmul_floor
from engine import LLM
from engine.config import CANDIDATE_SELECTIONS
from engine.kernels.matmul import KERNELS
from engine.kernels.rows import load_rows_gemm
from engine.paths import default_model_path
from engine.spec_decode.loader import load_speculator
from engine.spec_decode.proposer import MLPProposer, ProposalInput
from engine.spec_decode.tree import DraftTree
from engine.step_io import SequenceInput
from tools.tiny_speculator import write_tiny_speculator
from training.evaluate import evaluate_speculator
from training.prompts import CHAT_PROMPTS, chat_prompt_ids, eval_prompts

RESULTS = Path(__file__).parent / "results" / "verify.json"
PASS_ROWS = (1, 4, 8, 16)


def matmul_pass_ms(llm: LLM, repeats: int) -> dict[int, dict[str, float]]:
    """Milliseconds of one pass over the model's linear layers per row count in `PASS_ROWS`:
    "chosen" with the engine's kernels, "rows" with the "rows" kernel built on every layer
    (absent where it cannot serve them). The variants are timed in turn."""
    linears = llm.runner.model.linears()
    spec = KERNELS["rows"]
    rows_fns = (
        [spec.build(lin, {}) for lin in linears] if all(map(spec.supports, linears)) else None
    )
    fns: dict[str, Callable[[], object]] = {}
    for m in PASS_ROWS:
        fns[f"chosen{m}"] = matmul_floor(llm, m)
        if rows_fns is not None:
            inputs = [torch.randn(m, lin.in_features) for lin in linears]  # [M, in] per layer

            def rows_pass(inputs: list[torch.Tensor] = inputs) -> None:
                for fn, x in zip(rows_fns, inputs, strict=True):
                    fn(x)

            fns[f"rows{m}"] = rows_pass
    times = interleaved_min(fns, repeats)
    return {
        m: {kind: times[f"{kind}{m}"] * 1e3 for kind in ("chosen", "rows") if f"{kind}{m}" in times}
        for m in PASS_ROWS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--top-k", type=int, nargs="+", default=[5, 3, 2])
    parser.add_argument("--candidates", type=int, default=5)
    parser.add_argument("--selection", choices=CANDIDATE_SELECTIONS, default="nodes")
    parser.add_argument("--speculator", type=Path, help="a trained speculator folder")
    parser.add_argument("--worst-case", action="store_true")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[4, 8], help="also verify the tree's first rows"
    )
    parser.add_argument("--temperature", type=float, help="also: tokens per step, sampled")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    args = parser.parse_args()

    llm = LLM(args.model, dtype="float32", max_num_tokens=4096)
    runner, kv = llm.runner, llm.kv
    (prompt,) = chat_prompt_ids(llm.tokenizer, CHAT_PROMPTS[:1])
    tmp = tempfile.TemporaryDirectory()
    spec_path = args.speculator or write_tiny_speculator(
        tmp.name, args.model, n_predict=len(args.top_k), inner_dim=runner.config.hidden_size
    )
    speculator = load_speculator(
        spec_path,
        hidden_size=runner.config.hidden_size,
        vocab_size=runner.config.vocab_size,
        dtype=runner.dtype,
        device="cpu",
    )
    num_draft_tokens = speculator.num_draft_tokens

    seq = "bench"
    depth = len(args.top_k)
    kv.allocate_slots(seq, len(prompt) + 1 + args.candidates * depth)
    table = kv.block_table(seq)
    out = runner.execute([SequenceInput(prompt, 0, table)])
    state, last = out.hidden_states, out.logits.argmax(-1)

    def draft() -> np.ndarray:
        return speculator.draft_candidates(
            state, last, args.top_k, args.candidates, args.selection
        )[0]

    paths = [[t for t in path if t >= 0] for path in draft()[0].tolist()]  # "nodes": -1 below
    plain_draft_s = best_of(draft, args.repeats)
    proposer = MLPProposer(speculator, args.top_k, args.candidates, args.selection)
    proposal = ProposalInput(seq, [*prompt, int(last)], state[0], depth)

    if args.worst_case:
        paths = [[1000 * (c + 1) + d for d in range(depth)] for c in range(args.candidates)]
    full = DraftTree.from_paths(paths)
    # The first R - 1 drafts of the tree, as the scheduler trims it (with "nodes" selection: the
    # R - 1 drafts of highest path probability, as the adaptive policy verifies them).
    trees = {min(r, full.num_drafts + 1): full.truncate(r - 1) for r in (*args.rows, 10**9)}
    verifies = {
        rows: SequenceInput(
            [int(last), *tree.token_ids],
            len(prompt),
            table,
            positions=[len(prompt) + d for d in tree.depths],
            tree_mask=tree.attention_mask(),
            logits_indices=list(range(rows)),
        )
        for rows, tree in trees.items()
    }
    fns: dict[str, Callable[[], object]] = {}
    with engine_step(llm, [prompt]) as plain:
        fns["plain"], fns["floor1"] = plain, matmul_floor(llm, 1)
        for rows, verify in verifies.items():
            # verified, then drafted from (a tree of rows - 1 drafts), as the engine drafts the
            # next tree right after a verify step, on the caches that step left
            fns[f"verify{rows}"] = lambda verify=verify: runner.execute([verify])
            fns[f"draft{rows}"] = lambda rows=rows: proposer.propose([proposal], rows - 1)
            fns[f"floor{rows}"] = matmul_floor(llm, rows)
        rounds = interleaved_rounds(fns, args.repeats)
        times = {name: min(t) * 1e3 for name, t in rounds.items()}
    kv.free(seq)
    plain_ms, floor1_ms = times["plain"], times["floor1"]

    def cost(rows: int) -> dict[str, float]:
        verify_ms, draft_ms = times[f"verify{rows}"], times[f"draft{rows}"]
        return {
            "rows": rows,
            "verify_step_ms": verify_ms,
            "draft_ms": draft_ms,
            "matmul_floor_same_rows_ms": times[f"floor{rows}"],
            "verify_over_floor": verify_ms / times[f"floor{rows}"],
            "verify_over_plain": verify_ms / plain_ms,
            "verify_and_draft_over_plain": (verify_ms + draft_ms) / plain_ms,
            "verify_and_draft_over_plain_paired": statistics.median(
                (verify + draft) / plain
                for verify, draft, plain in zip(
                    rounds[f"verify{rows}"], rounds[f"draft{rows}"], rounds["plain"], strict=True
                )
            ),
        }

    costs = [cost(rows) for rows in sorted(trees)]
    largest = costs[-1]
    result: dict[str, object] = {
        "model": args.model.name,
        "top_k": args.top_k,
        "candidates": args.candidates,
        "tree_rows": largest["rows"],
        **{k: v for k, v in largest.items() if k != "rows"},
        "plain_step_ms": plain_ms,
        "matmul_floor_1_row_ms": floor1_ms,
        "speculator": str(args.speculator) if args.speculator else None,
        "draft_vocabulary_size": num_draft_tokens,
        "draft_nn_linear_ms": plain_draft_s * 1e3,
        "trees": costs,
    }
    print(
        f"model {args.model.name}, float32, {torch.get_num_threads()} threads; tree top-k "
        f"{args.top_k} x {args.candidates} candidates = {largest['rows']} rows (root + drafts), "
        "and its first drafts; one interleaved run, ms"
    )
    print(
        f"plain decode step {plain_ms:.2f}, its matmuls {floor1_ms:.2f}; speculator drafting "
        f"from {num_draft_tokens} tokens (the whole tree with nn.Linear: "
        f"{plain_draft_s * 1e3:.2f})"
    )
    lib = load_rows_gemm()
    if lib is not None:  # the start-up's choice, which the multi-row steps' costs depend on
        prefetch = {rows: lib.prefetch(rows) for rows in range(2, lib.max_rows + 1)}
        result["rows_prefetch"] = prefetch
        modes = " ".join(f"{rows}:{mode}" for rows, mode in prefetch.items())
        print(f"rows kernel ({lib.isa}) prefetch by tile rows: {modes}")
    print(f"{'rows':>5} {'verify':>8} {'matmuls':>8} {'drafting':>9} {'verify/matmuls':>15} "
          f"{'verify/plain':>13} {'(verify+draft)/plain':>21} {'paired':>7}")  # fmt: skip
    for c in costs:
        print(
            f"{c['rows']:>5} {c['verify_step_ms']:>8.2f} {c['matmul_floor_same_rows_ms']:>8.2f} "
            f"{c['draft_ms']:>9.2f} {c['verify_over_floor']:>15.3f} "
            f"{c['verify_over_plain']:>13.3f} {c['verify_and_draft_over_plain']:>21.3f} "
            f"{c['verify_and_draft_over_plain_paired']:>7.3f}"
        )
    if args.temperature is not None:
        print(f"tokens per verified tree, {args.eval_prompts} held-out prompts:")
        for temperature in (0.0, args.temperature):
            stats = evaluate_speculator(
                args.model,
                spec_path,
                eval_prompts()[: args.eval_prompts],
                max_new_tokens=args.eval_new_tokens,
                top_k_tokens_per_head=args.top_k,
                n_candidates=args.candidates,
                candidate_selection=args.selection,
                temperature=temperature,
                top_p=args.top_p if temperature else 1.0,
            )
            name = f"temperature {temperature:g}, top-p {args.top_p:g}" if temperature else "greedy"
            print(f"  {name:<30}{stats.tokens_per_step:>8.3f}")
            result[f"tokens_per_step_{'sampled' if temperature else 'greedy'}"] = (
                stats.tokens_per_step
            )
    passes = matmul_pass_ms(llm, args.repeats)
    print("one pass over the linear layers, ms:")
    print(f"  {'rows':>4} {'chosen kernels':>15} {'rows kernel':>12}")
    for m, cell in passes.items():
        rows_ms = f"{cell['rows']:>12.2f}" if "rows" in cell else f"{'-':>12}"
        print(f"  {m:>4} {cell['chosen']:>15.2f} {rows_ms}")
    result["matmul_pass_ms"] = {str(m): cell for m, cell in passes.items()}
    tmp.cleanup()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
