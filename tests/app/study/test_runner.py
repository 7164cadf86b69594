"""The runner end to end on CPU: the tiny grid CI runs (configs/studies/tiny_cpu.yaml), two
heads x two seeds through ``cli.py fit`` and ``cli.py test`` in subprocesses, two at a time."""

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml

from app.study import load_grid, parse_grid, render_markdown, run_study, runner
from app.study.runner import StudyInterrupted, _csv_versions
from heads.errors import UserError


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    lines = []
    grid = load_grid("configs/studies/tiny_cpu.yaml")
    document = run_study(grid, out, parallel=2, threads=1, echo=lines.append)
    return grid, out, document, lines


@pytest.mark.slow  # the tiny grid: 6 cli.py processes, ~1 min on 2 cores
def test_every_run_is_fitted_tested_and_collected(study):
    _, out, document, _ = study
    runs = document["runs"]
    assert [(r["label"], r["seed"]) for r in runs] == [
        ("softmax", 1), ("softmax", 2), ("mixtape", 1), ("mixtape", 2)
    ]  # fmt: skip
    for run in runs:
        assert run["status"] == "ok", run.get("error")
        curve = run["fit"]["curve"]
        assert [p["epoch"] for p in curve] == [0, 1]
        assert all(0 < p["val/ppl"] < 20_000 and p["time/train_epoch_s"] > 0 for p in curve)
        assert curve[1]["train_s"] == pytest.approx(sum(p["time/train_epoch_s"] for p in curve))
        assert 0 < run["test"]["test/ppl"] < 20_000 and run["fit"]["global_step"] == 10
        assert run["fit"]["monitor"] == "val/loss"
        # the tested checkpoint is the one with the best validation loss
        result = json.loads((out / "tiny_cpu" / run["label"] / f"seed{run['seed']}" /
                             "result.json").read_text())  # fmt: skip
        tested = torch.load(result["tested_checkpoint"], map_location="cpu", weights_only=False)
        best = min(p["val/loss"] for p in curve)
        assert run["fit"]["best_score"] == pytest.approx(best)
        assert tested["epoch"] == min(curve, key=lambda p: p["val/loss"])["epoch"]
    # the seeds differ, the heads differ
    assert runs[0]["test"]["test/ppl"] != runs[1]["test"]["test/ppl"]
    assert runs[0]["fit"]["parameters"] != runs[2]["fit"]["parameters"]


