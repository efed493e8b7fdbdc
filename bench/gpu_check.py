"""One prepared run that proves or disproves the CUDA path: `make gpu-check`.

    python3 -m bench.gpu_check [--device cuda|cpu] [--small] [--sections a,b,...] [--out DIR]

Meant for a bare machine with one GPU and only torch, triton, transformers, safetensors, grpcio,
protobuf and prometheus-client installed (no network, no venv, no install step), where there is
time for one run. So every section has its own deadline (SIGALRM) and catches its own errors
(`CHECK <section>.error <message> - FAIL`), a watchdog thread writes what was measured and exits
should the whole run pass its budget, and nothing is read from disk but this checkout: the
models are written on the spot into a temporary folder.

Sections (see docs/benchmarks.md, "GPU check"):
  environment  versions, GPU, memory, the attention backend per dtype, device copy bandwidth
  exactness    tiny random Llamas (MHA, GQA): greedy `LLM` output against transformers'
               `generate` in float32 and float16, CUDA graphs against eager steps; speculation
               on against off (a random MLP speculator, and scripted drafts of the known greedy
               continuation; tree steps run as graphs) with several prompts whose prefill
               chunks mix with draft trees
  speed        a Llama-2-13B-shaped model with random fp16 weights: batch-1 decode against the
               bandwidth bound (and eagerly, without CUDA graphs), verify steps of 4-32 tree
               rows (16 also eagerly), drafting, batch 8/32/64 decode at contexts 512 and
               2048, a mixed step, peak memory and the KV pool
  loader       a 4-layer 13B-width checkpoint as sharded safetensors and as .bin: load GB/s and
               host peak memory
  server       the real server (`python -m server.main`) on the device: one Generate and one
               GenerateStream over gRPC (INFO when its gRPC extras or stubs are missing)

Each figure is printed as `CHECK <name> <value> <unit> PASS|FAIL|INFO`; everything goes to
`<out>/gpu_check_<device>[_small].json`. The exit code is 1 when any check failed.

This module must not import tests/ or tools.prepare_models (their imports are not on that
machine): the little it needs of them is copied below.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.core import LLMEngine
    from engine.spec_decode.tree import DraftTree
    from tools.server_process import ServerProcess

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("environment", "exactness", "speed", "loader", "server")
# Seconds per section on the GPU; the whole run must stay under 8 minutes.
BUDGETS = {"environment": 25.0, "exactness": 110.0, "speed": 170.0, "loader": 70.0, "server": 70.0}
# The CPU dry run takes ~25 s on 2 idle cores; these allow for a machine busy with other work.
SMALL_BUDGETS = {
    "environment": 30.0,
    "exactness": 180.0,
    "speed": 90.0,
    "loader": 60.0,
    "server": 90.0,
}
TOTAL_BUDGET_S = 465.0  # the watchdog's limit: 15 s under 8 minutes

FP32_NEAR_TIE = 1e-4  # transformers' top-2 logit gap under which a float32 flip is allowed
FP16_NEAR_TIE = 0.05  # the same for float16
BOS_ID, EOS_ID = 1, 2
FINAL_NORM_SCALE = 2.0

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --------------------------------------------------------------------------- reporting


class SectionTimeout(BaseException):
    """Raised by SIGALRM when a section passes its deadline (a BaseException, so that the
    sub-steps' `except Exception` does not swallow it)."""


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value).replace(" ", "_") or "-"


