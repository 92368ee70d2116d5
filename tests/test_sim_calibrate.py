"""Calibration of the cost model: NNLS, exact recovery from synthetic steps, the CLI."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from kvbench import results
from kvbench.sim.calibrate import CalibrationError, CalibrationRun, fit, main, nnls, shape_from_step
from kvbench.sim.cost_model import CostModel, StepShape
from kvbench.specs import HardwareSpec, ModelSpec

SPEC = ModelSpec()  # tiny-gqa, fp32
TRUTH = HardwareSpec(
    name="truth",
    hbm_bandwidth_gbps=20.0,
    memory_efficiency=0.6,
    bf16_tflops=0.5,
    mfu=0.3,
    step_overhead_s=2e-3,
    per_token_overhead_s=5e-6,
    per_seq_overhead_s=4e-5,
)


def synthetic_steps(
    truth: HardwareSpec, seed: int, num_steps: int = 300, prefill_share: float = 0.3
) -> pd.DataFrame:
    """Steps whose durations come from ``truth``, with the exact composition columns."""
    cm = CostModel.for_dtypes(SPEC, truth, "fp32", "fp32")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_steps):
        chunks = []
        if rng.random() < prefill_share:
            chunks = [
                (int(rng.integers(0, 200)), int(rng.integers(16, 256))) for _ in range(rng.integers(1, 3))
            ]
        lens = [int(x) for x in rng.integers(10, 1500, size=rng.integers(0 if chunks else 1, 16))]
        shape = StepShape.build(chunks, lens)
        rows.append(
            {
                "duration_s": cm.duration_s(shape),
                "num_prefill_tokens": shape.num_prefill_tokens,
                "num_decode_tokens": shape.num_decode_seqs,
                "num_running": shape.num_seqs,
                "kv_token_bytes": (shape.num_decode_context_tokens + shape.num_prefill_context_tokens)
                * cm.kv_bytes_per_token,
                "num_prefill_seqs": shape.num_prefill_seqs,
                "num_prefill_attention_pairs": shape.num_prefill_attention_pairs,
                "num_prefill_context_tokens": shape.num_prefill_context_tokens,
                "num_decode_context_tokens": shape.num_decode_context_tokens,
            }
        )
    return pd.DataFrame(rows)


def calibration_run(steps: pd.DataFrame, run_id: str = "r0") -> CalibrationRun:
    cm = CostModel.for_dtypes(SPEC, TRUTH, "fp32", "fp32")
    return CalibrationRun(run_id, steps, SPEC, cm.kv_bytes_per_token, cm.weight_bytes)


def test_nnls_matches_unconstrained_solution_when_it_is_feasible():
    rng = np.random.default_rng(0)
    matrix = rng.random((50, 3))
    truth = np.array([1.0, 2.0, 0.5])
    assert np.allclose(nnls(matrix, matrix @ truth), truth)


def test_nnls_clamps_a_negative_coefficient_to_zero():
    # Unconstrained LS would give x = (2, -1); the best x >= 0 drops the second column.
    matrix = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    target = np.array([2.0, -1.0, 1.0])
    solution = nnls(matrix, target)
    assert solution[1] == 0.0
    assert solution[0] == pytest.approx(1.5)  # least squares of [2, 1] on column (1, 0, 1)


def test_fit_recovers_every_coefficient_from_exact_steps():
    result = fit([calibration_run(synthetic_steps(TRUTH, 0))], HardwareSpec(), "fitted")
    hw = result.hardware
    assert hw.name == "fitted"
    for name in ("memory_efficiency", "mfu", "step_overhead_s", "per_token_overhead_s", "per_seq_overhead_s"):
        assert getattr(hw, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    assert result.mean_abs_rel_error < 1e-9
    assert result.num_memory_bound > 0 and result.num_compute_bound > 0
    assert result.notes == ()


def test_fit_is_unbiased_under_multiplicative_step_time_noise():
    # Step times jittered by ±25 % (log-normal, mean 1) like a shared CPU. Weighting each
    # residual by 1 / measured time would favour the steps that ran fast and fit ~10 %
    # low (about 2 * sigma**2); reweighting by the modeled time keeps the total right.
    steps = synthetic_steps(TRUTH, 3, num_steps=2000)
    rng = np.random.default_rng(4)
    sigma = 0.25
    noise = rng.lognormal(-(sigma**2) / 2, sigma, len(steps))
    noisy = steps.assign(duration_s=steps["duration_s"] * noise)
    result = fit([calibration_run(noisy)], HardwareSpec(), "fitted")
    fitted = CostModel.for_dtypes(SPEC, result.hardware, "fp32", "fp32")
    shapes = [shape_from_step(row, fitted.kv_bytes_per_token) for row in steps.to_dict("records")]
    predicted_s = sum(fitted.duration_s(shape) for shape in shapes)
    assert predicted_s / steps["duration_s"].sum() == pytest.approx(1.0, abs=0.02)


def test_fit_keeps_base_compute_term_when_no_step_is_compute_bound():
    steps = synthetic_steps(TRUTH, 1, prefill_share=0.0)  # decode only: memory-bound
    base = HardwareSpec(mfu=0.42)
    result = fit([calibration_run(steps)], base, "fitted")
    assert result.hardware.mfu == 0.42
    assert result.hardware.memory_efficiency == pytest.approx(0.6, rel=1e-6)
    assert any("compute term" in note for note in result.notes)


def test_fit_raises_the_nominal_bandwidth_when_the_fit_exceeds_it():
    fast = dataclasses.replace(TRUTH, hbm_bandwidth_gbps=50.0, memory_efficiency=0.8)  # 40 GB/s achieved
    result = fit([calibration_run(synthetic_steps(fast, 2))], HardwareSpec(hbm_bandwidth_gbps=20.0), "fitted")
    assert result.hardware.memory_efficiency == 1.0
    assert result.hardware.hbm_bandwidth_gbps == pytest.approx(40.0, rel=1e-6)
    assert any("hbm_bandwidth_gbps raised" in note for note in result.notes)


def test_fit_needs_usable_steps():
    empty = pd.DataFrame({"duration_s": [0.0], "num_prefill_tokens": [1], "num_decode_tokens": [0]})
    with pytest.raises(CalibrationError, match="no usable steps"):
        fit([calibration_run(empty)], HardwareSpec(), "x")
    with pytest.raises(CalibrationError, match="duration_s"):
        fit([calibration_run(empty.drop(columns="duration_s"))], HardwareSpec(), "x")


def test_shape_from_step_approximates_missing_columns():
    row = {"num_prefill_tokens": 10, "num_decode_tokens": 3, "kv_token_bytes": 100 * 8, "bytes_to_host": 7}
    shape = shape_from_step(row, kv_bytes_per_token=8)
    # One chunk from position 0: 10 * 11 / 2 pairs; decode reads what is held minus the chunk.
    assert shape == StepShape(10, 1, 55, 10, 3, 90, 7)
    with pytest.raises(CalibrationError, match="num_decode_tokens"):
        shape_from_step({"num_prefill_tokens": 1}, 8)


def _write_run(root, run_id: str, steps: pd.DataFrame, mode: str = "real") -> None:
    cm = CostModel.for_dtypes(SPEC, TRUTH, "fp32", "fp32")
    meta = {
        "run_id": run_id,
        "mode": mode,
        "status": "ok",
        "model": dataclasses.asdict(SPEC),
        "hardware": dataclasses.asdict(HardwareSpec()),
        "kv_bytes_per_token": cm.kv_bytes_per_token,
        "weight_bytes": cm.weight_bytes,
    }
    results.write_run(root / run_id, pd.DataFrame({"request_id": ["a"]}), steps, pd.DataFrame(), meta, "", {})


def test_calibrate_command_writes_a_loadable_profile(tmp_path, capsys):
    _write_run(tmp_path / "sweep", "a", synthetic_steps(TRUTH, 3, num_steps=150))
    _write_run(tmp_path / "sweep", "b", synthetic_steps(TRUTH, 4, num_steps=150))
    _write_run(tmp_path / "sweep", "sim", synthetic_steps(HardwareSpec(), 5, num_steps=20), mode="sim")
    out = tmp_path / "my-cpu.yaml"
    assert main([str(tmp_path / "sweep"), "--name", "my-cpu", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Fitted by `kvbench calibrate")
    assert "300 real-mode steps" in text  # the sim run is not fitted
    hw = HardwareSpec(**OmegaConf.to_container(OmegaConf.load(out)))
    hw.validate()
    assert hw.name == "my-cpu"
    assert hw.mfu == pytest.approx(0.3, rel=1e-6)
    assert hw.per_seq_overhead_s == pytest.approx(4e-5, rel=1e-6)
    assert f"wrote {out}" in capsys.readouterr().out


def test_calibrate_command_fails_clearly_without_real_runs(tmp_path, capsys):
    _write_run(tmp_path, "sim", synthetic_steps(TRUTH, 6, num_steps=10), mode="sim")
    assert main([str(tmp_path), "--out", str(tmp_path / "x.yaml")]) == 2
    assert "no successful real-mode runs" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()
    assert main([str(tmp_path / "missing")]) == 2
    assert "no kvbench runs found" in capsys.readouterr().err


def test_calibrate_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    _write_run(tmp_path / "sweep", "a", synthetic_steps(TRUTH, 3, num_steps=150))
    sweep = str(tmp_path / "sweep")
    out = tmp_path / "profile.yaml"
    out.write_text("name: my-hand-tuned-gpu\n")
    for flags in ([], ["--force"]):
        assert main([sweep, "--out", str(out), *flags]) == 2
        assert out.read_text() == "name: my-hand-tuned-gpu\n"
    err = capsys.readouterr().err
    assert f"{out} exists" in err and "was not written by kvbench calibrate" in err
    # A profile calibrate wrote is replaced with --force (and only with it).
    own = tmp_path / "own.yaml"
    assert main([sweep, "--out", str(own)]) == 0
    first = own.read_text()
    assert main([sweep, "--out", str(own)]) == 2
    assert main([sweep, "--out", str(own), "--force", "--name", "again"]) == 0
    assert own.read_text() != first and "name: again" in own.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["own.yaml", "profile.yaml", "sweep"]


@pytest.mark.parametrize("name", ["", ".", "..", "../../evil", "a/b"])
def test_calibrate_profile_names_stay_in_conf_hardware(name, tmp_path, capsys):
    assert main([str(tmp_path), "--name", name]) == 2
    assert "--name: " in capsys.readouterr().err


def test_calibrate_output_errors_name_the_path(tmp_path, capsys):
    _write_run(tmp_path / "sweep", "a", synthetic_steps(TRUTH, 3, num_steps=150))
    (tmp_path / "afile").write_text("mine\n")
    assert main([str(tmp_path / "sweep"), "--out", str(tmp_path / "afile" / "x.yaml")]) == 2
    assert f"{tmp_path}/afile is a file, not a directory" in capsys.readouterr().err
    (tmp_path / "adir.yaml").mkdir()
    assert main([str(tmp_path / "sweep"), "--out", str(tmp_path / "adir.yaml"), "--force"]) == 2
    assert "adir.yaml: exists and is not a regular file" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "mine\n" and list((tmp_path / "adir.yaml").iterdir()) == []