@pytest.mark.slow
def test_progress_line_per_run_and_strict_json_on_disk(study):
    grid, out, document, lines = study
    assert len(lines) == 4
    line = re.compile(r"\[\d/4\] (softmax|mixtape) seed [12]: test/ppl \d+\.\d\d")
    assert all(line.match(x) for x in lines)

    def no_nan(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    saved = json.loads((out / grid.name / "study.json").read_text(), parse_constant=no_nan)
    assert saved == document
    assert "commands" not in saved["runs"][0] and saved["environment"]["torch"]


@pytest.mark.slow
def test_finished_runs_are_skipped(study):
    grid, out, _, _ = study
    results = sorted((out / grid.name).rglob("result.json"))
    stamps = [os.stat(p).st_mtime_ns for p in results]
    lines = []
    again = run_study(grid, out, echo=lines.append)
    assert all("skipped" in line for line in lines) and len(lines) == 4
    assert [os.stat(p).st_mtime_ns for p in results] == stamps
    assert [r["test"] for r in again["runs"]] == [r["test"] for r in study[2]["runs"]]


@pytest.mark.slow
def test_report_of_the_tiny_grid(study, tmp_path):
    _, _, document, _ = study
    text = render_markdown(document, tmp_path)
    assert re.search(r"\| softmax \| 2/2 \| \d+\.\d\d ± \d+\.\d\d \|", text)
    assert re.search(r"\| mixtape \| 2/2 \| ", text)
    assert (tmp_path / "tiny_cpu_curves.png").is_file()


@pytest.mark.slow
def test_a_failing_run_is_recorded_and_not_retried_unless_asked(tmp_path):
    grid = parse_grid({
        "name": "bad", "base": "configs/lm/ptb.yaml", "seeds": [1],
        "heads": {"mixtape": {"head": "configs/heads/mixtape.yaml",
                              "overrides": {"model.init_args.head.init_args.num_components": 3}}},
    })  # fmt: skip
    lines = []
    document = run_study(grid, tmp_path, echo=lines.append)
    run = document["runs"][0]
    assert run["status"] == "failed" and run["failed_stage"] == "fit"
    assert "power of two" in run["error"] and "FAILED" in lines[0]
    lines.clear()
    run_study(grid, tmp_path, echo=lines.append)
    assert "skipped" in lines[0]


def test_a_resumed_fit_reads_its_csv_attempts_in_order(tmp_path):
    for name in ("fit", "fit.1", "fit.2", "finetune", "fitness"):
        (tmp_path / "csv" / name).mkdir(parents=True)
        (tmp_path / "csv" / name / "metrics.csv").write_text("step\n")
    assert [p.parent.name for p in _csv_versions(tmp_path, "fit")] == ["fit", "fit.1", "fit.2"]


def _two_seeds(name: str, seeds: list[int]):
    return parse_grid({"name": name, "base": "configs/lm/ptb.yaml", "seeds": seeds,
                       "heads": {"softmax": "configs/heads/softmax.yaml"}})  # fmt: skip


@pytest.mark.parametrize("status", [130, 143, -2, -15])
def test_a_run_stopped_by_a_signal_leaves_no_result_and_stops_the_study(
    tmp_path, monkeypatch, status
):
    """A stage that exits after Ctrl+C or SIGTERM is not a failed run: it writes no
    result.json (running the study again continues it) and no other run starts."""
    calls = []

    def stopped(args, **kwargs):
        calls.append(args)
        return status

    monkeypatch.setattr(runner._STAGES, "call", stopped)
    grid, lines = _two_seeds("stopped", [1, 2]), []
    with pytest.raises(StudyInterrupted, match="2 of 2 runs to do: run the same command again"):
        run_study(grid, tmp_path, echo=lines.append)
    assert len(calls) == 1 and calls[0][2] == "fit"
    assert lines == [f"[1/2] softmax seed 1: INTERRUPTED (fit stopped by a signal (exit status "
                     f"{status}))"]  # fmt: skip
    assert not list(tmp_path.rglob(runner.RESULT))
    assert json.loads((tmp_path / "stopped" / "study.json").read_text())["runs"] == []


def test_ctrl_c_starts_no_other_run_and_waits_for_those_under_way(tmp_path, monkeypatch):
    """The terminal's Ctrl+C reaches the runner and the runs under way at once: the runner
    waits for them to stop (they save a checkpoint) and starts none of the queued ones. The
    Ctrl+C is the KeyboardInterrupt the main thread gets while it waits, once two runs are
    under way; they end after it, as a fit does once it has saved (no signal of the OS here:
    its delivery is the SIGTERM test's below, with real processes)."""
    calls, both_started, said = [], threading.Barrier(3), threading.Event()
    wait_all = runner._wait_all

    def ctrl_c_while_waiting(futures):
        monkeypatch.setattr(runner, "_wait_all", wait_all)  # the second wait is the real one
        both_started.wait(timeout=10)
        raise KeyboardInterrupt

    def stage(args, **kwargs):
        calls.append(args)
        both_started.wait(timeout=10)
        said.wait(timeout=10)  # the child saves and stops after the runner heard the Ctrl+C
        return 128 + signal.SIGINT

    def echo(line):
        lines.append(line)
        if line.startswith("SIGINT"):
            said.set()

    monkeypatch.setattr(runner._STAGES, "call", stage)
    monkeypatch.setattr(runner, "_wait_all", ctrl_c_while_waiting)
    grid, lines = _two_seeds("ctrl_c", [1, 2, 3, 4]), []
    try:
        with pytest.raises(StudyInterrupted, match="4 of 4 runs to do"):
            run_study(grid, tmp_path, parallel=2, echo=echo)
    except KeyboardInterrupt:
        pytest.fail("Ctrl+C left the runner")
    assert len(calls) == 2  # the two runs under way, no queued one
    assert lines[0] == "SIGINT: starting no other run; waiting for the runs under way to stop"
    assert sorted(lines[1:]) == [
        f"[{i}/4] softmax seed {i}: INTERRUPTED (fit stopped by a signal (exit status 130))"
        for i in (1, 2)
    ]


# a stage that saves and stops on SIGTERM, as cli.py fit does (143), or sleeps out the test
_STAGE = (
    "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); "
    "pathlib.Path(sys.argv[1]).touch(); time.sleep(300)"
)


def test_a_sigterm_to_the_runner_alone_reaches_the_runs_under_way(tmp_path, monkeypatch):
    """A container's stop or ``kill`` signals the runner only: it passes SIGTERM on to the
    stages under way (so that they save their checkpoints), starts no other run and exits
    as stopped by SIGTERM."""
    popen, ready, names = subprocess.Popen, tmp_path / "ready", itertools.count()
    ready.mkdir()

    def stage(args, **options):
        if "cli.py" in args:  # touches a file once its SIGTERM handler is in place
            args = [sys.executable, "-c", _STAGE, str(ready / str(next(names)))]
        return popen(args, **options)

    monkeypatch.setattr(runner.subprocess, "Popen", stage)

    def terminate_when_both_run() -> None:
        deadline = time.monotonic() + 60  # (a busy 2-core machine starts them slowly)
        while len(list(ready.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    escaped = []  # a SIGTERM the runner did not take would end pytest: record it instead

    def record(*_) -> None:
        escaped.append(True)

    guard = signal.signal(signal.SIGTERM, record)
    try:
        threading.Thread(target=terminate_when_both_run, daemon=True).start()
        grid, lines = _two_seeds("sigterm", [1, 2, 3]), []
        start = time.monotonic()
        with pytest.raises(StudyInterrupted) as stopped:
            run_study(grid, tmp_path, parallel=2, echo=lines.append)
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, guard)
    assert not escaped and time.monotonic() - start < 200  # not the stages' 300 s sleep
    assert stopped.value.signum == signal.SIGTERM
    assert sorted(lines) == [
        "SIGTERM: starting no other run; waiting for the runs under way to stop",
        *(f"[{i}/3] softmax seed {i}: INTERRUPTED (fit stopped by a signal (exit status 143))"
          for i in (1, 2)),
    ]  # fmt: skip
    assert restored is record and not runner._STAGES._live


# -- what a run folder holds, with the stages faked (no training: fast) ------------------------
def _checkpoint(path, step, best=""):
    state = {"best_model_path": best, "best_model_score": torch.tensor(5.0) if best else None,
             "monitor": "val/loss", "dirpath": str(path.parent)}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"epoch": 0, "global_step": step, "state_dict": {"w": torch.zeros(3)},
                "callbacks": {"ModelCheckpoint{'monitor': 'val/loss'}": state}}, path)  # fmt: skip