class Report:
    """Collects CHECK lines and each section's details; written as JSON at the end (or by the
    watchdog)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.start = time.monotonic()
        self.checks: list[dict[str, Any]] = []
        self.sections: dict[str, dict[str, Any]] = {}
        self.current = "main"
        self.meta = {
            "device": args.device,
            "small": args.small,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": sys.version.split()[0],
            "host": platform.node(),
        }
        self.path = Path(args.out) / f"gpu_check_{args.device}{'_small' if args.small else ''}.json"
        self._lock = threading.Lock()

    def check(self, name: str, value: Any, unit: str, status: str, **details: Any) -> None:
        assert status in ("PASS", "FAIL", "INFO")
        line = f"CHECK {name} {_fmt(value)} {unit or '-'} {status}"
        print(line, flush=True)
        with self._lock:
            self.checks.append(
                {"name": name, "value": value, "unit": unit, "status": status, **details}
            )
            self.sections.setdefault(self.current, {}).setdefault("checks", []).append(name)

    def detail(self, key: str, value: Any) -> None:
        with self._lock:
            self.sections.setdefault(self.current, {}).setdefault("details", {})[key] = value

    def error(self, section: str, message: str) -> None:
        text = " ".join(message.split()) or "error"
        if len(text) > 300:  # its start says what failed, its end (a log's tail) why
            text = f"{text[:100]} ... {text[-200:]}"
        self.check(f"{section}.error", text, "-", "FAIL")

    @property
    def failed(self) -> bool:
        return any(c["status"] == "FAIL" for c in self.checks)

    def write(self) -> Path:
        with self._lock:
            body = {
                **self.meta,
                "wall_s": round(time.monotonic() - self.start, 2),
                "failed": self.failed,
                "sections": self.sections,
                "checks": self.checks,
            }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(body, indent=2, default=str) + "\n")
        tmp.replace(self.path)
        return self.path


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in the main thread after `seconds` (between bytecodes: a single
    long C call finishes first; the run's watchdog covers a call that never returns)."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"deadline of {seconds:.0f} s passed")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Ctx:
    device: str
    small: bool
    report: Report
    tmp: Path
    section_end: float = 0.0

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def judged(self) -> bool:
        """Speed figures are PASS/FAIL only on a GPU at full size; elsewhere they are INFO."""
        return self.cuda and not self.small

    def left(self) -> float:
        return self.section_end - time.monotonic()

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def step(self, name: str, fn: Callable[[], None], min_left: float = 0.0) -> None:
        """Run one sub-step, reporting its exception as a FAIL without ending the section;
        skipped (INFO) when less than `min_left` seconds are left of the section."""
        if self.left() < min_left:
            self.report.check(f"{name}.skipped", "time", "-", "INFO")
            return
        start = time.monotonic()
        try:
            fn()
        except Exception as e:  # every failure is a result here
            self.report.detail(f"{name}.traceback", traceback.format_exc())
            self.report.error(name, f"{type(e).__name__}: {e}")
        finally:
            self.report.detail(f"{name}.seconds", round(time.monotonic() - start, 2))


def timed(ctx: Ctx, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median seconds of `repeats` calls after `warmup` calls, synchronizing the device around
    each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        ctx.sync()
        start = time.perf_counter()
        fn()
        ctx.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def status(ok: bool, judged: bool = True) -> str:
    if not judged:
        return "INFO"
    return "PASS" if ok else "FAIL"


def free_device_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


# --------------------------------------------------------------------------- tiny models


@dataclass(frozen=True)
class TinyLlama:
    name: str
    seed: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    vocab_size: int = 1024


TINY_MODELS = (
    TinyLlama("tiny-mha-untied", 12, 128, 2, 4, 4, 256, False),
    TinyLlama("tiny-gqa-tied", 1, 256, 4, 8, 2, 512, True),
)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `<unk> <s> </s> w3 ... w{vocab-1}` (split on whitespace): no
    hub download, and any text of `w<i>` words maps to known ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab |= {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.model_max_length = 4096
    fast.save_pretrained(str(folder))


def write_tiny_llama(folder: Path, spec: TinyLlama) -> Any:
    """A random float32 Llama folder (as tools/prepare_models writes its tiny ones: larger-than-
    default init so that greedy outputs vary and top-2 logits rarely tie); returns the
    transformers model (float32, CPU)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # tied weights appear once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim == 1:
                # The final norm sets the logits' scale: top logits around 10-20, large enough
                # for clear top-2 gaps, small enough for float16 steps of 1/128 there.
                scale = FINAL_NORM_SCALE if name == "model.norm.weight" else 1.0
                param.copy_(scale * (1.0 + 0.1 * noise))
            elif "embed_tokens" in name:
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.15 * noise)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    # Both config spellings (transformers 4's rope_theta, 5's rope_parameters), as
    # tools/prepare_models does, so that any reader agrees.
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope.setdefault("rope_type", "default")
    cfg["rope_parameters"] = {**rope, "rope_theta": theta}
    cfg["rope_theta"] = theta
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_tokenizer(folder, spec.vocab_size)
    return model


def prompt_ids(vocab_size: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        [BOS_ID, *torch.randint(3, vocab_size, (n - 1,), generator=gen).tolist()] for n in lengths
    ]


@dataclass
class Reference:
    token_ids: list[int]
    logits: list[Any]  # [vocab] float32 CPU tensors, one per generated token


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, device: str) -> Reference:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=EOS_ID,
            eos_token_id=EOS_ID,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return Reference(tokens, [step[0].float().cpu() for step in out.logits])


def judge(ours: list[int], ref: Reference, near_tie: float) -> tuple[str, float | None]:
    """("same", None) when identical; ("flip", gap) when they first differ where transformers'
    top-2 logits are within `near_tie` and ours is one of them; ("bad", gap) otherwise (gap None
    when the lengths differ without a differing token)."""
    n = min(len(ours), len(ref.token_ids))
    first = next((i for i in range(n) if ours[i] != ref.token_ids[i]), None)
    if first is None:
        return ("same", None) if len(ours) == len(ref.token_ids) else ("bad", None)
    top2 = ref.logits[first].topk(2)
    gap = float(top2.values[0] - top2.values[1])
    ok = gap < near_tie and ours[first] in top2.indices.tolist()
    return ("flip" if ok else "bad"), gap


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], int, int]:
    """Greedy outputs per prompt, the number of speculative request-steps and the drafts they
    accepted."""
    from engine.sampling.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        tokens[f"r{i}"] = []
    spec_steps = accepted = 0
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.draft_depth:
                spec_steps += 1
                accepted += out.num_accepted_tokens
    return [tokens[f"r{i}"] for i in range(len(prompts))], spec_steps, accepted


# --------------------------------------------------------------------------- sections


