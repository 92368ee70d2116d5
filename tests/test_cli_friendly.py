"""Issue 15 item 5: Hydra errors as kvbench errors with a "did you mean", the paged default
engine, ad-hoc sweep names, run.repeats interleaving, calibrated profiles in the user
directory, and progress in a sweep and without a terminal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from run_fixtures import run_kvbench

from kvbench import cli
from kvbench.config import ConfigError, user_hardware_dir
from kvbench.overrides import check_overrides, repeat_passes, sweep_name_for, user_searchpath
from kvbench.runner import PROGRESS_LABEL, _Progress
from kvbench.sim.calibrate import CalibrationError, default_output

SIM = ["run.mode=sim", "workload.num_requests=2", "workload.output_len=2"]


@pytest.fixture(autouse=True)
def _user_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own $KVBENCH_HOME: nothing is written to the real user's."""
    home = tmp_path / "kvbench-home"
    monkeypatch.setenv("KVBENCH_HOME", str(home))
    return home


def _exit_code(argv: list[str]) -> int:
    """``kvbench ARGV`` in this process; a job's configuration error exits via SystemExit."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.mark.parametrize(
    ("command", "overrides", "expected"),
    [
        # a key typo (Hydra: "Key 'block_sizee' is not in struct ... use +engine.block_sizee")
        (
            "run",
            ["engine.block_sizee=24"],
            "engine.block_sizee: unknown key; did you mean engine.block_size?",
        ),
        ("run", ["run.progres=on"], "run.progres: unknown key; did you mean run.progress?"),
        ("run", ["engin=dense"], "engin: unknown key; did you mean engine?"),
        # a preset typo (Hydra: a dump of the search path)
        (
            "run",
            ["engine=pagedd"],
            "engine=pagedd: no engine preset named 'pagedd'; did you mean engine=paged?",
        ),
        ("run", ["+experiment=gqa_vs_mh"], "did you mean experiment=gqa_vs_mha?"),
        (
            "size",
            ["hardware=h100"],
            "hardware=h100: no hardware preset named 'h100'; did you mean hardware=h100-80gb?",
        ),
        ("export", ["model=tiny-gq"], "did you mean model=tiny-gqa?"),
        # a +key typo: Hydra adds it, kvbench's schema refuses it
        (
            "run",
            ["+engine.block_sizee=24"],
            "engine.block_sizee: unknown key for kvbench.engines.paged.PagedEngine; did you mean engine.block_size?",
        ),
        (
            "run",
            ["+run.progres=on"],
            "run.progres: Key 'progres' not in 'RunOptions'; did you mean run.progress?",
        ),
        ("run", ["+seedd=1"], "did you mean seed?"),
        # override parse and type errors
        ("run", ["seed=abc"], "seed: Value 'abc' of type 'str' could not be converted to Integer"),
        ("size", ["seq_len=abc"], "seq_len: Value 'abc'"),
        ("run", ["engine=["], "engine=[: not an override"),
        ("run", ["engine=paged,dense"], "engine=paged,dense: a comma list, range() or glob() is a sweep"),
        ("sweep", ["engine=paged,pagedd"], "did you mean engine=paged?"),
        ("sweep", ["engine=paged,dense", "engine.block_sizee=8"], "did you mean engine.block_size?"),
        # a parameter the plug-in takes that its preset does not set: the + hint is right here
        (
            "run",
            ["workload.n=2"],
            "takes it, but the workload preset does not set it: add it with +workload.n=2",
        ),
    ],
)
def test_hydra_errors_are_one_screen_with_a_suggestion(
    command: str, overrides: list[str], expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    assert _exit_code([command, *overrides]) == 2
    captured = capsys.readouterr()
    prefix = "kvbench" if command in ("run", "sweep") else f"kvbench {command}"
    assert captured.err.startswith(f"{prefix}: invalid configuration\n  ")
    assert expected in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) == 2, captured.err
    for hydra_noise in ("Config search path", "HYDRA_FULL_ERROR", "Traceback", "To append to your config"):
        assert hydra_noise not in captured.err
    assert not list(tmp_path.iterdir()), "a refused configuration writes nothing"


def test_a_refused_override_exits_2_from_the_command_line(tmp_path: Path) -> None:
    out = run_kvbench("run", "engine.block_sizee=24", cwd=tmp_path)
    assert out.returncode == 2
    assert (
        out.stderr
        == "kvbench: invalid configuration\n  engine.block_sizee: unknown key; did you mean engine.block_size?\n"
    )


def test_the_default_engine_is_paged() -> None:
    cfg = check_overrides("config", [], multirun=False)
    assert cfg.engine._target_ == "kvbench.engines.paged.PagedEngine"


def test_ad_hoc_sweep_names_come_from_the_overrides() -> None:
    assert (
        sweep_name_for(["engine=paged,dense", "workload=chat,random"])
        == "engine=paged,dense-workload=chat,random"
    )
    # where and how to run does not name the sweep; more repeats resume the same one
    assert sweep_name_for(
        ["engine=paged,dense", "run.repeats=5", "run.results_dir=/x", "hydra/launcher=joblib"]
    ) == ("engine=paged,dense")
    assert sweep_name_for([]) == "sweep"
    assert sweep_name_for(["workload.path=/data/my trace.jsonl"]) == "workload.path=_data_my_trace.jsonl"
    long = sweep_name_for([f"workload.num_requests={','.join(map(str, range(60)))}"])
    assert len(long) == 100 and re.search(r"-[0-9a-f]{8}$", long)


def test_repeat_passes_interleave_and_leave_a_hand_made_repeat_sweep_alone() -> None:
    assert repeat_passes(["engine=paged,dense"], 1) == [["engine=paged,dense"]]
    assert repeat_passes(["engine=paged,dense"], 3) == [
        ["engine=paged,dense", f"run.repeat={repeat}"] for repeat in range(3)
    ]
    assert repeat_passes(["run.repeat=0,1", "run.repeats=2"], 2) == [["run.repeat=0,1", "run.repeats=2"]]
    with pytest.raises(ConfigError, match="run.repeats=1,5: run.repeats is one number"):
        repeat_passes(["run.repeats=1,5"], 1)


def _job_lines(stdout: str) -> list[str]:
    return re.findall(r"^kvbench: (run \d+/\d+ · [^·\n]*)", stdout, flags=re.MULTILINE)


def test_ad_hoc_sweep_with_repeats_runs_interleaved_in_its_own_directory_and_resumes(tmp_path: Path) -> None:
    (tmp_path / "results" / "single").mkdir(parents=True)  # an earlier unrelated run's sweep
    args = ["sweep", "engine=paged,paged_noprefix", "run.repeats=2", "run.report=false", *SIM]
    out = run_kvbench(*args, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout, out.stderr)
    # Hydra varies the last parameter fastest: repeat 0 of every configuration, then repeat 1.
    assert [line.strip() for line in _job_lines(out.stdout)] == [
        "run 1/4 · engine=paged repeat 1/2",
        "run 2/4 · engine=paged_noprefix repeat 1/2",
        "run 3/4 · engine=paged repeat 2/2",
        "run 4/4 · engine=paged_noprefix repeat 2/2",
    ]
    assert "left in the sweep" in out.stdout  # an ETA once a run has finished
    name = "engine=paged,paged_noprefix-run.mode=sim-workload.num_requests=2-workload.output_len=2"
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == sorted([name, "single"])
    assert not list((tmp_path / "results" / "single").iterdir())
    assert f"sweep {name}: 4 runs in 2 configurations" in " ".join(out.stdout.split())
    again = run_kvbench(*args, cwd=tmp_path)
    assert again.returncode == 0, (again.stdout, again.stderr)
    assert again.stdout.count("already complete") == 4 and "run ok" not in again.stdout


def test_experiment_params_vary_faster_than_repeats_and_keep_the_experiment_name(tmp_path: Path) -> None:
    out = run_kvbench(
        "sweep",
        "+experiment=gqa_vs_mha",
        "workload.num_requests=2,3",
        "run.repeats=2",
        "run.mode=sim",
        "run.report=false",
        "run.progress=on",
        "workload.prompt_len=16",
        "workload.output_len=2",
        cwd=tmp_path,
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    order = [
        f"model=tiny-{m} workload.num_requests={n} repeat {r}/2"
        for r in (1, 2)
        for m in ("mha", "gqa", "mqa")
        for n in (2, 3)
    ]
    assert [line.split(" · ", 1)[1].strip() for line in _job_lines(out.stdout)] == order
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["gqa_vs_mha"]


def test_name_flag_chooses_the_sweep_directory(tmp_path: Path, capsys) -> None:
    out = run_kvbench("sweep", "--name", "mine", "engine=paged", "run.report=false", *SIM, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["mine"]
    assert cli.main(["sweep", "--name", "a", "run.sweep_name=b"]) == 2
    assert "--name: also given as run.sweep_name" in capsys.readouterr().err


def test_calibrate_writes_to_the_user_directory_and_refuses_shipped_names(_user_home: Path) -> None:
    assert user_hardware_dir() == _user_home / "hardware"
    assert default_output("my-cpu") == _user_home / "hardware" / "my-cpu.yaml"
    with pytest.raises(CalibrationError, match="'cpu' is a shipped hardware preset"):
        default_output("cpu")


def test_hardware_finds_user_profiles_and_shipped_presets_win(_user_home: Path, tmp_path: Path) -> None:
    shipped = Path(__file__).parents[1] / "conf" / "hardware" / "cpu.yaml"
    (_user_home / "hardware").mkdir(parents=True)
    text = shipped.read_text()
    (_user_home / "hardware" / "my-box.yaml").write_text(text.replace("name: cpu", "name: my-box"))
    (_user_home / "hardware" / "cpu.yaml").write_text(text.replace("name: cpu", "name: shadow"))
    search = user_searchpath()  # what the CLI adds to every command's overrides
    assert check_overrides("config", [*search, "hardware=my-box"], multirun=False).hardware.name == "my-box"
    assert check_overrides("config", [*search, "hardware=cpu"], multirun=False).hardware.name == "cpu"
    out = run_kvbench("size", "hardware=my-box", "model=tiny-gqa", "seq_len=16", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert '"hardware_name": "my-box"' in out.stdout
    assert "my-box" in run_kvbench("run", "--help", cwd=tmp_path).stdout


def test_progress_without_a_terminal_prints_plain_lines(capsys) -> None:
    token = PROGRESS_LABEL.set("run 3/12 · engine=paged workload=chat")
    try:
        progress = _Progress(12, "auto", "chat", interval_s=0.0)
    finally:
        PROGRESS_LABEL.reset(token)
    progress.update(5, 400, 2.0)
    progress.close()
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"kvbench: run 3/12 · engine=paged workload=chat: 5/12 requests, 200 tok/s, \d+ s elapsed\n", err
    ), err
    quiet = _Progress(12, "off", "chat", interval_s=0.0)
    quiet.update(5, 400, 2.0)
    waiting = _Progress(12, "auto", "chat", interval_s=3600.0)
    waiting.update(5, 400, 2.0)  # the first line comes after interval_s
    assert capsys.readouterr().err == ""
