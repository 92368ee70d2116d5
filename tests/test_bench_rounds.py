"""tests/benchmarks/rounds.py, the interleaved-rounds helper every benchmark times with:
rotation, fresh state per round, per-round ratios and slopes, the context it records, and
its refusals. A settable clock makes each variant's time exact."""

from __future__ import annotations

import math

import pytest
from bench_modules import load_benchmark_module

rounds = load_benchmark_module("rounds")


class Ticks:
    """A clock the work advances by hand: each variant's time is what it adds."""

    def __init__(self) -> None:
        self.now = 0.0

    def read(self) -> float:
        return self.now


def test_rounds_rotate_the_order_and_prepare_fresh_state() -> None:
    clock = Ticks()
    order: list[str] = []
    prepared: list[str] = []

    def variant(name: str, seconds: list[float]):
        def prepare():
            prepared.append(name)
            state = {"calls": 0}  # fresh per round: a work that reused it would count past 1

            def work() -> int:
                state["calls"] += 1
                order.append(name)
                clock.now += seconds[len([n for n in order if n == name]) - 1]
                return state["calls"]

            return work

        return prepare

    result = rounds.run_rounds(
        {"a": variant("a", [2.0, 4.0, 6.0, 8.0, 10.0]), "b": variant("b", [1.0, 1.0, 2.0, 8.0, 5.0])},
        num_rounds=5,
        clock=clock.read,
        warmup=False,
    )
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert prepared == order
    assert result.outcomes == {"a": 1, "b": 1}
    assert result.seconds == {"a": (2.0, 4.0, 6.0, 8.0, 10.0), "b": (1.0, 1.0, 2.0, 8.0, 5.0)}
    # Ratios are per round, then summarised: the median of (2, 4, 3, 1, 2), not 6 / 2.
    assert result.ratio("a", "b") == rounds.Spread(1.0, 2.0, 4.0)
    assert result.spread("b", 1e3) == rounds.Spread(1e3, 2e3, 8e3)
    assert result.rate("a", 100) == rounds.Spread(10.0, 100 / 6.0, 50.0)
    assert result.ratio("a", "b").as_info("x") == {"x_min": 1.0, "x_median": 2.0, "x_max": 4.0}
    assert result.clock == "read"
    info = result.info()
    assert info["rounds"] == 5 and "load_avg_1m_before" in info and "load_avg_1m_after" in info
    assert info["probe_python_mops"] > 0 and info["probe_compute_gflops"] > 0
    assert "load_average_1m" not in info  # the probe's own copy is not repeated


def test_warmup_runs_each_variant_once_untimed() -> None:
    clock = Ticks()
    calls: list[str] = []

    def prepare():
        def work() -> None:
            calls.append("x")
            clock.now += 1.0

        return work

    result = rounds.run_rounds({"x": prepare}, num_rounds=5, clock=clock.read)
    assert len(calls) == 6 and result.seconds["x"] == (1.0,) * 5


def test_slope_is_per_round_log_log() -> None:
    clock = Ticks()
    times = {"small": iter([1.0, 1.0, 1.0, 1.0, 1.0]), "large": iter([10.0, 20.0, 10.0, 10.0, 100.0])}

    def variant(name: str):
        def prepare():
            def work() -> None:
                clock.now += next(times[name])

            return work

        return prepare

    result = rounds.run_rounds(
        {"small": variant("small"), "large": variant("large")}, num_rounds=5, clock=clock.read, warmup=False
    )
    slope = result.slope("small", "large", 1000, 10000)
    assert slope.median == pytest.approx(1.0)
    assert slope.min == pytest.approx(1.0) and slope.max == pytest.approx(2.0)
    assert math.isclose(result.slope("small", "large", 100, 10000).median, 0.5)
    with pytest.raises(ValueError, match="large_work 10 must exceed small_work 10"):
        result.slope("small", "large", 10, 10)


def test_a_work_that_takes_no_time_is_refused() -> None:
    clock = Ticks()
    with pytest.raises(ValueError, match="still: round 0 took 0.0 s on read; the work is too short"):
        rounds.run_rounds({"still": lambda: lambda: None}, num_rounds=5, clock=clock.read, warmup=False)


@pytest.mark.parametrize(
    ("value", "message"),
    [("4", "expected an integer >= 5, got 4"), ("five", "expected an integer >= 5, got 'five'")],
)
def test_rounds_env_var_is_checked(monkeypatch, value: str, message: str) -> None:
    monkeypatch.setenv(rounds.ROUNDS_ENV, value)
    with pytest.raises(ValueError, match=f"KVBENCH_BENCH_ROUNDS: {message}"):
        rounds.num_rounds_from_env()


def test_rounds_env_var_raises_the_default(monkeypatch) -> None:
    monkeypatch.delenv(rounds.ROUNDS_ENV, raising=False)
    assert rounds.num_rounds_from_env() == 5
    monkeypatch.setenv(rounds.ROUNDS_ENV, "9")
    assert rounds.num_rounds_from_env() == 9


def test_sizes_env_var(monkeypatch) -> None:
    monkeypatch.setenv("KVBENCH_X", "1000,12031")
    assert rounds.sizes_from_env("KVBENCH_X", "300") == [1000, 12031]
    monkeypatch.delenv("KVBENCH_X")
    assert rounds.sizes_from_env("KVBENCH_X", "300") == [300]
    monkeypatch.setenv("KVBENCH_X", "10,0")
    with pytest.raises(ValueError, match="KVBENCH_X: expected positive integers, got '10,0'"):
        rounds.sizes_from_env("KVBENCH_X", "300")
    monkeypatch.setenv("KVBENCH_X", "all")
    with pytest.raises(ValueError, match="KVBENCH_X: expected comma-separated integers, got 'all'"):
        rounds.sizes_from_env("KVBENCH_X", "300")


def test_verify_sees_every_outcome_off_the_clock() -> None:
    clock = Ticks()
    seen: list[tuple[str, int]] = []
    calls = {"a": 0, "b": 0}

    def variant(name: str, seconds: float):
        def prepare():
            def work() -> int:
                calls[name] += 1
                clock.now += seconds
                return calls[name]

            return work

        return prepare

    def verify(name: str, outcome: int) -> None:
        seen.append((name, outcome))
        clock.now += 100.0  # a check this slow would swamp both figures if it were timed

    result = rounds.run_rounds(
        {"a": variant("a", 1.0), "b": variant("b", 2.0)}, num_rounds=5, clock=clock.read, verify=verify
    )
    assert result.seconds == {"a": (1.0,) * 5, "b": (2.0,) * 5}
    # The warm-up's outcomes (call 1), then every round's in the rotated order.
    rotated = ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    counts = {"a": 1, "b": 1}
    expected = [("a", 1), ("b", 1)]
    for name in rotated:
        counts[name] += 1
        expected.append((name, counts[name]))
    assert seen == expected


def test_a_failing_verify_ends_the_run() -> None:
    clock = Ticks()
    num_prepared = [0]

    def prepare():
        num_prepared[0] += 1

        def work() -> int:
            clock.now += 1.0
            return num_prepared[0]

        return work

    def verify(name: str, outcome: int) -> None:
        if outcome == 2:
            raise AssertionError(f"{name}: outcome {outcome} is wrong")

    with pytest.raises(AssertionError, match="x: outcome 2 is wrong"):
        rounds.run_rounds({"x": prepare}, num_rounds=5, clock=clock.read, warmup=False, verify=verify)
    assert num_prepared[0] == 2  # no round after the failing one