def section_environment(ctx: Ctx) -> None:
    import torch
    import transformers

    r = ctx.report
    r.check("env.torch", torch.__version__, "-", "INFO")
    r.check("env.torch_cuda", torch.version.cuda or "none", "-", "INFO")
    r.check("env.transformers", transformers.__version__, "-", "INFO")
    try:
        import triton

        r.check("env.triton", triton.__version__, "-", "INFO")
    except Exception as e:
        r.check("env.triton", f"missing({type(e).__name__})", "-", "INFO")
    r.check("env.cpu_count", os.cpu_count() or 0, "cores", "INFO")
    if ctx.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        props = torch.cuda.get_device_properties(torch.device(ctx.device))
        r.check("env.gpu", props.name, "-", "INFO")
        r.check("env.gpu_capability", f"{props.major}.{props.minor}", "-", "INFO")
        free, total = torch.cuda.mem_get_info(torch.device(ctx.device))
        r.check("env.gpu_memory_total", total / 2**30, "GiB", "INFO")
        r.check("env.gpu_memory_free", free / 2**30, "GiB", "INFO")
        # float32 exactness assumes IEEE float32 matrix products (torch's default).
        r.check("env.allow_tf32", torch.backends.cuda.matmul.allow_tf32, "-", "INFO")

    def backends() -> None:
        from engine.attention import select_backend
        from engine.kernels.cpu import load_cpu_kernels

        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            kernels = None
            if not ctx.cuda and dtype == torch.float32:
                kernels = load_cpu_kernels()
            backend = select_backend(ctx.device, None, kernels, dtype)
            name = str(dtype).removeprefix("torch.")
            r.check(f"env.attention_backend.{name}", backend.name, "-", "INFO")
            r.check(f"env.attention_block_size.{name}", backend.block_size, "tokens", "INFO")

    ctx.step("env.attention_backend", backends)

    def bandwidth() -> None:
        nbytes = (64 if ctx.small or not ctx.cuda else 2048) * 2**20
        src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        dst = torch.empty_like(src)
        seconds = timed(ctx, lambda: dst.copy_(src), repeats=10, warmup=3)
        gbs = 2 * nbytes / seconds / 1e9  # read + write
        ctx.report.detail("copy_bytes", nbytes)
        r.check("env.copy_bandwidth", gbs, "GB/s", "INFO")
        BANDWIDTH["GB/s"] = gbs

    ctx.step("env.copy_bandwidth", bandwidth)


BANDWIDTH: dict[str, float] = {}  # measured by `environment`, read by `speed`


def section_exactness(ctx: Ctx) -> None:
    import torch

    r = ctx.report
    max_new = 16 if ctx.small else 32
    # Several lengths: with a 64-token step budget (see `check_speculation`) the longer prompts
    # prefill in chunks while the shorter ones already verify draft trees.
    lengths = (5, 17, 40, 90, 150)
    for spec in TINY_MODELS:
        folder = ctx.tmp / spec.name
        hf = write_tiny_llama(folder, spec)
        prompts = prompt_ids(spec.vocab_size, lengths, spec.seed)
        for dtype_name, near_tie in (("float32", FP32_NEAR_TIE), ("float16", FP16_NEAR_TIE)):
            tag = f"exactness.{spec.name}.{dtype_name}"
            if ctx.left() < 10:
                r.check(f"{tag}.skipped", "time", "-", "INFO")
                continue
            # In place: float32 first, then float16.
            hf = hf.to(device=ctx.device, dtype=getattr(torch, dtype_name))
            case = Case(tag, folder, dtype_name, prompts, [], near_tie, max_new)
            ctx.step(tag, functools.partial(check_plain, ctx, case, hf), min_left=5)
            if case.llm is not None:
                ctx.step(f"{tag}.spec", functools.partial(check_speculation, ctx, case), 5)
            case.llm = None
            free_device_memory()
        del hf
        free_device_memory()


@dataclass
class Case:
    """One tiny model in one dtype, its prompts and transformers' greedy references."""

    tag: str
    folder: Path
    dtype_name: str
    prompts: list[list[int]]
    refs: list[Reference]
    near_tie: float
    max_new: int
    llm: Any = None


def check_plain(ctx: Ctx, case: Case, hf: Any) -> None:
    """`LLM.generate` (all prompts in one batch) against transformers, prompt by prompt."""
    from engine import LLM

    r = ctx.report
    case.refs = [hf_greedy(hf, p, case.max_new, ctx.device) for p in case.prompts]
    llm = LLM(
        case.folder, dtype=case.dtype_name, device=ctx.device, max_num_tokens=4096,
        max_num_seqs=16,
    )  # fmt: skip
    case.llm = llm
    r.detail(f"{case.tag}.attention_backend", llm.runner.backend.name)
    outs = llm.generate(case.prompts, case.max_new)
    verdicts = [
        judge(o.token_ids, ref, case.near_tie) for o, ref in zip(outs, case.refs, strict=True)
    ]
    r.detail(f"{case.tag}.verdicts", verdicts)
    same = sum(v == "same" for v, _ in verdicts)
    flips = sum(v == "flip" for v, _ in verdicts)
    bad = [(i, gap) for i, (v, gap) in enumerate(verdicts) if v == "bad"]
    if bad:
        r.detail(f"{case.tag}.bad", bad)
    n = len(case.prompts)
    r.check(f"{case.tag}.identical", f"{same}/{n}", "prompts", status(not bad))
    r.check(f"{case.tag}.near_tie_flips", flips, "prompts", "INFO")
    if llm.runner.graphs is None:
        r.check(f"{case.tag}.graphs_vs_eager", "no_graphs", "-", "INFO")
        return
    eager = LLM(
        case.folder, dtype=case.dtype_name, device=ctx.device, max_num_tokens=4096,
        max_num_seqs=16, cuda_graphs=False,
    )  # fmt: skip
    eager_outs = eager.generate(case.prompts, case.max_new)
    del eager
    equal = sum(a.token_ids == b.token_ids for a, b in zip(outs, eager_outs, strict=True))
    eager_bad = [
        i for i, (o, ref) in enumerate(zip(eager_outs, case.refs, strict=True))
        if judge(o.token_ids, ref, case.near_tie)[0] == "bad"
    ]  # fmt: skip
    r.check(
        f"{case.tag}.graphs_vs_eager", f"{equal}/{n}", "prompts", status(not bad and not eager_bad)
    )


