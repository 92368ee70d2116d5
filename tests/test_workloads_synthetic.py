"""Synthetic workloads: determinism, recovered distribution parameters, prefix structure."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from kvbench.types import Workload
from kvbench.workloads.distributions import (
    ClosedLoopArrivals,
    EmpiricalLength,
    arrival_process,
    length_dist,
    sample_lengths,
)
from kvbench.workloads.errors import TraceError, WorkloadConfigError
from kvbench.workloads.passkey import FILLER_TEXT, NEEDLE_TEXT, QUESTION_TEXT, long_context
from kvbench.workloads.prefixes import SYSTEM_PROMPT_TEXT, TOOL_SCAFFOLD_TEXT, agentic, chat, rag
from kvbench.workloads.synthetic import beam_search, best_of_n, prefix_repetition, random_requests
from kvbench.workloads.tokens import derive_rng, keyed_token_ids

BIG_VOCAB = 1 << 30  # makes accidental id collisions (which would fake shared prefixes) negligible


class CharTokenizer:
    """A fake tokenizer: one id per character, ids >= 3."""

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) for c in text]


def digest(workload: Workload) -> str:
    h = hashlib.sha256()
    for r in workload.requests:
        # The ids as a tuple whatever form the prompt takes (random prompts are int32 arrays).
        prompt = tuple(np.asarray(r.prompt_token_ids).tolist())
        h.update(repr((r.request_id, round(r.arrival_s, 9), prompt, r.max_new_tokens)).encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- determinism

GENERATORS = {
    "random": lambda seed: random_requests(
        16,
        {"kind": "uniform", "low": 8, "high": 64},
        8,
        {"kind": "poisson", "rate_per_s": 4},
        vocab_size=4096,
        seed=seed,
    ),
    "chat": lambda seed: chat(4, 3, vocab_size=4096, seed=seed, arrival={"kind": "poisson", "rate_per_s": 1}),
    "rag": lambda seed: rag(16, vocab_size=4096, seed=seed),
    "agentic": lambda seed: agentic(2, 3, vocab_size=4096, seed=seed),
    "prefix_repetition": lambda seed: prefix_repetition(16, 4, vocab_size=4096, seed=seed),
    "best_of_n": lambda seed: best_of_n(4, vocab_size=4096, seed=seed),
    "beam_search": lambda seed: beam_search(4, vocab_size=4096, seed=seed),
    "long_context": lambda seed: long_context(4, 128, vocab_size=4096, seed=seed),
}


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_same_seed_same_requests_other_seed_different(kind: str) -> None:
    make = GENERATORS[kind]
    first, again, other = make(7), make(7), make(8)
    assert first == again
    assert digest(first) != digest(other)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(first.requests, first.requests[1:]))
    assert len({r.request_id for r in first.requests}) == len(first.requests)
    for r in first.requests:
        assert all(3 <= t < 4096 for t in r.prompt_token_ids)
        assert r.max_new_tokens >= 1


def test_golden_ids_are_machine_independent() -> None:
    # Pinned values: a change here means a given config no longer replays the same tokens.
    ids = keyed_token_ids(0, [0, 0, 7, 7], [0, 1, 0, 1], 32000)
    assert ids.tolist() == keyed_token_ids(0, [0, 0, 7, 7], [0, 1, 0, 1], 32000).tolist()
    assert ids.tolist() == GOLDEN_KEYED_IDS
    assert digest(GENERATORS["random"](0)) == GOLDEN_RANDOM_DIGEST


# SplitMix64 arithmetic: identical on every platform and numpy version.
GOLDEN_KEYED_IDS = [932, 19883, 15530, 22794]
# numpy's PCG64 + SeedSequence streams; numpy only changes them with a documented notice.
GOLDEN_RANDOM_DIGEST = "d7b4bc186f84a6a1"


def test_request_tokens_do_not_depend_on_request_count() -> None:
    small = random_requests(4, 32, 8, vocab_size=4096, seed=3)
    large = random_requests(40, 32, 8, vocab_size=4096, seed=3)
    assert [r.prompt_token_ids.tolist() for r in small.requests] == [
        r.prompt_token_ids.tolist() for r in large.requests[:4]
    ]


# --------------------------------------------------------------------------- lengths

N_LARGE = 40_000


def test_uniform_normal_lognormal_means_recovered() -> None:
    rng = derive_rng(1, 99)
    uniform, _ = sample_lengths(length_dist({"kind": "uniform", "low": 32, "high": 256}, "x"), rng, N_LARGE)
    assert uniform.min() == 32 and uniform.max() == 256
    assert uniform.mean() == pytest.approx(144, rel=0.01)
    normal, clipped = sample_lengths(
        length_dist({"kind": "normal", "mean": 500, "std": 50}, "x"), rng, N_LARGE
    )
    assert clipped == 0
    assert normal.mean() == pytest.approx(500, rel=0.005)
    assert normal.std() == pytest.approx(50, rel=0.03)
    lognormal, _ = sample_lengths(
        length_dist({"kind": "lognormal", "mean": 300, "sigma": 0.6}, "x"), rng, N_LARGE
    )
    assert lognormal.mean() == pytest.approx(300, rel=0.02)
    assert np.log(lognormal).std() == pytest.approx(0.6, rel=0.03)


def test_clipping_is_counted_exactly() -> None:
    dist = length_dist({"kind": "normal", "mean": 20, "std": 30, "min_len": 4, "max_len": 40}, "x")
    lengths, clipped = sample_lengths(dist, derive_rng(0, 1), 5000)
    raw = np.rint(derive_rng(0, 1).normal(20, 30, 5000))
    assert clipped == int(np.count_nonzero((raw < 4) | (raw > 40)))
    assert lengths.min() == 4 and lengths.max() == 40
    workload = random_requests(200, {"kind": "normal", "mean": 5, "std": 10}, 4, vocab_size=100, seed=0)
    assert workload.counters["num_prompt_len_clipped"] > 0
    assert workload.counters["num_output_len_clipped"] == 0


def test_empirical_lengths_from_file(tmp_path) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("# observed prompt lengths\n100\n\n200\n200\n400  # long\n")
    dist = length_dist({"kind": "empirical", "path": str(path)}, "prompt_len")
    assert dist == EmpiricalLength((100, 200, 200, 400))
    lengths, _ = sample_lengths(dist, derive_rng(0, 1), N_LARGE)
    freq = Counter(lengths.tolist())
    assert set(freq) == {100, 200, 400}
    assert freq[200] / N_LARGE == pytest.approx(0.5, abs=0.01)
    csv_path = tmp_path / "lengths.csv"
    csv_path.write_text("id,tokens\na,5\nb,7\n")
    assert length_dist({"kind": "empirical", "path": str(csv_path), "column": "tokens"}, "x").values == (5, 7)


def test_empirical_file_errors_name_line(tmp_path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("10\nabc\n")
    with pytest.raises(
        TraceError, match=r"^.*bad\.txt:2: field 'length': expected a positive int, got 'abc'$"
    ):
        EmpiricalLength.from_file(path)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(TraceError, match=r"empty\.txt:0: field 'length': no lengths in file"):
        EmpiricalLength.from_file(empty)


# --------------------------------------------------------------------------- arrivals


def gaps_of(spec, n: int = N_LARGE) -> np.ndarray:
    times = arrival_process(spec).times(derive_rng(5, 3), n)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    return np.diff(times)


def test_poisson_rate_and_cv_recovered() -> None:
    gaps = gaps_of({"kind": "poisson", "rate_per_s": 10.0})
    assert 1 / gaps.mean() == pytest.approx(10.0, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_cv(burstiness: float) -> None:
    gaps = gaps_of({"kind": "gamma", "rate_per_s": 5.0, "burstiness": burstiness})
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_ramp_rate_rises_linearly() -> None:
    gaps = gaps_of({"kind": "ramp", "start_rate_per_s": 2.0, "end_rate_per_s": 20.0})
    tenth = len(gaps) // 10
    assert 1 / gaps[:tenth].mean() == pytest.approx(2.9, rel=0.05)  # mean of 1/rate over rates 2..3.8
    assert 1 / gaps[-tenth:].mean() == pytest.approx(19.0, rel=0.05)


def test_offline_and_closed_loop() -> None:
    offline = random_requests(5, 8, 4, "offline", vocab_size=100, seed=0)
    assert {r.arrival_s for r in offline.requests} == {0.0}
    closed = random_requests(5, 8, 4, {"kind": "closed_loop", "concurrency": 2}, vocab_size=100, seed=0)
    assert {r.arrival_s for r in closed.requests} == {0.0}
    assert {r.tags["max_concurrency"] for r in closed.requests} == {"2"}
    assert arrival_process({"kind": "closed_loop", "concurrency": 3}) == ClosedLoopArrivals(3)


# --------------------------------------------------------------------------- prefix structure


def test_chat_histories_grow_and_share_the_system_prompt() -> None:
    workload = chat(6, 4, system_prompt_len=40, vocab_size=BIG_VOCAB, seed=1, turn_interval_s=2.0)
    by_conv: dict[str, list] = {}
    for r in workload.requests:
        by_conv.setdefault(r.tags["conversation"], []).append(r)
    system = workload.requests[0].prompt_token_ids[:40]
    for turns in by_conv.values():
        turns.sort(key=lambda r: int(r.tags["turn"]))
        assert [r.tags["turn"] for r in turns] == ["0", "1", "2", "3"]
        for r in turns:
            assert r.prompt_token_ids[:40] == system
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt_token_ids[: prev.num_prompt_tokens] == prev.prompt_token_ids
            # the reply stand-in in the history has the length the turn asked for
            assert nxt.num_prompt_tokens - prev.num_prompt_tokens - prev.max_new_tokens in range(16, 49)
            assert nxt.arrival_s >= prev.arrival_s
    firsts = [turns[0].prompt_token_ids for turns in by_conv.values()]
    assert len({p[40] for p in firsts}) == len(firsts)  # conversations diverge after the system prompt


def test_chat_with_tokenizer_uses_real_system_prompt_text() -> None:
    workload = chat(2, 2, system_prompt_len=300, vocab_size=BIG_VOCAB, seed=0, tokenizer=CharTokenizer())
    text_ids = CharTokenizer().encode(SYSTEM_PROMPT_TEXT)
    expected = (text_ids * 2)[:300]  # tiled to the requested length
    assert all(r.prompt_token_ids[:300] == tuple(expected) for r in workload.requests)


def test_agentic_shares_scaffold_and_chains_steps() -> None:
    workload = agentic(
        3, 5, scaffold_len=100, task_len=10, vocab_size=BIG_VOCAB, seed=2, tokenizer=CharTokenizer()
    )
    scaffold = tuple((CharTokenizer().encode(TOOL_SCAFFOLD_TEXT) * 2)[:100])
    sessions: dict[str, list] = {}
    for r in workload.requests:
        assert r.prompt_token_ids[:100] == scaffold
        sessions.setdefault(r.tags["conversation"], []).append(r)
    assert sorted(len(s) for s in sessions.values()) == [5, 5, 5]
    for steps in sessions.values():
        steps.sort(key=lambda r: int(r.tags["turn"]))
        assert steps[0].num_prompt_tokens == 110
        for prev, nxt in zip(steps, steps[1:]):
            assert nxt.prompt_token_ids[: prev.num_prompt_tokens] == prev.prompt_token_ids


def test_rag_prompts_are_header_passages_question() -> None:
    workload = rag(40, num_passages=10, passage_len=20, passages_per_prompt=3, system_prompt_len=16,
                   question_len=5, vocab_size=BIG_VOCAB, seed=4)  # fmt: skip
    header = workload.requests[0].prompt_token_ids[:16]
    passages: dict[int, tuple[int, ...]] = {}
    for r in workload.requests:
        assert r.num_prompt_tokens == 16 + 3 * 20 + 5
        assert r.prompt_token_ids[:16] == header
        picked = [int(p) for p in r.tags["passages"].split(",")]
        assert len(set(picked)) == 3
        for slot, p in enumerate(picked):
            tokens = r.prompt_token_ids[16 + 20 * slot : 36 + 20 * slot]
            assert passages.setdefault(p, tokens) == tokens  # a passage is the same wherever it appears
    assert len(set(passages.values())) == len(passages)  # and differs from every other passage
    assert len(passages) >= 5


def test_rag_passage_popularity_follows_zipf() -> None:
    s = 1.2
    workload = rag(3000, num_passages=20, passages_per_prompt=1, zipf_exponent=s, vocab_size=4096, seed=0,
                   passage_len=4, question_len=1, output_len=1, system_prompt_len=1)  # fmt: skip
    counts = Counter(int(r.tags["passages"]) for r in workload.requests)
    weights = np.arange(1, 21) ** -s
    expected = 3000 * weights / weights.sum()
    for rank in range(4):
        assert counts[rank] == pytest.approx(expected[rank], rel=0.15)


def test_prefix_repetition_groups_share_prefixes_evenly() -> None:
    workload = prefix_repetition(30, 4, prefix_len=50, suffix_len=10, vocab_size=BIG_VOCAB, seed=0)
    groups: dict[str, list] = {}
    for r in workload.requests:
        groups.setdefault(r.tags["prefix"], []).append(r.prompt_token_ids)
    assert sorted(len(g) for g in groups.values()) == [7, 7, 8, 8]
    prefixes = set()
    for prompts in groups.values():
        assert len({p[:50] for p in prompts}) == 1
        assert len({p[50:] for p in prompts}) == len(prompts)
        prefixes.add(prompts[0][:50])
    assert len(prefixes) == 4


def test_best_of_n_and_beam_search_set_request_fields() -> None:
    bon = best_of_n(3, n=5, vocab_size=100, seed=0)
    assert {(r.n, r.beam_width) for r in bon.requests} == {(5, 1)} and all(
        r.temperature > 0 for r in bon.requests
    )
    beams = beam_search(3, beam_width=3, vocab_size=100, seed=0)
    assert {(r.n, r.beam_width) for r in beams.requests} == {(1, 3)}
    with pytest.raises(WorkloadConfigError, match="^n: best-of-n needs n >= 2, got 1$"):
        best_of_n(3, n=1, vocab_size=100)


# --------------------------------------------------------------------------- passkey


def find(haystack: tuple[int, ...], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if list(haystack[i : i + len(needle)]) == needle:
            return i
    return -1


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_with_tokenizer_places_needle_at_depth(depth: float) -> None:
    tok = CharTokenizer()
    (request,) = long_context(1, 600, depths=[depth], vocab_size=BIG_VOCAB, seed=3, tokenizer=tok).requests
    key = request.tags["passkey"]
    assert len(key) == 5 and request.num_prompt_tokens == 600
    needle = tok.encode(NEEDLE_TEXT.format(key=key))
    question = tok.encode(QUESTION_TEXT)
    assert list(request.prompt_token_ids[-len(question) :]) == question
    start = find(request.prompt_token_ids, needle)
    intro_len = len(tok.encode("There is an important piece of information hidden inside a lot of irrelevant text. "
                               "Find it and memorize it. I will quiz you about it."))  # fmt: skip
    num_filler = 600 - intro_len - len(needle) - len(question)
    assert start == intro_len + round(depth * num_filler)
    assert request.expected_output_token_ids == tuple(tok.encode(f" {key}"))
    assert request.max_new_tokens == len(request.expected_output_token_ids)
    assert (
        tok.encode(FILLER_TEXT)[:10] == list(request.prompt_token_ids[intro_len : intro_len + 10])
        or depth == 0
    )


def test_passkey_without_tokenizer_answer_is_in_the_prompt() -> None:
    workload = long_context(6, 256, depths=[0.1, 0.9], vocab_size=4096, seed=0)
    for r in workload.requests:
        assert r.num_prompt_tokens == 256
        pos = find(r.prompt_token_ids, list(r.expected_output_token_ids))
        assert pos >= 0
        expected_depth = float(r.tags["depth"])
        assert abs(pos / 256 - expected_depth) < 0.2
    keys = [r.tags["passkey"] for r in workload.requests]
    assert len(set(keys)) == len(keys)


def test_passkey_context_too_short() -> None:
    with pytest.raises(
        WorkloadConfigError, match=r"^context_len: 20 cannot hold the intro, needle and question"
    ):
        long_context(1, 20, vocab_size=4096)


# --------------------------------------------------------------------------- bad parameters


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_len": {"kind": "normal", "mean": 10, "std": -1}}, "prompt_len.std: must be >= 0, got -1"),
        ({"prompt_len": {"kind": "zipf"}}, "prompt_len.kind: expected one of"),
        (
            {"prompt_len": {"kind": "uniform", "low": 1, "high": 4, "hi": 3}},
            "prompt_len.hi: unknown parameter",
        ),
        (
            {"prompt_len": {"kind": "uniform", "low": 10, "high": 4}},
            "prompt_len.high: must be >= low=10, got 4",
        ),
        ({"output_len": 0}, "output_len.value: must be >= 1, got 0"),
        ({"arrival": {"kind": "poisson", "rate_per_s": 0}}, "arrival.rate_per_s: must be > 0, got 0"),
        (
            {"arrival": {"kind": "poisson", "rate_per_s": 1, "burstiness": 2}},
            "arrival.burstiness: unknown parameter",
        ),
        ({"arrival": {"kind": "gamma"}}, "arrival.rate_per_s: required"),
        (
            {"prompt_len": {"kind": "uniform", "low": 2, "high": 5, "max_len": 0}},
            "prompt_len.max_len: must be >= min_len=1, got 0",
        ),
        ({"num_requests": 0}, "num_requests: must be an int >= 1, got 0"),
        ({"vocab_size": 3}, "vocab_size: must be an int > 3"),
        ({"seed": -1}, "seed: must be an int in [0, 2**32), got -1"),
    ],
)
def test_bad_parameters_name_the_field(kwargs: dict, message: str) -> None:
    params = {"num_requests": 2, "prompt_len": 8, "output_len": 4, "vocab_size": 100, "seed": 0, **kwargs}
    with pytest.raises(WorkloadConfigError) as info:
        random_requests(**params)
    assert str(info.value).startswith(message)


def test_hydra_style_dictconfig_parameters_work() -> None:
    cfg = OmegaConf.create(
        {"prompt_len": {"kind": "uniform", "low": 4, "high": 8}, "arrival": {"kind": "gamma", "rate_per_s": 2,
         "burstiness": 0.5}, "depths": [0.0, 1.0]}
    )  # fmt: skip
    workload = random_requests(5, cfg.prompt_len, 2, cfg.arrival, vocab_size=100, seed=0)
    assert all(4 <= r.num_prompt_tokens <= 8 for r in workload.requests)
    assert len(long_context(2, 128, cfg.depths, vocab_size=100).requests) == 2


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num=st.integers(1, 12),
    low=st.integers(1, 40),
    span=st.integers(0, 40),
    vocab=st.integers(4, 50_000),
)
def test_random_requests_properties(seed: int, num: int, low: int, span: int, vocab: int) -> None:
    workload = random_requests(
        num, {"kind": "uniform", "low": low, "high": low + span}, {"kind": "lognormal", "mean": 8, "sigma": 1},
        {"kind": "gamma", "rate_per_s": 3, "burstiness": 0.5}, vocab_size=vocab, seed=seed,
    )  # fmt: skip
    assert len(workload.requests) == num
    assert [r.arrival_s for r in workload.requests] == sorted(r.arrival_s for r in workload.requests)
    for r in workload.requests:
        assert low <= r.num_prompt_tokens <= low + span
        assert all(3 <= t < vocab for t in r.prompt_token_ids)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), turns=st.integers(1, 5), convs=st.integers(1, 4))
def test_chat_property_each_turn_extends_the_previous(seed: int, turns: int, convs: int) -> None:
    workload = chat(
        convs, turns, system_prompt_len=8, user_len=3, output_len=2, vocab_size=BIG_VOCAB, seed=seed
    )
    assert len(workload.requests) == convs * turns
    by_id = {r.request_id: r for r in workload.requests}
    for c in range(convs):
        for k in range(1, turns):
            prev, nxt = by_id[f"chat-{c:04d}-{k - 1:03d}"], by_id[f"chat-{c:04d}-{k:03d}"]
            assert nxt.prompt_token_ids[: prev.num_prompt_tokens] == prev.prompt_token_ids
            assert nxt.num_prompt_tokens == prev.num_prompt_tokens + 2 + 3


def test_half_a_protocol_is_refused_naming_what_the_protocol_needs():
    """An object with ``draw`` but no length bounds is not a LengthDist, nor one with
    ``times`` but no ``request_tags`` an ArrivalProcess: refused, saying what is needed."""

    class DrawOnly:
        def draw(self, rng, num):
            return np.ones(num)

    class TimesOnly:
        def times(self, rng, num):
            return np.zeros(num)

    with pytest.raises(WorkloadConfigError, match=r"^prompt_len: .*LengthDist \(min_len, max_len and draw\)"):
        length_dist(DrawOnly(), "prompt_len")
    with pytest.raises(WorkloadConfigError, match=r"^arrival: .*ArrivalProcess \(times and request_tags\)"):
        arrival_process(TimesOnly())
    fixed = length_dist(7, "prompt_len")
    assert length_dist(fixed, "prompt_len") is fixed  # a whole LengthDist passes as is


def test_random_prompts_are_read_only_int32_arrays() -> None:
    """4 bytes a token, so a million random prompts fit in memory (a tuple holds an int
    object a token, ~36 bytes); the ids are those of the generator, read only."""
    workload = random_requests(8, {"kind": "uniform", "low": 8, "high": 64}, 4, vocab_size=4096, seed=5)
    for r in workload.requests:
        prompt = r.prompt_token_ids
        assert isinstance(prompt, np.ndarray) and prompt.dtype == np.int32 and not prompt.flags.writeable
        assert prompt.nbytes == 4 * r.num_prompt_tokens
        with pytest.raises(ValueError):
            prompt[0] = 3