def _option(args, name):
    """The value jsonargparse would give ``--name``: the last on the command line, else the
    last config file's (a path or YAML text) that sets it."""
    given = [args[i + 1] for i, a in enumerate(args[:-1]) if a == f"--{name}"]
    if given:
        return yaml.safe_load(given[-1])
    value = None
    for config in (args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"):
        content = yaml.safe_load(open(config).read() if os.path.isfile(config) else config)
        if isinstance(content, dict) and name in content:
            value = content[name]
    return value


class FakeCli:
    """``cli.py fit`` and ``test`` as far as the runner sees them: the config saved beside the
    checkpoints (with the ckpt_path the fit was given), ``checkpoints/``, metrics. A fit resumed
    beside a ``last.ckpt`` writes ``last-v1.ckpt``, as Lightning did beside a preemption's
    last.ckpt; ``stop_first``: the first fit is stopped by SIGTERM after saving."""

    def __init__(self, run_dir, stop_first=False):
        self.run_dir, self.stop_first = run_dir, stop_first
        self.ckpt_paths: list[tuple[str, str | None]] = []  # (stage, ckpt_path it resumed)

    def __call__(self, args, **options):
        stage = args[2]
        ckpt = _option(args, "ckpt_path")
        if stage == "test":
            (self.run_dir / "csv" / "test").mkdir(parents=True, exist_ok=True)
            (self.run_dir / "csv" / "test" / "metrics.csv").write_text("test/ppl\n123.0\n")
            self.ckpt_paths.append(("test", ckpt))
            return 0
        loggers = _option(args, "trainer")["logger"]
        version = loggers[0]["init_args"]["version"]
        folder = self.run_dir / "tensorboard" / version
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text(yaml.safe_dump({"ckpt_path": ckpt, "seed": 1}))
        self.ckpt_paths.append((version, ckpt))
        csv = self.run_dir / "csv" / loggers[1]["init_args"]["version"]
        csv.mkdir(parents=True, exist_ok=True)
        checkpoints = folder / "checkpoints"
        if self.stop_first:  # stopped in its first epoch: a last.ckpt, no validation yet
            self.stop_first = False
            _checkpoint(checkpoints / "last.ckpt", 3)
            os.utime(checkpoints / "last.ckpt", ns=(1, 1))  # older than what follows
            return 128 + signal.SIGTERM
        (csv / "metrics.csv").write_text("epoch,step,val/loss,val/ppl\n0,9,5.0,150.0\n")
        _checkpoint(checkpoints / "epoch=0-step=10.ckpt", 10)
        last = "last-v1.ckpt" if (checkpoints / "last.ckpt").is_file() else "last.ckpt"
        _checkpoint(checkpoints / last, 10, best=str(checkpoints / "epoch=0-step=10.ckpt"))
        return 0


def _tiny(name, **extra):
    return parse_grid({"name": name, "base": "configs/lm/ptb.yaml", "seeds": [1],
                       "heads": {"softmax": "configs/heads/softmax.yaml"}, **extra})  # fmt: skip


def test_a_fit_stopped_in_its_first_epoch_is_tested_on_its_best_checkpoint(tmp_path, monkeypatch):
    """Stopped before its first validation and resumed, the fit's newest state is in
    last-v1.ckpt where Lightning kept the stopped last.ckpt beside it: the runner resumes
    from, and reads, the newest one (the best checkpoint it names), not the stopped state."""
    grid = _tiny("stopped_early")
    run_dir = tmp_path / grid.runs()[0].relative_dir
    fake = FakeCli(run_dir, stop_first=True)
    monkeypatch.setattr(runner._STAGES, "call", fake)
    with pytest.raises(runner.StageInterrupted):
        runner.execute_run(grid, grid.runs()[0], run_dir, {})
    result = runner.execute_run(grid, grid.runs()[0], run_dir, {})
    best = run_dir / "tensorboard" / "fit" / "checkpoints" / "epoch=0-step=10.ckpt"
    assert result["status"] == "ok", result.get("error")
    assert result["tested_checkpoint"] == str(best)
    assert result["fit"]["global_step"] == 10
    assert fake.ckpt_paths[-1] == ("test", str(best))


def test_the_fine_tuning_stage_starts_afresh_after_a_resumed_fit(tmp_path, monkeypatch):
    """A fit resumed from its last.ckpt saves a config holding that ckpt_path; the fine-tuning
    stage, started from that config, must not restore the fit's trainer state from it."""
    grid = _tiny("resumed_ft", finetune={"overrides": {"trainer.max_epochs": 3}})
    run_dir = tmp_path / grid.runs()[0].relative_dir
    _checkpoint(run_dir / "tensorboard" / "fit" / "checkpoints" / "last.ckpt", 5)  # cut short
    fake = FakeCli(run_dir)
    monkeypatch.setattr(runner._STAGES, "call", fake)
    result = runner.execute_run(grid, grid.runs()[0], run_dir, {})
    assert result["status"] == "ok", result.get("error")
    fit_last = run_dir / "tensorboard" / "fit" / "checkpoints" / "last.ckpt"
    assert fake.ckpt_paths[:2] == [("fit", str(fit_last)), ("finetune", None)]


def _stage_fails(args, **kwargs):
    return 1


@pytest.mark.parametrize("state", ["with a result", "cut short", "before spec.json"])
def test_a_run_folder_of_other_settings_is_refused_not_reused(tmp_path, monkeypatch, state):
    old, new = _tiny("edited", budget={"max_epochs": 2}), _tiny("edited", budget={"max_epochs": 5})
    run_dir = tmp_path / "edited" / old.runs()[0].relative_dir
    status = 128 + signal.SIGTERM if state == "cut short" else 1  # failed: a result.json
    monkeypatch.setattr(runner._STAGES, "call", lambda args, **kwargs: status)

    def study(grid, **options):
        try:
            run_study(grid, tmp_path, echo=lambda line: None, **options)
        except StudyInterrupted:
            assert state == "cut short"

    study(old)
    if state == "before spec.json":
        (run_dir / "spec.json").unlink(missing_ok=True)
    with pytest.raises(UserError) as refused:  # one line from the command, no traceback
        study(new, rerun_failed=state == "cut short")  # (a failed one: replaced, see below)
    message = str(refused.value)
    assert "\n" not in message and str(run_dir) in message
    assert "trainer.max_epochs: 2 -> 5" in message
    assert "give a new --out, or delete that folder" in message
    study(old, rerun_failed=True)  # the grid as it was: the folder is its own


def _failing_stage(said):
    """A stage that prints ``said`` into its log and fails."""

    def stage(args, **options):
        options["stdout"].write(f"{said}\n")
        return 1

    return stage


def test_rerun_failed_keeps_each_failed_attempts_logs(tmp_path, monkeypatch):
    """--rerun-failed opened the failed attempt's fit.log for writing: its error was lost."""
    grid = _tiny("attempts")
    run_dir = tmp_path / "attempts" / grid.runs()[0].relative_dir
    for attempt in (1, 2, 3):
        monkeypatch.setattr(runner._STAGES, "call", _failing_stage(f"attempt {attempt}"))
        run_study(grid, tmp_path, rerun_failed=True, echo=lambda line: None)
    assert (run_dir / "fit.log").read_text().endswith("attempt 3\n")
    for attempt in (1, 2):
        assert (run_dir / f"fit.failed-{attempt}.log").read_text().endswith(f"attempt {attempt}\n")


def test_rerun_failed_replaces_a_failed_run_whose_settings_were_fixed(tmp_path, monkeypatch):
    """A failed cell's overrides fixed, --rerun-failed refused the whole study (its folder
    was stale); it now starts that folder afresh, its failed log kept, and says so. A
    finished run's folder of other settings is still refused, untouched."""
    old = _tiny("fixed", budget={"max_epochs": 2})
    new = _tiny("fixed", budget={"max_epochs": 5})
    run_dir = tmp_path / "fixed" / old.runs()[0].relative_dir
    monkeypatch.setattr(runner._STAGES, "call", _failing_stage("the old error"))
    run_study(old, tmp_path, echo=lambda line: None)
    stale = run_dir / "tensorboard" / "fit" / "checkpoints" / "last.ckpt"
    _checkpoint(stale, 3)  # the failed fit's: must not be resumed by the new settings
    assert runner.study_status(new, tmp_path)[0] == (
        "[1/1] softmax seed 1: STALE (a failed run of other settings: `run --rerun-failed` "
        "replaces it)"
    )
    lines = []
    monkeypatch.setattr(runner._STAGES, "call", _failing_stage("the new error"))
    run_study(new, tmp_path, rerun_failed=True, echo=lines.append)
    assert lines[0] == (
        "[1/1] softmax seed 1: the failed run's settings changed (overrides.trainer.max_epochs: "
        "2 -> 5): its folder starts afresh, its logs kept as fit.failed-1.log"
    )
    assert "FAILED" in lines[1] and not stale.exists()
    assert (run_dir / "fit.failed-1.log").read_text().endswith("the old error\n")
    assert "--trainer.max_epochs 5" in (run_dir / "fit.log").read_text()
    assert json.loads((run_dir / "spec.json").read_text()) == runner.run_spec(new, new.runs()[0])
    # a finished run of other settings: refused, even with --rerun-failed
    done = tmp_path / "done"
    monkeypatch.setattr(runner._STAGES, "call", FakeCli(done / "fixed" / "softmax" / "seed1"))
    assert run_study(old, done, echo=lambda line: None)["runs"][0]["status"] == "ok"
    before = sorted(p.relative_to(done) for p in done.rglob("*"))
    with pytest.raises(runner.StaleRunError):
        run_study(new, done, rerun_failed=True, echo=lambda line: None)
    assert sorted(p.relative_to(done) for p in done.rglob("*")) == before


def test_a_grid_with_a_new_seed_keeps_the_finished_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(runner._STAGES, "call", _stage_fails)
    run_study(_two_seeds("more", [1]), tmp_path, echo=lambda line: None)
    lines = []
    run_study(_two_seeds("more", [1, 2]), tmp_path, echo=lines.append)
    assert "skipped" in lines[0] and "FAILED" in lines[1]


def test_an_unreadable_result_is_run_again_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(runner._STAGES, "call", _stage_fails)
    grid = _two_seeds("torn", [1])
    run_study(grid, tmp_path, echo=lambda line: None)
    result = tmp_path / "torn" / "softmax" / "seed1" / runner.RESULT
    result.write_text(result.read_text()[:40])  # as a kill while writing left it
    lines = []
    run_study(grid, tmp_path, echo=lines.append)
    assert lines[0].startswith(f"warning: {result} is unreadable")
    assert "FAILED" in lines[1] and json.loads(result.read_text())["status"] == "failed"
    assert not list(tmp_path.rglob("*.partial"))


def test_a_result_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A kill while writing result.json leaves none (the run is to do), not half of one."""
    monkeypatch.setattr(runner._STAGES, "call", _stage_fails)
    real_write_text = runner.Path.write_text

    def killed(self, text, *args, **kwargs):
        if "result.json" not in self.name:
            return real_write_text(self, text, *args, **kwargs)
        real_write_text(self, text[: len(text) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.Path, "write_text", killed)
    grid = _two_seeds("half", [1])
    with pytest.raises(KeyboardInterrupt):
        runner.execute_run(grid, grid.runs()[0], tmp_path, {})
    assert not (tmp_path / "result.json").exists()


# -- what makes a run folder the grid's, and who may use it ----------------------------------
def test_an_edited_config_file_refuses_the_run_folder_but_a_comment_does_not(tmp_path, monkeypatch):
    """The spec named the config files alone: an edited base config (or a file it names, as
    ``data: data.yaml``) reused the old results beside new ones."""
    monkeypatch.setattr(runner._STAGES, "call", _stage_fails)
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "base.yaml").write_text("trainer: {max_epochs: 2}\ndata: data.yaml\n")
    (configs / "data.yaml").write_text("init_args: {batch_size: 20}\n")
    grid = parse_grid({"name": "cfg", "base": str(configs / "base.yaml"), "seeds": [1],
                       "heads": {"softmax": "configs/heads/softmax.yaml"}})  # fmt: skip

    def study(rerun_failed=True):
        run_study(grid, tmp_path / "out", rerun_failed=rerun_failed, echo=lambda line: None)

    study()
    (configs / "base.yaml").write_text("# a comment\ntrainer: {max_epochs: 2}\ndata: data.yaml\n")
    study()  # the same settings
    (configs / "data.yaml").write_text("init_args: {batch_size: 40}\n")
    # (--rerun-failed would replace the failed run: test_rerun_failed_replaces_a_failed_run...)
    with pytest.raises(runner.StaleRunError, match=r"data\.yaml: \"[0-9a-f]+\" -> \"[0-9a-f]+\""):
        study(rerun_failed=False)


def test_a_second_runner_on_the_same_folder_is_refused_while_any_stage_lives(tmp_path, monkeypatch):
    """Two runners on one folder fitted the same run at once. The lock is the runner's and
    its stages': a runner killed with SIGKILL leaves its fits running, and they hold it."""
    popen, orphans = subprocess.Popen, []

    def stage(args, **options):  # a fit that outlives the runner (as after its SIGKILL)
        orphans.append(popen([sys.executable, "-c", "import time; time.sleep(60)"], **options))
        return popen([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(runner.subprocess, "Popen", stage)
    grid = _two_seeds("busy", [1])
    inside = []

    def echo(line):  # a second runner while the first runs
        with pytest.raises(runner.StudyBusyError, match=r"in use by another runner .*pid \d+"):
            run_study(grid, tmp_path, rerun_failed=True, echo=inside.append)
        inside.append(line)

    run_study(grid, tmp_path, echo=echo)
    assert inside and "FAILED" in inside[0]
    assert runner.study_busy(tmp_path / "busy")  # the orphan holds it
    with pytest.raises(runner.StudyBusyError):
        run_study(grid, tmp_path, rerun_failed=True, echo=lambda line: None)
    for orphan in orphans:
        orphan.kill()
        orphan.wait()
    assert not runner.study_busy(tmp_path / "busy")
    run_study(grid, tmp_path, rerun_failed=True, echo=lambda line: None)


def test_a_failed_run_names_its_log_and_the_study_json_keeps_no_local_path(tmp_path, monkeypatch):
    monkeypatch.setattr(runner._STAGES, "call", _stage_fails)
    lines = []
    document = run_study(_two_seeds("logged", [1]), tmp_path, echo=lines.append)
    log = tmp_path / "logged" / "softmax" / "seed1" / "fit.log"
    assert f"log {log})" in lines[0] and log.is_file()
    assert str(tmp_path) not in json.dumps(document)


def test_runs_of_other_code_are_labelled_with_their_commits(tmp_path, monkeypatch):
    """A study resumed after a ``git pull`` held runs of two commits; the study JSON and the
    report named the one of the last runner's start."""
    monkeypatch.setattr(runner._STAGES, "call", _stage_fails)
    for commit, seeds in (("a" * 40, [1]), ("b" * 40, [1, 2])):
        version = {"git_commit": commit, "git_dirty": False}
        monkeypatch.setattr(runner, "code_version", lambda v=version: dict(v))
        document = run_study(_two_seeds("pulled", seeds), tmp_path, echo=lambda line: None)
    assert document["environment"]["run_commits"] == {"a" * 40: 1, "b" * 40: 1}
    assert document["environment"]["git_commit"] == "b" * 40
    markdown = render_markdown(document, str(tmp_path), "")
    assert "commits aaaaaaaaaa (1 runs), bbbbbbbbbb (1 runs)" in markdown


def test_a_stage_killed_by_a_signal_says_so_not_its_last_line(tmp_path, monkeypatch):
    """A fit killed by the out-of-memory killer: its last printed line was reported as the
    error (a progress line, or the command line when it had printed none)."""

    def killed(args, stdout, **options):
        stdout.write("Epoch 0: 40%\n")
        return -signal.SIGKILL

    monkeypatch.setattr(runner._STAGES, "call", killed)
    document = run_study(_two_seeds("killed", [1]), tmp_path, echo=lambda line: None)
    assert document["runs"][0]["error"] == "fit exited with -9: killed by SIGKILL (out of memory?)"


def test_status_says_what_is_done_started_failed_and_left(tmp_path, monkeypatch, capsys):
    from app.study.__main__ import main

    grid = _two_seeds("state", [1, 2, 3, 4])
    runs, study_dir = grid.runs(), tmp_path / "state"
    monkeypatch.setattr(runner._STAGES, "call", _stage_fails)
    run_study(_two_seeds("state", [4]), tmp_path, echo=lambda line: None)  # seed 4 failed
    for run, wall in ((runs[0], 120.0), (runs[1], None)):
        run_dir = study_dir / run.relative_dir
        run_dir.mkdir(parents=True)
        (run_dir / "spec.json").write_text(json.dumps(runner.run_spec(grid, run)))
        if wall:  # seed 1 finished in 2 min; seed 2 started, no result
            result = {"label": "softmax", "seed": 1, "status": "ok", "test": {"test/ppl": 99.0},
                      "wall_s": {"fit": wall - 20, "test": 20.0}}  # fmt: skip
            (run_dir / "result.json").write_text(json.dumps(result))
    path = tmp_path / "state.yaml"
    path.write_text(yaml.safe_dump({**grid.raw, "seeds": [1, 2, 3, 4]}))

    def status():
        assert main(["status", str(path), "--out", str(tmp_path)]) == 0
        return capsys.readouterr().out.splitlines()

    lines = status()
    assert lines[0] == "[1/4] softmax seed 1: test/ppl 99.00"
    assert lines[1] == "[2/4] softmax seed 2: cut short (`run` resumes it)"
    assert lines[2] == "[3/4] softmax seed 3: to do"
    assert lines[3].startswith("[4/4] softmax seed 4: FAILED (fit exited with 1")
    assert "softmax/seed4/fit.log" in lines[3]
    assert lines[4] == "1 ok, 1 failed, 1 started, 1 to do; no runner at work"
    assert lines[5] == "left: 2 runs, ~4 min one at a time (the 1 finished runs' mean, 2.0 min)"
    lock = runner.StudyLock(study_dir)
    try:
        lines = status()
    finally:
        lock.release()
    assert lines[1] == "[2/4] softmax seed 2: running"
    assert f"; a runner is at work (pid {os.getpid()} on " in lines[4]


@pytest.mark.parametrize(
    ("said", "slot", "device"),
    [("True (cuda), used: True", None, "cuda"), ("True (cuda), used: True", "1", "cuda:1"),
     ("True (cuda), used: False", "1", "cpu"), (None, None, "cpu")],
)  # fmt: skip
def test_the_recorded_device_is_the_one_the_fit_used(tmp_path, monkeypatch, said, slot, device):
    """``--devices none`` on a GPU machine: the fits took the GPU, the runs said ``cpu``."""
    run_dir = tmp_path / "run"
    fake = FakeCli(run_dir)

    def fit(args, stdout, **options):
        if said is not None and args[2] == "fit":
            stdout.write(f"GPU available: {said}\n")
        return fake(args, **options)

    monkeypatch.setattr(runner._STAGES, "call", fit)
    grid = _tiny("device")
    env = {} if slot is None else runner._run_env(slot, None)
    assert runner.execute_run(grid, grid.runs()[0], run_dir, env)["device"] == device


def test_an_infinite_test_perplexity_is_a_diverged_run_not_a_crash(tmp_path, monkeypatch):
    """Adam at lr 1e30: losses of 1e31 nats, finite (no non-finite-loss stop), perplexities
    inf. The run was "ok" with no number and its progress line raised a TypeError that
    ended the study, again at every rerun (the line of the skipped run)."""
    run_dir = tmp_path / "inf" / "softmax" / "seed1"
    fake = FakeCli(run_dir)

    def stage(args, **options):
        code = fake(args, **options)
        csv = run_dir / "csv" / ("test" if args[2] == "test" else "fit")
        if args[2] == "test":
            (csv / "metrics.csv").write_text("test/loss,test/ppl\n3e31,inf\n")
        else:
            (csv / "metrics.csv").write_text("epoch,step,val/loss,val/ppl\n0,9,3e31,inf\n")
        return code

    monkeypatch.setattr(runner._STAGES, "call", stage)
    lines = []
    grid = _tiny("inf")
    run = run_study(grid, tmp_path, echo=lines.append)["runs"][0]
    assert run["status"] == "diverged" and run["error"] == "test: test/ppl is inf"
    assert "DIVERGED (test: test/ppl is inf" in lines[0]
    # a result an older runner wrote: "ok", its values None (finite_json)
    result = json.loads((run_dir / "result.json").read_text())
    result.update(status="ok", test={"test/ppl": None})
    line = runner.progress_line(1, 1, result, grid, "")
    assert line.startswith("[1/1] softmax seed 1: test/ppl non-finite")