def check_speculation(ctx: Ctx, case: Case) -> None:
    """Speculation on against off in the same runner: a random MLP speculator ([5,3,2]x5
    trees, nearly all drafts rejected) and scripted drafts of the known greedy continuation
    with wrong branches (many accepted). A difference must be a near-tie in transformers'
    logits, as for `check_plain`."""
    from engine.config import SchedulerConfig
    from engine.core import LLMEngine
    from engine.spec_decode.drafter import Drafter
    from engine.spec_decode.loader import load_speculator
    from engine.spec_decode.proposer import MLPProposer
    from tools.scripted_proposer import ScriptedProposer
    from tools.tiny_speculator import write_tiny_speculator

    r = ctx.report
    runner = case.llm.runner
    eos = frozenset({EOS_ID})
    # A small step budget: the 90- and 150-token prompts prefill in chunks while the short
    # ones already decode with draft trees, in the same steps.
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=2048)
    off, _, _ = run_engine(LLMEngine(runner, sched, eos), case.prompts, case.max_new)
    spec_dir = write_tiny_speculator(
        ctx.tmp / f"spec-{case.folder.name}", case.folder, n_predict=3, inner_dim=64,
        top_k_tokens_per_head=(5, 3, 2), n_candidates=5, seed=3,
    )  # fmt: skip
    speculator = load_speculator(
        spec_dir, hidden_size=runner.config.hidden_size, vocab_size=runner.config.vocab_size,
        dtype=runner.dtype, device=ctx.device,
    )  # fmt: skip
    proposers: dict[str, Any] = {
        "random_speculator": MLPProposer(speculator, (5, 3, 2), 5),
        "scripted": ScriptedProposer(
            [p + o for p, o in zip(case.prompts, off, strict=True)], (4, 0, 2, 1, 3, 4),
            num_heads=4, n_candidates=3, vocab_size=runner.config.vocab_size,
        ),
    }  # fmt: skip
    n = len(case.prompts)
    for name, proposer in proposers.items():
        tag = f"{case.tag}.spec_{name}"
        engine = LLMEngine(runner, sched, eos, Drafter(proposer, None, 16))
        on, spec_steps, accepted = run_engine(engine, case.prompts, case.max_new)
        verdicts = [
            "same" if o_on == o_off else judge(o_on, ref, case.near_tie)[0]
            for o_on, o_off, ref in zip(on, off, case.refs, strict=True)
        ]
        r.detail(f"{tag}.verdicts", verdicts)
        same = sum(v == "same" for v in verdicts)
        ok = not any(v == "bad" for v in verdicts)
        r.check(f"{tag}.on_equals_off", f"{same}/{n}", "prompts", status(ok))
        r.check(f"{tag}.tree_steps", spec_steps, "steps", status(spec_steps > 0))
        judged = name == "scripted"
        r.check(f"{tag}.accepted", accepted, "tokens", status(accepted > 0, judged))
        if engine.kv.num_used_blocks != 0:
            r.check(f"{tag}.leaked_blocks", engine.kv.num_used_blocks, "blocks", "FAIL")


SPEED_13B = {
    "vocab_size": 32000,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
}
SPEED_SMALL = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def write_llama_config(folder: Path, shape: dict[str, int], dtype: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


@contextmanager
def random_weights() -> Iterator[None]:
    """Build ModelRunners whose weights are random instead of loaded.

    Honest about what it skips: `ModelRunner.__init__` builds the model exactly as in serving
    (`LlamaModel`, the same Linear layers, dtype, device and attention backend), then calls
    `engine.model_runner.load_weights(model, folder)`; only that call is replaced, by a fill of
    every parameter in place on the device (linear weights ~ N(0, 0.02), norms 1). Step times
    do not depend on the weights' values, and a 26 GB checkpoint need not be written or read.
    Everything after loading (KV sizing by a profiled step, the pool, every forward pass) is
    the engine's own code."""
    import torch

    import engine.model_runner as model_runner
    from engine.models.llama import LlamaModel

    def fill(model: LlamaModel, folder: object) -> None:
        torch.manual_seed(0)
        with torch.no_grad():
            for linear in model.linears():
                linear.storage.normal_(0.0, 0.02)
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02)

    original = model_runner.load_weights
    model_runner.load_weights = fill  # type: ignore[assignment]
    try:
        yield
    finally:
        model_runner.load_weights = original


