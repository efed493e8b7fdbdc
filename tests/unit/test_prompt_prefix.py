"""Prompt tuning (TGIS's prefix_id): prefix embeddings before the prompt give transformers'
output for the same `inputs_embeds`; the prompt store's lookup rules, messages and LRU; prefix
caching never shares blocks between different prefixes; penalties skip the placeholders."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM
from engine.kv_cache import KVCacheManager
from engine.paths import model_path
from engine.request import PREFIX_PLACEHOLDER_ID, PromptPrefix, Request
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler
from server.messages import ValidationError
from server.prefix_store import PrefixStore
from tests.reference import compare_greedy, hf_greedy_with_prefix, require_model

MODEL = "tiny-llama-gqa-tied"
HIDDEN = 64
MAX_NEW = 12
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


def random_prefix(num_tokens: int, seed: int) -> torch.Tensor:  # [num_tokens, HIDDEN]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, HIDDEN, generator=gen) * 0.05


def write_peft_folder(folder: Path, embeds: torch.Tensor) -> None:
    """A PEFT prompt-tuning adapter as `save_pretrained` writes it."""
    folder.mkdir(parents=True)
    config = {
        "peft_type": "PROMPT_TUNING",
        "task_type": "CAUSAL_LM",
        "num_virtual_tokens": embeds.shape[0],
        "token_dim": embeds.shape[1],
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file({"prompt_embeddings": embeds.contiguous()}, str(folder / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(require_model(model_path(MODEL)), max_num_tokens=4096, block_size=16)


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefixes")
    (root / "tuned").mkdir()
    torch.save(random_prefix(6, 1), root / "tuned" / "decoder.pt")
    torch.save(random_prefix(3, 2), root / "flat.pt")
    (root / "team").mkdir()
    torch.save(random_prefix(4, 3), root / "team" / "nested.pt")
    write_peft_folder(root / "peft", random_prefix(8, 4))
    torch.save(torch.randn(5, 32), root / "wide.pt")
    torch.save({"not": "a tensor"}, root / "dict.pt")
    return root


def make_store(root: Path | None, cache_size_mb: int = 1, **kwargs: object) -> PrefixStore:
    return PrefixStore(
        root, HIDDEN, torch.float32, torch.device("cpu"), 100, cache_size_mb, **kwargs
    )  # type: ignore[arg-type]


def _check_equal_to_transformers(llm: LLM, prefix: torch.Tensor) -> None:
    outs = llm.generate(PROMPTS, MAX_NEW, ignore_eos=True, return_logits=True, prompt_prefix=prefix)
    for out in outs:
        ref = hf_greedy_with_prefix(model_path(MODEL), prefix, out.prompt_token_ids, MAX_NEW)
        compare_greedy(out.token_ids, ref, out.logits)


def test_pt_prefix_output_equals_transformers(llm: LLM, store_root: Path) -> None:
    prefix = make_store(store_root).get("tuned")
    assert prefix.num_tokens == 6
    _check_equal_to_transformers(llm, prefix.embeds)


def test_peft_folder_output_equals_transformers(llm: LLM, store_root: Path) -> None:
    prefix = make_store(store_root).get("peft")
    assert prefix.num_tokens == 8
    _check_equal_to_transformers(llm, prefix.embeds)


def test_a_prefix_changes_the_output(llm: LLM) -> None:
    plain = llm.generate(PROMPTS[:1], MAX_NEW, ignore_eos=True)[0].token_ids
    tuned = llm.generate(PROMPTS[:1], MAX_NEW, ignore_eos=True, prompt_prefix=random_prefix(5, 9))
    assert tuned[0].token_ids != plain


def test_prefix_caching_shares_blocks_only_between_equal_prefixes(llm: LLM) -> None:
    prompt = [list(range(1000, 1040))]  # 5 prefix + 40 tokens: two full 16-token blocks
    a, b = random_prefix(5, 11), random_prefix(5, 12)
    first_a = llm.generate(prompt, 4, ignore_eos=True, prompt_prefix=a)[0].token_ids
    hits = llm.kv.num_prefix_hit_tokens
    only_b = llm.generate(prompt, 4, ignore_eos=True, prompt_prefix=b)[0].token_ids
    assert llm.kv.num_prefix_hit_tokens == hits  # same length, same prompt, other prefix
    ref_b = hf_greedy_with_prefix(model_path(MODEL), b, prompt[0], 4)
    compare_greedy(only_b, ref_b)
    again_a = llm.generate(prompt, 4, ignore_eos=True, prompt_prefix=a)[0].token_ids
    assert llm.kv.num_prefix_hit_tokens == hits + 32
    assert again_a == first_a
    no_prefix = llm.generate([[PREFIX_PLACEHOLDER_ID] * 5 + prompt[0]], 1, ignore_eos=True)
    assert no_prefix and llm.kv.num_prefix_hit_tokens == hits + 32  # placeholders: not a hit


def test_kv_salt_separates_digest_chains() -> None:
    kv = KVCacheManager(16, block_size=4, enable_prefix_caching=True)
    tokens = [0, 0, 0, 7, 8, 9, 10, 11, 12]
    for seq, salt in (("a", b"A"), ("b", b"")):
        assert kv.allocate_cached_prefix(seq, tokens, salt) == 0
        kv.allocate_slots(seq, len(tokens))
        kv.cache_computed_blocks(seq, tokens, salt)
    assert kv.allocate_cached_prefix("c", tokens, b"B") == 0
    assert kv.allocate_cached_prefix("d", tokens, b"A") == 8
    assert kv.block_table("d") == kv.block_table("a")[:2]
    assert kv.allocate_cached_prefix("e", tokens) == 8
    assert kv.block_table("e") == kv.block_table("b")[:2]


def test_request_positions_and_penalty_skip_placeholders() -> None:
    prefix = PromptPrefix.of(random_prefix(3, 5))
    params = SamplingParams(max_new_tokens=4, repetition_penalty=100.0)
    req = Request("r", [5, 6], params, arrival_time=0.0, prompt_prefix=prefix)
    assert list(req.prompt_token_ids) == [PREFIX_PLACEHOLDER_ID] * 3 + [5, 6]
    assert (req.num_prefix_tokens, req.num_prompt_tokens, req.num_tokens) == (3, 5, 5)
    assert req.cache_salt == prefix.key != b""
    logits = torch.zeros(1, 16)
    logits[0, PREFIX_PLACEHOLDER_ID] = 2.0
    logits[0, 5] = 3.0  # a real prompt token: penalized below the placeholder's id
    choice = Sampler().sample(logits, [req], [[]])
    assert choice.token_ids == [PREFIX_PLACEHOLDER_ID]


def test_prefix_key_follows_content() -> None:
    t = random_prefix(4, 6)
    assert PromptPrefix.of(t).key == PromptPrefix.of(t.clone()).key
    assert PromptPrefix.of(t).key != PromptPrefix.of(t + 1e-3).key
    assert PromptPrefix.of(t).key != PromptPrefix.of(t.double()).key


def test_engine_refuses_wrong_hidden_size_and_prompt_logprobs(llm: LLM) -> None:
    with pytest.raises(ValueError, match="hidden size 32 does not match the model's 64"):
        llm.engine.add_request(
            "w", [1, 2], SamplingParams(), None, PromptPrefix.of(torch.ones(2, 32))
        )
    params = SamplingParams(prompt_logprobs=True)
    with pytest.raises(ValueError, match="prompt logprobs are not supported"):
        llm.engine.add_request("p", [1, 2], params, None, PromptPrefix.of(random_prefix(2, 0)))
    assert not llm.engine.has_unfinished_requests()


def test_store_resolves_ids(store_root: Path) -> None:
    store = make_store(store_root)
    assert store.get("flat").num_tokens == 3
    assert store.get("team/nested").num_tokens == 4
    assert torch.equal(store.get("tuned").embeds, torch.load(store_root / "tuned" / "decoder.pt"))


LOOKUP = "can't retrieve prompt prefix with id '{id}': "


@pytest.mark.parametrize(
    ("prefix_id", "reason"),
    [
        ("missing", 'prefix id "missing" not found'),
        ("team/missing", 'prefix id "team/missing" not found'),
        ("../secret", "Invalid prefix id ../secret, must contain only alphanumeric, _ and - and /"),
        ("a.b", "Invalid prefix id a.b, must contain only alphanumeric, _ and - and /"),
        ("/etc/passwd", "Invalid prefix id /etc/passwd"),
        ("wide", "Prefix embedding tensor dim 32 does not match model (64)"),
        ("dict", "Invalid prefix embedding tensor"),
    ],
)
def test_store_messages(store_root: Path, prefix_id: str, reason: str) -> None:
    failures: list[int] = []
    store = make_store(store_root, on_failure=lambda: failures.append(1))
    with pytest.raises(ValidationError) as e:
        store.get(prefix_id)
    assert e.value.message == LOOKUP.format(id=prefix_id) + reason
    assert failures == [1]


def test_store_finds_no_overlong_id(store_root: Path) -> None:
    with pytest.raises(ValidationError, match="not found"):
        make_store(store_root).get("p" * 100_000)


def test_store_without_root_finds_nothing() -> None:
    with pytest.raises(ValidationError, match='prefix id "x" not found'):
        make_store(None).get("x")


def test_store_checks_length_and_finiteness(tmp_path: Path) -> None:
    torch.save(random_prefix(101, 0), tmp_path / "long.pt")
    torch.save(torch.full((2, HIDDEN), float("nan")), tmp_path / "nan.pt")
    torch.save(torch.full((2, HIDDEN), 1e6), tmp_path / "big.pt")
    store = PrefixStore(tmp_path, HIDDEN, torch.float16, torch.device("cpu"), 100, 1)
    for prefix_id, reason in [
        ("long", "Invalid prefix embedding length of 101"),
        ("nan", "Prefix contains non-finite elements"),
        ("big", "Prefix contains non-finite elements after conversion from "),
    ]:
        with pytest.raises(ValidationError, match=reason):
            store.get(prefix_id)


@pytest.fixture
def sized_store(tmp_path: Path) -> Iterator[tuple[PrefixStore, list[float]]]:
    rows = 1024 * 1024 // (HIDDEN * 4) // 2  # half a MiB of float32 each
    for name in ("a", "b", "c"):
        torch.save(torch.randn(rows, HIDDEN), tmp_path / f"{name}.pt")
    torch.save(torch.randn(2 * rows + 1, HIDDEN), tmp_path / "huge.pt")
    loads: list[float] = []
    store = PrefixStore(
        tmp_path, HIDDEN, torch.float32, torch.device("cpu"), 10**6, 1, on_load=loads.append
    )
    yield store, loads


def test_store_lru_evicts_by_size(sized_store: tuple[PrefixStore, list[float]]) -> None:
    store, loads = sized_store
    a = store.get("a")
    store.get("b")
    assert store.cached_ids == ["a", "b"] and len(loads) == 2
    assert store.get("a") is a and len(loads) == 2  # a hit: now the most recent
    store.get("c")  # 1 MiB holds two: b, the least recently used, goes
    assert store.cached_ids == ["a", "c"] and len(loads) == 3
    store.get("b")
    assert store.cached_ids == ["c", "b"] and len(loads) == 4
    with pytest.raises(ValidationError, match="Prefix ID object huge exceeds the allowed cache"):
        store.get("huge")
    assert store.cached_ids == ["c", "b"]


def test_preempted_requests_recompute_with_their_prefix(llm: LLM) -> None:
    small = LLM(model_path(MODEL), max_num_tokens=96, block_size=16, enable_prefix_caching=False)
    prefix = random_prefix(6, 31)
    prompts = [*PROMPTS, "A long time ago"]
    outs = small.generate(prompts, 24, ignore_eos=True, prompt_prefix=prefix)
    assert small.engine.scheduler.num_preemptions > 0
    expected = llm.generate(prompts, 24, ignore_eos=True, prompt_prefix=prefix)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