def heap_tree(rows: int) -> DraftTree:
    """A draft tree of `rows` rows (root + rows-1 drafts), node j's parent (j - 1) // 2: as wide
    as it is deep, like the trees a [5,3,2]x5 speculator proposes."""
    from engine.spec_decode.tree import DraftTree

    n = rows - 1
    return DraftTree(
        tuple(100 + j for j in range(1, n + 1)), tuple((j - 1) // 2 for j in range(1, n + 1))
    )


def section_speed(ctx: Ctx) -> None:
    import torch

    from engine.builder import build_engine
    from engine.config import EngineConfig
    from engine.model_runner import SequenceInput
    from engine.spec_decode.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
    from engine.spec_decode.proposer import MLPProposer, ProposalInput

    r = ctx.report
    if not ctx.cuda and not ctx.small:
        r.check("speed.skipped", "cpu", "-", "INFO")
        return
    small, judged = ctx.small, ctx.judged
    shape = SPEED_SMALL if small else SPEED_13B
    contexts = (32, 64) if small else (512, 2048)
    chunk_tokens = 96 if small else 1792
    repeats = 3 if small else 10
    folder = ctx.tmp / "speed-model"
    dtype_name = "float16" if ctx.cuda else "float32"
    write_llama_config(folder, shape, dtype_name)
    config = EngineConfig(
        model_path=folder,
        dtype=dtype_name,
        device=ctx.device,
        max_num_seqs=64,
        max_num_batched_tokens=2048 if not small else 256,
        kv_cache_tokens=64 * (contexts[-1] + 64) + 4096 if not ctx.cuda else None,
        enable_prefix_caching=False,
    )
    start = time.perf_counter()
    with random_weights():
        engine = build_engine(config)
    runner, kv = engine.runner, engine.kv
    ctx.sync()
    r.check("speed.model_build", time.perf_counter() - start, "s", "INFO")
    r.check("speed.attention_backend", runner.backend.name, "-", "INFO")
    weight_bytes = sum(
        lin.storage.numel() * lin.storage.element_size() for lin in runner.model.linears()
    )
    r.check("speed.weight_bytes", weight_bytes / 1e9, "GB", "INFO")
    r.check("speed.kv_pool_blocks", runner.num_blocks, "blocks", "INFO")
    r.check("speed.kv_pool_tokens", runner.num_blocks * runner.block_size, "tokens", "INFO")
    r.detail("kv_pool_source", runner.kv_pool_source)
    if ctx.cuda:
        r.check("speed.memory_after_load", torch.cuda.memory_allocated() / 2**30, "GiB", "INFO")

    counter = [0]

    def new_seqs(batch: int, tokens: int) -> list[tuple[str, list[int]]]:
        """`batch` sequences with room for `tokens` tokens each. Their cached context is whatever
        the pool holds (no prefill): attention reads it at the same cost whatever its values."""
        seqs: list[tuple[str, list[int]]] = []
        for _ in range(batch):
            counter[0] += 1
            seq_id = f"speed-{counter[0]}"
            if not kv.allocate_slots(seq_id, tokens):
                for s, _ in seqs:
                    kv.free(s)
                raise MemoryError(f"KV pool too small for {batch} x {tokens} tokens")
            seqs.append((seq_id, kv.block_table(seq_id)))
        return seqs

    def free(seqs: list[tuple[str, list[int]]]) -> None:
        for s, _ in seqs:
            kv.free(s)

    def decode_inputs(seqs: list[tuple[str, list[int]]], ctx_len: int) -> list[SequenceInput]:
        return [SequenceInput([7], ctx_len, table) for _, table in seqs]

    def tree_input(table: list[int], ctx_len: int, rows: int) -> SequenceInput:
        tree = heap_tree(rows)
        return SequenceInput(
            [7, *tree.token_ids], ctx_len, table,
            positions=[ctx_len + d for d in tree.depths],
            tree_mask=tree.attention_mask(), logits_indices=list(range(rows)),
        )  # fmt: skip

    def run(inputs: list[SequenceInput]) -> Callable[[], object]:
        return lambda: runner.execute(inputs)

    results: dict[str, float] = {}

    def step_b1() -> None:
        for ctx_len in contexts:
            seqs = new_seqs(1, ctx_len + 1)
            try:
                inputs = decode_inputs(seqs, ctx_len)
                sec = timed(ctx, run(inputs), repeats)
            finally:
                free(seqs)
            results[f"b1_{ctx_len}"] = sec
            r.check(f"speed.decode_b1_ctx{ctx_len}.step", sec * 1e3, "ms", "INFO")
            r.check(f"speed.decode_b1_ctx{ctx_len}.tok_s", 1 / sec, "tok/s", "INFO")
        graphs = runner.graphs
        if graphs is not None:
            seqs = new_seqs(1, contexts[0] + 1)
            runner.graphs = None
            try:
                eager = timed(ctx, run(decode_inputs(seqs, contexts[0])), repeats)
            finally:
                runner.graphs = graphs
                free(seqs)
            r.check(f"speed.decode_b1_ctx{contexts[0]}.eager_step", eager * 1e3, "ms", "INFO")
            r.check(
                "speed.decode_b1.graph_speedup", eager / results[f"b1_{contexts[0]}"], "x", "INFO"
            )
        bw = BANDWIDTH.get("GB/s")
        if bw:
            bound = weight_bytes / (bw * 1e9)
            sec = results[f"b1_{contexts[0]}"]
            r.check("speed.decode_b1.bandwidth_bound", bound * 1e3, "ms", "INFO")
            r.check(
                "speed.decode_b1.over_bound", sec / bound, "x", status(sec <= 1.25 * bound, judged)
            )
        else:
            r.check("speed.decode_b1.over_bound", "no_bandwidth", "-", "INFO")

    ctx.step("speed.decode_b1", step_b1)

    def step_verify() -> None:
        ctx_len = contexts[0]
        seqs = new_seqs(1, ctx_len + 33)
        try:
            table = seqs[0][1]
            plain = timed(
                ctx, lambda: runner.execute([SequenceInput([7], ctx_len, table)]), repeats
            )
            r.check("speed.verify.rows1", plain * 1e3, "ms", "INFO")
            for rows in (4, 8, 16, 32):
                inputs = [tree_input(table, ctx_len, rows)]
                sec = timed(ctx, run(inputs), repeats)
                ratio = sec / plain
                r.check(f"speed.verify.rows{rows}", sec * 1e3, "ms", "INFO")
                st = status(ratio <= 1.15, judged) if rows == 16 else "INFO"
                r.check(f"speed.verify.rows{rows}_over_rows1", ratio, "x", st)
            graphs = runner.graphs
            if graphs is not None:
                runner.graphs = None
                try:
                    eager = timed(ctx, run([tree_input(table, ctx_len, 16)]), repeats)
                finally:
                    runner.graphs = graphs
                r.check("speed.verify.rows16.eager_step", eager * 1e3, "ms", "INFO")
        finally:
            free(seqs)

    ctx.step("speed.verify", step_verify, min_left=5)

    def step_draft() -> None:
        hidden = shape["hidden_size"]
        spec_config = MLPSpeculatorConfig(
            vocab_size=shape["vocab_size"], emb_dim=hidden, inner_dim=64 if small else 4096,
            n_predict=3, top_k_tokens_per_head=(5, 3, 2), n_candidates=5,
        )  # fmt: skip
        dtype = runner.dtype
        speculator = MLPSpeculator(spec_config, dtype=dtype, device=ctx.device)
        with torch.no_grad():
            for name, p in speculator.named_parameters():
                if name.startswith("ln."):
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.normal_(0.0, 1 / math.sqrt(spec_config.inner_dim))
        proposer = MLPProposer(speculator, (5, 3, 2), 5)
        state = torch.randn(hidden, device=ctx.device, dtype=dtype)
        inputs = [ProposalInput("speed", [1, 5, 9, 7], state, 3)]
        trees: list[Any] = []
        sec = timed(ctx, lambda: trees.append(proposer.propose(inputs)[0]), repeats)
        r.check("speed.draft_532x5", sec * 1e3, "ms", "INFO")
        r.check("speed.draft_532x5.tree_rows", trees[-1].num_drafts + 1, "rows", "INFO")

    ctx.step("speed.draft", step_draft, min_left=5)

    def step_batches() -> None:
        for ctx_len in contexts:
            for batch in (8, 32, 64):
                name = f"speed.decode_b{batch}_ctx{ctx_len}"
                if ctx.left() < 8:
                    r.check(f"{name}.skipped", "time", "-", "INFO")
                    continue
                need = batch * math.ceil((ctx_len + 1) / runner.block_size)
                if need > kv.num_free_blocks:
                    r.check(
                        f"{name}.skipped", f"pool_{kv.num_free_blocks}<{need}_blocks", "-", "INFO"
                    )
                    continue
                seqs = new_seqs(batch, ctx_len + 1)
                try:
                    inputs = decode_inputs(seqs, ctx_len)
                    sec = timed(ctx, run(inputs), repeats)
                finally:
                    free(seqs)
                tok_s = batch / sec
                r.check(f"{name}.step", sec * 1e3, "ms", "INFO")
                r.check(f"{name}.tok_s", tok_s, "tok/s", "INFO")
                b1 = results.get(f"b1_{ctx_len}")
                if b1:
                    scale = tok_s * b1
                    judged_here = judged and batch == 32 and ctx_len == contexts[0]
                    st = status(scale >= 20, judged_here) if batch == 32 else "INFO"
                    r.check(f"{name}.over_b1", scale, "x", st)

    ctx.step("speed.batches", step_batches, min_left=8)

    def step_mixed() -> None:
        ctx_len = contexts[0]
        trees = new_seqs(16, ctx_len + 17)
        chunk = new_seqs(1, chunk_tokens)
        try:
            tree_inputs = [tree_input(table, ctx_len, 16) for _, table in trees]
            chunk_input = [SequenceInput([7] * chunk_tokens, 0, chunk[0][1])]
            t_trees = timed(ctx, lambda: runner.execute(tree_inputs), repeats)
            t_chunk = timed(ctx, lambda: runner.execute(chunk_input), repeats)
            t_mixed = timed(ctx, lambda: runner.execute(tree_inputs + chunk_input), repeats)
        finally:
            free(trees)
            free(chunk)
        r.check("speed.mixed.trees16x16", t_trees * 1e3, "ms", "INFO")
        r.check(f"speed.mixed.chunk{chunk_tokens}", t_chunk * 1e3, "ms", "INFO")
        r.check("speed.mixed.both", t_mixed * 1e3, "ms", "INFO")
        r.check("speed.mixed.over_parts", t_mixed / (t_trees + t_chunk), "x", "INFO")

    ctx.step("speed.mixed", step_mixed, min_left=5)
    if ctx.cuda:
        r.check("speed.peak_memory", torch.cuda.max_memory_allocated() / 2**30, "GiB", "INFO")
        kv_bytes = sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer)
        r.check("speed.kv_pool_memory", kv_bytes / 2**30, "GiB", "INFO")


LOADER_CHILD = "--loader-child"


def loader_child(folder: str, device: str) -> None:
    """In a fresh process: build the model for `folder`'s config, load its checkpoint, print
    one JSON line (seconds, host RSS before and peak)."""
    import torch

    from engine.attention import TorchAttentionBackend
    from engine.models.llama import LlamaConfig, LlamaModel
    from engine.models.loader import load_weights

    config = LlamaConfig.from_folder(folder)
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    model = LlamaModel(config, TorchAttentionBackend(16), dtype, torch.device(device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    before_kb = _status_kb("VmRSS")
    try:  # reset the peak RSS (VmHWM) to the current RSS: the peak of imports is not ours
        Path("/proc/self/clear_refs").write_text("5")
        peak_source = "VmHWM"
    except OSError:
        peak_source = "ru_maxrss"
    start = time.perf_counter()
    load_weights(model, folder)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if peak_source == "VmHWM":
        peak_kb = _status_kb("VmHWM")
    else:
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"seconds": seconds, "rss_before_kb": before_kb, "peak_kb": peak_kb}
    print(json.dumps({**out, "peak_source": peak_source}))


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def section_loader(ctx: Ctx) -> None:
    import torch
    from safetensors.torch import save_file

    r = ctx.report
    small = ctx.small or not ctx.cuda
    shape = dict(SPEED_SMALL if small else SPEED_13B)
    shape["num_hidden_layers"] = 2 if small else 4
    dtype_name = "float16" if ctx.cuda else "float32"
    dtype = getattr(torch, dtype_name)
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}  # fmt: skip
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden, hidden),
            p + "self_attn.v_proj.weight": (hidden, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    # Random values made on the device (fast), then held on the host to be written.
    state = {
        name: torch.randn(s, device=ctx.device, dtype=dtype).mul_(0.02).cpu()
        for name, s in shapes.items()
    }
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    r.check("loader.checkpoint_bytes", nbytes / 1e9, "GB", "INFO")
    names = list(state)
    shard_count = 3
    per = math.ceil(len(names) / shard_count)

    st_dir = ctx.tmp / "loader-safetensors"
    bin_dir = ctx.tmp / "loader-bin"
    for d in (st_dir, bin_dir):
        d.mkdir(parents=True, exist_ok=True)
        write_llama_config(d, shape, dtype_name)
    start = time.perf_counter()
    weight_map: dict[str, str] = {}
    for k in range(shard_count):
        file = f"model-{k + 1:05d}-of-{shard_count:05d}.safetensors"
        part = names[k * per : (k + 1) * per]
        save_file({n: state[n] for n in part}, str(st_dir / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
    (st_dir / "model.safetensors.index.json").write_text(json.dumps(index) + "\n")
    r.check("loader.write_safetensors", time.perf_counter() - start, "s", "INFO")
    start = time.perf_counter()
    torch.save(state, bin_dir / "pytorch_model.bin")
    r.check("loader.write_bin", time.perf_counter() - start, "s", "INFO")
    del state
    gc.collect()

    for fmt, folder in (("safetensors", st_dir), ("bin", bin_dir)):

        def load(fmt: str = fmt, folder: Path = folder) -> None:
            cmd = [sys.executable, "-m", "bench.gpu_check", LOADER_CHILD, str(folder),
                   "--device", ctx.device]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            timeout = max(5.0, ctx.left() - 2)
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False)  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"loader child exited {proc.returncode}: {proc.stderr[-500:]}")
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            r.detail(f"{fmt}.child", out)
            r.check(f"loader.{fmt}.load", nbytes / out["seconds"] / 1e9, "GB/s", "INFO")
            r.check(f"loader.{fmt}.seconds", out["seconds"], "s", "INFO")
            r.check(f"loader.{fmt}.host_peak", out["peak_kb"] / 2**20, "GiB", "INFO")
            over = (out["peak_kb"] - out["rss_before_kb"]) * 1024
            r.check(f"loader.{fmt}.host_peak_over_model_built", over / 2**30, "GiB", "INFO")

        ctx.step(f"loader.{fmt}", load, min_left=5)
    r.detail("note", "files were just written: loads read them from the page cache")


def section_server(ctx: Ctx) -> None:
    r = ctx.report
    modules = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "prometheus_client")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    pb_dir = REPO / "server" / "pb"
    stubs = ("generation_pb2.py", "generation_pb2_grpc.py")
    have_stubs = all((pb_dir / s).is_file() for s in stubs)
    if not have_stubs and importlib.util.find_spec("grpc_tools") is None:
        missing.append("server/pb stubs (and grpc_tools to generate them)")
    if missing:
        r.detail("missing", missing)
        r.check("server.smoke", "skipped", "-", "INFO", missing=missing)
        return
    import grpc
    from google.protobuf import json_format

    from server.pb import generation_pb2 as pb
    from server.pb import generation_pb2_grpc
    from tools.server_process import ServerProcess

    spec = TINY_MODELS[1]
    folder = ctx.tmp / "server-model"
    write_tiny_llama(folder, spec)
    env = {"DEVICE": ctx.device, "KV_CACHE_BLOCKS": "512", "MAX_BATCH_SIZE": "8"}
    log = ctx.tmp / "server.log"
    process = ServerProcess(folder, env, log, python=sys.executable,
                            start_timeout_s=max(10.0, ctx.left() - 25))  # fmt: skip
    SERVERS.append(process)
    start = time.perf_counter()
    channel = None
    try:  # the server is stopped whatever happens, a section timeout included
        process.start()
        r.check("server.start", time.perf_counter() - start, "s", "INFO")
        channel = grpc.insecure_channel(process.grpc_target)
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        text = " ".join(f"w{i}" for i in range(5, 25))
        params = {"stopping": {"max_new_tokens": 8, "min_new_tokens": 8}}
        batch = json_format.ParseDict(
            {"requests": [{"text": text}], "params": params}, pb.BatchedGenerationRequest()
        )
        start = time.perf_counter()
        reply = stub.Generate(batch, timeout=30)
        r.check("server.generate", (time.perf_counter() - start) * 1e3, "ms", "INFO")
        tokens = reply.responses[0].generated_token_count
        r.check("server.generate.tokens", tokens, "tokens", status(tokens == 8))
        single = json_format.ParseDict(
            {"request": {"text": text}, "params": params}, pb.SingleGenerationRequest()
        )
        start = time.perf_counter()
        chunks = list(stub.GenerateStream(single, timeout=30))
        r.check("server.stream", (time.perf_counter() - start) * 1e3, "ms", "INFO")
        streamed = "".join(c.text for c in chunks)
        count = max((c.generated_token_count for c in chunks), default=0)
        r.check("server.stream.tokens", count, "tokens", status(count == 8))
        same = streamed == reply.responses[0].text
        r.check("server.stream_equals_generate", same, "-", status(same))
    finally:
        if channel is not None:
            channel.close()
        code = process.stop(stop_timeout_s=15)
        r.detail("server_log_tail", process.log_tail(2000))
        r.check("server.exit_code", code, "-", "INFO")


SERVERS: list[ServerProcess] = []  # started by `server`; the watchdog kills them

SECTION_FNS: dict[str, Callable[[Ctx], None]] = {
    "environment": section_environment,
    "exactness": section_exactness,
    "speed": section_speed,
    "loader": section_loader,
    "server": section_server,
}


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m bench.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes everywhere")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=", ".join(SECTIONS))
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument(LOADER_CHILD, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.loader_child:
        loader_child(args.loader_child, args.device)
        return 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"unknown sections: {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
        return 2
    report = Report(args)
    budgets = SMALL_BUDGETS if args.small or args.device == "cpu" else BUDGETS

    def watchdog() -> None:
        for server in SERVERS:  # the only child that outlives a call
            if server.proc is not None and server.proc.poll() is None:
                server.proc.kill()
        report.current = "main"
        report.check("run.watchdog", TOTAL_BUDGET_S, "s", "FAIL")
        path = report.write()
        print(f"watchdog: the run passed {TOTAL_BUDGET_S:.0f} s; wrote {path}", flush=True)
        os._exit(1)

    timer = threading.Timer(TOTAL_BUDGET_S, watchdog)
    timer.daemon = True
    timer.start()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = Ctx(args.device, args.small, report, Path(tmp))
        for name in sections:
            report.current = name
            begin = time.monotonic()
            left_total = TOTAL_BUDGET_S - 5 - (begin - report.start)
            budget = min(budgets[name], left_total)
            ctx.section_end = begin + budget
            entry = report.sections.setdefault(name, {})
            entry["budget_s"] = round(budget, 1)
            if budget < 3:
                report.check(f"{name}.skipped", "time", "-", "INFO")
                entry["status"] = "skipped"
                continue
            print(f"== {name} (budget {budget:.0f} s)", flush=True)
            try:
                with deadline(budget):
                    SECTION_FNS[name](ctx)
                entry["status"] = "ok"
            except SectionTimeout as e:
                entry["status"] = "timeout"
                report.error(name, f"timeout: {e}")
            except Exception as e:  # report it, go on to the next section
                entry["status"] = "error"
                entry["traceback"] = traceback.format_exc()
                report.error(name, f"{type(e).__name__}: {e}")
            entry["seconds"] = round(time.monotonic() - begin, 2)
            free_device_memory()
        report.current = "main"
    timer.cancel()
    report.check("run.wall", time.monotonic() - report.start, "s", "INFO")
    path = report.write()
    fails = [c["name"] for c in report.checks if c["status"] == "FAIL"]
    print(f"wrote {path}; {len(fails)} FAIL{': ' + ', '.join(fails) if fails else ''}", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
