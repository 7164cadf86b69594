"""Runs a study grid through the CLI: per run ``python cli.py fit`` (optionally a fine-tuning
fit from the best checkpoint), ``python cli.py test --ckpt_path <best>`` and optionally
``python -m app.rank``, each in a subprocess, N at once on the devices present.

Every run has its own folder ``<out>/<study>/<label>/seed<seed>/`` holding the logs of each
subprocess, TensorBoard and CSV logs, checkpoints, ``spec.json`` (what the run computes: seed,
configs, options) and ``result.json``. A run with a ``result.json`` whose status is ``ok`` or
``diverged`` is finished and skipped when the study is run again; a fit that was cut short
resumes from its last checkpoint. A run folder whose ``spec.json`` differs from the grid's run
(the grid, or a config file it reads, was edited since) is refused, not reused; but with
``--rerun-failed`` a failed run's folder starts afresh (its stage logs kept as
``<stage>.failed-<n>.log``, as every failed attempt's are when it is run again). One runner at
a time uses a study folder (``.lock``, held by its stages too). Each result records the commit
it ran on; the study JSON names every commit its runs ran on. A stage stopped by Ctrl+C or
``SIGTERM`` (a scheduler's preemption) writes no ``result.json``: the study starts no other
run, and running it again continues where it stopped.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import yaml

from app.machine import load_average
from app.study.collect import (
    checkpoint_summary,
    last_values,
    max_regression,
    read_metrics,
    validation_curve,
)
from app.study.grid import REPO, Grid, RunSpec, fit_extra_args, override_args
from heads.errors import UserError

RESULT = "result.json"
SPEC = "spec.json"
FINISHED = ("ok", "diverged")
# the message of lightning_modules.errors.NonFiniteLossError, printed by cli.py
_DIVERGED = "non-finite"
# a stage's exit status after Ctrl+C or SIGTERM: 128 + the signal from cli.py's own handling,
# minus the signal where it died of it before that handling was in place
_INTERRUPTED = {code for sig in (signal.SIGINT, signal.SIGTERM) for code in (128 + sig, -sig)}


def _loggers(
    run_dir: Path, version: str, csv_version: str, tensorboard: bool = True
) -> dict[str, Any]:
    """TensorBoard (first: checkpoints and the saved config go beside its files) and CSV
    (what the runner reads back). A resumed fit logs to a new CSV version: CSVLogger deletes
    the metrics file of the version it is given."""
    loggers = []
    if tensorboard:
        loggers.append(
            {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(run_dir), "name": "tensorboard", "version": version},
            }
        )
    loggers.append(
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(run_dir), "name": "csv", "version": csv_version},
        }
    )
    return {"trainer": {"default_root_dir": str(run_dir), "logger": loggers}}


def _write_config(path: Path, content: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(content, sort_keys=False))
    return str(path)


def write_atomic(path: Path, text: str) -> None:
    """``text`` in ``path`` whole or not at all: written beside, then renamed (a run killed
    while writing ``result.json`` must not leave half of one that reads as finished)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def last_checkpoint(checkpoints: Path) -> Path | None:
    """The newest of a fit's ``last.ckpt`` and ``last-vN.ckpt``: Lightning writes the latter
    beside a ``last.ckpt`` that its resumed state does not name as its own (one saved on a
    preemption before this was fixed), and the stopped state stays in ``last.ckpt`` then."""
    found = [
        p for p in checkpoints.glob("last*.ckpt") if re.fullmatch(r"last(-v\d+)?\.ckpt", p.name)
    ]
    return max(found, key=lambda p: p.stat().st_mtime_ns, default=None)


def _csv_versions(run_dir: Path, version: str) -> list[Path]:
    """The metrics files of a fit stage's attempts, first one first."""
    found = [
        p
        for p in (run_dir / "csv").glob(f"{version}*/metrics.csv")
        if p.parent.name == version or p.parent.name.startswith(f"{version}.")
    ]
    return sorted(found, key=lambda p: (p.parent.name != version, len(p.parent.name), p))


def _saved_config(run_dir: Path, version: str) -> Path:
    """The config LightningCLI saved for a fit (beside the first logger's files)."""
    return run_dir / "tensorboard" / version / "config.yaml"


def device_used(log: str, pinned: str) -> str:
    """The device a fit trained on, from Lightning's ``GPU available: ..., used: ...`` line
    in its log: ``--devices none`` pins nothing, and a fit on a GPU machine took the GPU while
    the run was recorded as on ``cpu``; a config's ``accelerator: cpu`` on a pinned slot is
    the converse. ``pinned`` (the slot's ``cuda:N``, or ``cpu``) where the line is missing."""
    found = re.findall(r"^GPU available: .*, used: (True|False)\s*$", log, re.MULTILINE)
    if not found:
        return pinned
    if found[-1] == "False":
        return "cpu"
    return pinned if pinned.startswith("cuda") else "cuda"


class StaleRunError(UserError):
    """A run folder that holds a run of other settings than the grid's (the grid was edited
    after it ran): reusing its result or resuming its fit would report the new settings over
    what the old ones gave."""


def run_spec(grid: Grid, run: RunSpec) -> dict[str, Any]:
    """What a run computes, as its folder's ``spec.json`` keeps it (JSON values)."""
    spec = {
        "label": run.label,
        "seed": run.seed,
        "base": grid.run_base(run),
        "head": run.head.fragment,
        "overrides": grid.run_overrides(run),
        "finetune": grid.finetune,
        "rank": grid.rank,
        "configs": config_digests(grid, run),
    }
    return json.loads(json.dumps(spec, default=str))


def _differences(stored: dict[str, Any], wanted: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every setting that differs (nested options by their path)."""
    unset = object()

    def show(value: Any) -> str:
        return "unset" if value is unset else json.dumps(value)

    lines = []
    for key in dict.fromkeys([*stored, *wanted]):
        old, new = stored.get(key, unset), wanted.get(key, unset)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            lines += _differences(old, new, f"{prefix}{key}.")
        else:
            lines.append(f"{prefix}{key}: {show(old)} -> {show(new)}")
    return lines


def stale_settings(grid: Grid, run: RunSpec, run_dir: Path) -> list[str] | None:
    """``key: old -> new`` for each setting in which the run folder's run (its ``spec.json``;
    for a folder from before spec.json, the options its ``result.json`` recorded) differs from
    the grid's run; None where it does not."""
    wanted = run_spec(grid, run)
    path = run_dir / SPEC
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except ValueError:
            stored = None  # edited by hand? nothing to hold against: the run rewrites it
        if isinstance(stored, dict) and "configs" not in stored:
            wanted.pop("configs")  # a folder of before the digests: its files unknown
        if stored is None or stored == wanted:
            return None
    else:
        result = load_result(run_dir, echo=lambda line: None)
        if result is None or "overrides" not in result:
            return None
        stored, wanted = {"overrides": result["overrides"]}, {"overrides": wanted["overrides"]}
        if stored == wanted:
            return None
    return _differences(stored, wanted)


def check_run_folder(grid: Grid, run: RunSpec, run_dir: Path) -> None:
    """Refuse a run folder that holds a run of other settings (:func:`stale_settings`)."""
    changed = stale_settings(grid, run, run_dir)
    if changed is not None:
        raise StaleRunError(
            f"run folder {run_dir} holds a run of other settings than the grid's now "
            f"({'; '.join(changed)}): give a new --out, or delete that folder to run it again"
        )


_STAGE_LOGS = ("fit", "finetune", "test", "rank")


def keep_failed_logs(run_dir: Path) -> list[str]:
    """Rename a failed attempt's stage logs ``<stage>.log`` to ``<stage>.failed-<n>.log``
    (``n``: the attempt, 1 first), before a rerun writes its own; the new names."""
    taken = [re.fullmatch(r"\w+\.failed-(\d+)\.log", p.name) for p in run_dir.glob("*.log")]
    n = 1 + max((int(m[1]) for m in taken if m), default=0)
    kept = []
    for stage in _STAGE_LOGS:
        if (run_dir / f"{stage}.log").is_file():
            os.replace(run_dir / f"{stage}.log", run_dir / f"{stage}.failed-{n}.log")
            kept.append(f"{stage}.failed-{n}.log")
    return kept


def replace_failed_folder(run_dir: Path) -> list[str]:
    """Empty the folder of a failed run of other settings for a fresh start (its checkpoints,
    logs of metrics and spec would be resumed or read as the new run's), keeping its stage
    logs (:func:`keep_failed_logs`); the kept logs' names. Only for a ``failed`` result: a
    finished run's folder is never emptied."""
    result = load_result(run_dir, echo=lambda line: None)
    if result is None or result["status"] != "failed":
        raise ValueError(f"{run_dir} holds no failed run")
    kept = keep_failed_logs(run_dir)
    for path in run_dir.iterdir():
        if re.fullmatch(r"\w+\.failed-\d+\.log", path.name):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return kept


def config_digests(grid: Grid, run: RunSpec) -> dict[str, str]:
    """Every config file a run reads (its base configs, head fragment, fine-tuning configs,
    option values naming a file, and the files these name in turn, relative to the naming
    file as jsonargparse reads them), each with a digest of its parsed content: a run folder's
    spec names the files alone, so an edited ``configs/lm/ptb.yaml`` (another learning rate)
    went unnoticed and its old results were reported beside the new ones. Comments and
    layout do not count."""
    digests: dict[str, str] = {}

    def visit(path: Path) -> None:
        path = path.resolve()
        key = os.path.relpath(path, REPO)
        if key in digests or not path.is_file():
            return
        try:
            content = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError):
            content = path.read_text(errors="replace")
        text = json.dumps(content, sort_keys=True, default=str)
        digests[key] = hashlib.sha256(text.encode()).hexdigest()[:16]
        for value in _strings(content):
            if value.endswith((".yaml", ".yml")):
                visit(path.parent / value)

    named = [*grid.run_base(run), *(grid.finetune or {}).get("configs", [])]
    named += [run.head.fragment] if run.head.fragment else []
    named += [v for v in _strings(grid.run_overrides(run)) if v.endswith((".yaml", ".yml"))]
    for name in named:
        visit(REPO / name)
    return dict(sorted(digests.items()))


def _strings(value: Any) -> list[str]:
    """The strings in a YAML value, nested ones too."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


class StageFailed(Exception):
    def __init__(self, stage: str, status: str, message: str) -> None:
        super().__init__(message)
        self.stage, self.status = stage, status


class StageInterrupted(Exception):
    """A stage stopped by Ctrl+C or SIGTERM (``signum``): no result, the run stays to do."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class StudyInterrupted(Exception):
    """The study stopped early (Ctrl+C, SIGTERM, or a run stopped by a signal); running it
    again continues. ``signum``: the signal that stopped it."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = signum


class _StageProcesses:
    """The stage subprocesses under way. A SIGTERM to the runner alone (a container's stop,
    ``kill``) is passed on to them, so that each saves its checkpoint, as when a cluster's
    scheduler signals every process of the job."""

    def __init__(self) -> None:
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        # the study folder's lock (StudyLock): held by the stages too, so that a runner killed
        # with SIGKILL leaves its folder locked while the fits it started still write there
        self.pass_fds: tuple[int, ...] = ()

    def call(self, args: list[str], **options: Any) -> int:
        with self._lock:  # started and listed at once: a SIGTERM between would miss it
            process = subprocess.Popen(args, pass_fds=self.pass_fds, **options)
            self._live.add(process)
        try:
            return process.wait()
        finally:
            with self._lock:
                self._live.discard(process)

    def send(self, signum: int) -> None:
        with self._lock:
            for process in self._live:
                process.send_signal(signum)


_STAGES = _StageProcesses()

LOCK = ".lock"


class StudyBusyError(UserError):
    """The study folder is in use: another runner (or the stages one left running) would
    fit the same runs in the same folders at once, each resuming and overwriting the other's
    checkpoints and results."""


class StudyLock:
    """An exclusive ``flock`` on ``<study folder>/.lock`` for as long as the runner or any
    stage it started lives (the stages inherit it); the file names the holder."""

    def __init__(self, study_dir: Path) -> None:
        self.path = study_dir / LOCK
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self.path.read_text().strip() or "unknown"
            os.close(self.fd)
            raise StudyBusyError(
                f"study folder {study_dir} is in use by another runner or the runs it "
                f"started ({holder}): wait for it to stop, or give another --out"
            ) from None
        os.ftruncate(self.fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(self.fd, f"pid {os.getpid()} on {platform.node()}, since {started}\n".encode())

    def release(self) -> None:
        os.close(self.fd)  # (stages still running keep it locked until they exit)


def study_busy(study_dir: Path) -> bool:
    """Whether a runner (or a stage it started) holds the study folder's lock now."""
    path = study_dir / LOCK
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


class RunExecutor:
    """Runs the stages of one run in subprocesses, in the repository root."""

    def __init__(self, grid: Grid, run: RunSpec, run_dir: Path, env: dict[str, str]) -> None:
        self.grid, self.run, self.run_dir, self.env = grid, run, run_dir, env
        self.commands: dict[str, list[str]] = {}
        self.wall_s: dict[str, float] = {}
        self.device = env.get("STUDY_DEVICE", "cpu")  # the slot's; what the fit said wins

    def _call(self, stage: str, args: list[str]) -> None:
        self.commands[stage] = args
        start = time.perf_counter()
        header = " ".join(args) + "\n\n"
        with (self.run_dir / f"{stage}.log").open("w") as log:
            log.write(header)
            log.flush()
            code = _STAGES.call(args, cwd=REPO, env=self.env, stdout=log, stderr=log)
        self.wall_s[stage] = round(time.perf_counter() - start, 2)
        if code in _INTERRUPTED:
            signum = code - 128 if code > 0 else -code
            raise StageInterrupted(f"{stage} stopped by a signal (exit status {code})", signum)
        if code != 0:
            # the stage's own last line (not the command line above it, when it printed none)
            output = (self.run_dir / f"{stage}.log").read_text().removeprefix(header)
            tail = output.strip().splitlines()[-1:]
            message = tail[0] if tail else f"exit status {code}"
            if code < 0:  # killed: its last line is whatever it printed before
                name = signal.Signals(-code).name if -code in signal.valid_signals() else -code
                message = f"killed by {name}" + (" (out of memory?)" if code == -9 else "")
            status = "diverged" if _DIVERGED in message else "failed"
            raise StageFailed(stage, status, f"{stage} exited with {code}: {message[-500:]}")

    def fit(self, version: str, configs: list[str], extra: list[str]) -> dict[str, Any]:
        """One fit (resumed from its last checkpoint when one is there), then what it left."""
        run_dir = self.run_dir
        checkpoints = run_dir / "tensorboard" / version / "checkpoints"
        # always given: a config saved by a resumed fit holds that fit's ckpt_path, and the
        # fine-tuning stage (started from that config) would restore its epoch and optimizer
        previous = last_checkpoint(checkpoints)
        resume = ["--ckpt_path", "null" if previous is None else str(previous)]
        attempt = len(_csv_versions(run_dir, version))
        csv_version = version if attempt == 0 else f"{version}.{attempt}"
        loggers = _write_config(
            run_dir / f"{version}_loggers.yaml", _loggers(run_dir, version, csv_version)
        )
        args = [sys.executable, "cli.py", "fit"]
        args += [a for config in configs for a in ("--config", config)]
        args += [*extra, "--config", loggers, "--seed_everything", str(self.run.seed), *resume]
        args += ["--trainer.enable_progress_bar", "false"]
        self._call(version, args)
        self.device = device_used((run_dir / f"{version}.log").read_text(), self.device)
        last = last_checkpoint(checkpoints)
        if last is None:
            raise StageFailed(version, "failed", f"{version} wrote no {checkpoints / 'last.ckpt'}")
        summary = checkpoint_summary(last)
        if "best_checkpoint" not in summary:
            summary["best_checkpoint"] = str(last)  # no monitored checkpoint: the last one
        rows = [
            row for path in _csv_versions(run_dir, version) for row in read_metrics(path)
        ]  # the first attempt's rows, then a resumed one's
        curve = validation_curve(rows, self.grid.curve_metric)
        summary["curve"] = curve
        summary["train_s"] = curve[-1]["train_s"] if curve else None
        summary["max_regression"] = max_regression(curve, self.grid.curve_metric, self.grid.mode)
        return summary

    def test(self, fit_version: str, checkpoint: str) -> dict[str, float]:
        run_dir = self.run_dir
        loggers = _write_config(
            run_dir / "test_loggers.yaml", _loggers(run_dir, "test", "test", tensorboard=False)
        )
        config = str(_saved_config(run_dir, fit_version))
        args = [
            sys.executable,
            "cli.py",
            "test",
            "--config",
            config,
            "--config",
            loggers,
            "--ckpt_path",
            checkpoint,
            "--trainer.enable_progress_bar",
            "false",
        ]
        self._call("test", args)
        values = last_values(read_metrics(run_dir / "csv" / "test" / "metrics.csv"), "test/")
        if self.grid.metric not in values:
            raise StageFailed("test", "failed", f"the test logged no {self.grid.metric}")
        return values

    def rank(self, fit_version: str, checkpoint: str) -> dict[str, Any]:
        spec = self.grid.rank
        out = self.run_dir / "rank"
        args = [
            sys.executable,
            "-m",
            "app.rank",
            "--config",
            str(_saved_config(self.run_dir, fit_version)),
            "--ckpt",
            checkpoint,
            "--contexts",
            str(spec["contexts"]),
            "--split",
            spec["split"],
            "--out",
            str(out),
            "--label",
            self.run.label,
        ]
        self._call("rank", args)
        report = json.loads((out / "rank.json").read_text())
        keep = (
            "rank",
            "contexts",
            "hidden_size",
            "vocab_size",
            "tolerance",
            "split",
            "softmax_bound",
            "relative_ranks",
        )
        return {**{k: report[k] for k in keep}, "json": str(out / "rank.json")}


def execute_run(grid: Grid, run: RunSpec, run_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """Fit (and fine-tune), test the best checkpoint, rank it: the run's ``result.json`` data."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # before any stage: a fit cut short and resumed later is checked against it too
    write_atomic(run_dir / SPEC, json.dumps(run_spec(grid, run), indent=1))
    executor = RunExecutor(grid, run, run_dir, env)
    overrides = grid.run_overrides(run)
    result: dict[str, Any] = {
        "schema": "study-run/1",
        "study": grid.name,
        "label": run.label,
        "head": run.head.label,
        "variant": run.variant,
        "seed": run.seed,
        "overrides": overrides,
        "code": code_version(),  # as the stages import it (a resumed study may differ)
    }
    try:
        stage = executor.fit("fit", grid.run_base(run), fit_extra_args(grid, run))
        result["fit"] = stage
        final_version, best = "fit", stage["best_checkpoint"]
        if grid.finetune is not None:
            saved = str(_saved_config(run_dir, "fit"))
            extra = override_args(grid.finetune["overrides"])
            extra += ["--model.init_args.pretrained_checkpoint", best]
            stage = executor.fit("finetune", [saved, *grid.finetune["configs"]], extra)
            result["finetune"] = stage
            final_version, best = "finetune", stage["best_checkpoint"]
        result["test"] = executor.test(final_version, best)
        result["tested_checkpoint"] = best
        if not math.isfinite(value := result["test"][grid.metric]):
            # a loss too large for exp (1e31 nats: inf perplexity) raises no non-finite loss
            # in training, yet the run diverged: counted as one, not as ok with no number
            raise StageFailed("test", "diverged", f"test: {grid.metric} is {value}")
        if grid.rank is not None:
            result["rank"] = executor.rank(final_version, best)
        result["status"] = "ok"
    except StageFailed as failure:
        result.update(status=failure.status, error=str(failure), failed_stage=failure.stage)
        # the whole story (its last line, the error above, may be anything: a kill leaves a
        # progress line); local, so kept out of the study JSON
        result["log"] = str(run_dir / f"{failure.stage}.log")
    stages = [result[s] for s in ("fit", "finetune") if s in result]
    result["train_s"] = sum(s["train_s"] or 0.0 for s in stages) if stages else None
    result["max_regression"] = max((s["max_regression"] for s in stages), default=None)
    if result["max_regression"] is not None:
        result["unstable"] = result["max_regression"] > grid.instability_threshold
    result["commands"] = executor.commands
    result["wall_s"] = executor.wall_s
    result["device"] = executor.device
    result = finite_json(result)
    write_atomic(run_dir / RESULT, json.dumps(result, indent=1, allow_nan=False))
    return result


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (a diverged loss, an endless regression) as None,
    so that the JSON stays standard."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def _failed(run_dir: Path) -> bool:
    result = load_result(run_dir, echo=lambda line: None)
    return result is not None and result["status"] == "failed"


def load_result(run_dir: Path, echo: Callable[[str], None] = print) -> dict[str, Any] | None:
    """A run's ``result.json``, or None where there is none or it cannot be read (one written
    by a runner of before the atomic writes, killed while writing: said, and run again)."""
    path = run_dir / RESULT
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        echo(f"warning: {path} is unreadable ({error}): the run is done again")
        return None
    if not isinstance(result, dict) or "status" not in result:
        echo(f"warning: {path} holds no run's result: the run is done again")
        return None
    return result


def progress_line(index: int, total: int, result: dict[str, Any], grid: Grid, note: str) -> str:
    head = f"[{index}/{total}] {result['label']} seed {result['seed']}:"
    if result["status"] != "ok":
        log = f", log {result['log']}" if result.get("log") else ""
        return f"{head} {result['status'].upper()} ({result.get('error', '')}{log}) {note}".rstrip()
    curve = result.get("finetune", result.get("fit", {})).get("curve", [])
    curve = [p for p in curve if p.get(grid.curve_metric) is not None]  # (non-finite: None)
    pick = min if grid.mode == "min" else max
    best = pick(curve, key=lambda p: p[grid.curve_metric]) if curve else None
    value = result["test"].get(grid.metric)  # None: non-finite, in an older runner's "ok"
    text = f"{head} {grid.metric} {'non-finite' if value is None else f'{value:.2f}'}"
    if best is not None:
        text += f", best {grid.curve_metric} {best[grid.curve_metric]:.2f} @ epoch {best['epoch']}"
    if result.get("train_s"):
        text += f", train {result['train_s']:.0f} s"
    if result.get("unstable"):
        worse = result["max_regression"]
        worse = "non-finite" if worse is None else f"{worse:.0%} worse than its best"
        text += f", UNSTABLE (validation {worse})"
    if "rank" in result:
        text += f", rank {result['rank']['rank']}"
    return f"{text} {note}".rstrip()


def _device_slots(parallel: int, devices: Sequence[str] | None) -> list[str | None]:
    """One entry per concurrent run: a CUDA device id to pin it to, or None (CPU / let it
    choose). Runs share devices round robin when there are more runs than devices."""
    if devices is None:
        import torch

        devices = [str(i) for i in range(torch.cuda.device_count())]
    if not devices:
        return [None] * parallel
    return [devices[i % len(devices)] for i in range(parallel)]


def _run_env(slot: str | None, threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(REPO))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if slot is not None:
        env["CUDA_VISIBLE_DEVICES"] = slot
        env["STUDY_DEVICE"] = f"cuda:{slot}"
    return env


def environment() -> dict[str, Any]:
    """Where the study ran: what its numbers must be labelled with."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    if (load := load_average()) is not None:
        info["load_average"] = load
    return {**info, **code_version()}


def code_version() -> dict[str, Any]:
    """The commit the repository is at now and whether tracked files differ from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        # edits to tracked files: the commit alone would name code that did not run
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=REPO, capture_output=True, text=True, check=True,
            ).stdout.strip()
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": None}
    return {"git_commit": commit, "git_dirty": dirty}


def _code_of_runs(env: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """``env`` with the code the runs ran: a study resumed after a ``git pull`` (or run
    across one: every stage imports the code afresh) holds runs of several commits, which the
    commit of the last runner's start alone would hide. Runs of before the per-run record
    count as of unknown code."""
    commits: dict[str, int] = {}
    for result in results:
        commit = result.get("code", {}).get("git_commit") or "unknown"
        commits[commit] = commits.get(commit, 0) + 1
    env = dict(env)
    if commits and set(commits) != {env.get("git_commit") or "unknown"}:
        env["run_commits"] = commits  # commit -> runs
    if any(result.get("code", {}).get("git_dirty") for result in results):
        env["git_dirty"] = True
    return env


def study_document(grid: Grid, results: list[dict[str, Any]], env: dict[str, Any]) -> dict:
    """The study's JSON: the grid, where it ran and every run's result (without commands)."""
    return {
        "schema": "study/1",
        "name": grid.name,
        "description": grid.description,
        "metric": grid.metric,
        "mode": grid.mode,
        "curve_metric": grid.curve_metric,
        "baseline": grid.baseline,
        "budget": grid.budget,
        "overrides": grid.overrides,
        "reference": grid.reference,
        "instability_threshold": grid.instability_threshold,
        "grid": grid.raw,
        "environment": _code_of_runs(env, results),
        # studies written before this flag timed epochs with validation inside (issue 33)
        "epoch_time_excludes_validation": True,
        "runs": [_compact(r) for r in results],
    }


def _compact(result: dict[str, Any]) -> dict[str, Any]:
    """A run as the study JSON keeps it: no command lines or local paths."""
    drop = {"commands", "tested_checkpoint", "schema", "study", "log"}
    compact = {k: v for k, v in result.items() if k not in drop}
    for stage in ("fit", "finetune"):
        if stage in compact:
            compact[stage] = {k: v for k, v in compact[stage].items() if k != "best_checkpoint"}
    if "rank" in compact:
        compact["rank"] = {k: v for k, v in compact["rank"].items() if k != "json"}
    return compact


def _wait_all(futures: list[Future]) -> None:
    """Wait for ``futures`` (raising the first error), waking every second: a signal that the
    kernel gave a worker thread reaches Python's handler in the main thread only when that
    thread runs."""
    left = set(futures)
    while left:
        done, left = wait(left, timeout=1.0)
        for future in done:
            future.result()


def run_study(
    grid: Grid,
    out: Path,
    parallel: int = 1,
    devices: Sequence[str] | None = None,
    threads: int | None = None,
    rerun_failed: bool = False,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every unfinished run of ``grid`` under ``out/<name>/``; returns the study document
    (also written to ``out/<name>/study.json`` after every run)."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    study_dir = out / grid.name
    study_dir.mkdir(parents=True, exist_ok=True)
    lock = StudyLock(study_dir)
    _STAGES.pass_fds = (lock.fd,)
    try:
        return _run_locked(grid, study_dir, parallel, devices, threads, rerun_failed, echo)
    finally:
        _STAGES.pass_fds = ()
        lock.release()


def _run_locked(
    grid: Grid,
    study_dir: Path,
    parallel: int,
    devices: Sequence[str] | None,
    threads: int | None,
    rerun_failed: bool,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    runs = grid.runs()
    replaced: dict[int, list[str]] = {}  # failed runs of other settings, to start afresh
    for index, run in enumerate(runs, 1):  # all checked before any run starts or folder changes
        run_dir = study_dir / run.relative_dir
        changed = stale_settings(grid, run, run_dir) if rerun_failed else None
        if changed is not None and _failed(run_dir):
            replaced[index] = changed  # the user fixed the failed run's settings
        else:
            check_run_folder(grid, run, run_dir)
    total = len(runs)
    results: dict[int, dict[str, Any]] = {}
    pending = []
    for index, run in enumerate(runs, 1):
        run_dir = study_dir / run.relative_dir
        if index in replaced:
            kept = replace_failed_folder(run_dir)
            logs = f", its logs kept as {', '.join(kept)}" if kept else ""
            changed = "; ".join(replaced[index])
            echo(f"[{index}/{total}] {run.label} seed {run.seed}: the failed run's settings "
                 f"changed ({changed}): its folder starts afresh{logs}")  # fmt: skip
        previous = load_result(run_dir, echo)
        done = previous is not None and previous["status"] in FINISHED
        if previous is not None and (done or not rerun_failed):
            results[index] = previous
            echo(progress_line(index, total, previous, grid, "(finished before: skipped)"))
        else:
            pending.append((index, run, previous is not None))
    env_info = environment()
    slots: queue.Queue[str | None] = queue.Queue()
    for slot in _device_slots(parallel, devices):
        slots.put(slot)
    lock = threading.Lock()

    def write_document() -> dict[str, Any]:
        ordered = [results[i] for i in sorted(results)]
        document = study_document(grid, ordered, env_info)
        write_atomic(study_dir / "study.json", json.dumps(document, indent=1))
        return document

    stop = threading.Event()  # Ctrl+C, or a run stopped by a signal: start no other run
    stopped_by = [signal.SIGINT]  # the signal that stopped the study

    def work(index: int, run: RunSpec, failed_before: bool) -> None:
        slot = slots.get()
        try:
            if stop.is_set():
                return
            start = time.perf_counter()
            try:
                env = _run_env(slot, threads)
                if failed_before:  # the failed attempt's logs stay beside the rerun's
                    keep_failed_logs(study_dir / run.relative_dir)
                result = execute_run(grid, run, study_dir / run.relative_dir, env)
            except StageInterrupted as interrupted:
                if not stop.is_set():
                    stopped_by[0] = interrupted.signum
                stop.set()
                with lock:
                    echo(f"[{index}/{total}] {run.label} seed {run.seed}: INTERRUPTED "
                         f"({interrupted})")  # fmt: skip
                return
            note = f"({time.perf_counter() - start:.0f} s{f', cuda:{slot}' if slot else ''})"
            with lock:
                results[index] = result
                echo(progress_line(index, total, result, grid, note))
                write_document()
        finally:
            slots.put(slot)

    def on_sigterm(signum: int, frame: Any) -> None:
        stopped_by[0] = signum
        _STAGES.send(signum)  # (the runs under way may have had it already: no harm)
        raise KeyboardInterrupt  # then the same stop as Ctrl+C

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main_thread else None
    try:
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            futures: list[Future] = []
            try:  # (a Ctrl+C may come while the runs are still being queued)
                for index, run, failed_before in pending:
                    futures.append(pool.submit(work, index, run, failed_before))
                _wait_all(futures)
            except KeyboardInterrupt:
                # the terminal's Ctrl+C reached the runs under way too: they save and stop
                stop.set()
                echo(
                    f"{signal.Signals(stopped_by[0]).name}: starting no other run; waiting "
                    "for the runs under way to stop"
                )
                _wait_all(futures)
    finally:
        if previous is not None:  # (None too where a handler set outside Python was there)
            signal.signal(signal.SIGTERM, previous)
    document = write_document()
    if stop.is_set():
        left = total - len(results)
        raise StudyInterrupted(
            f"study {grid.name!r} stopped with {left} of {total} runs to do: run the same "
            "command again to continue (finished runs are skipped, a cut-short fit resumes "
            "from its last.ckpt)",
            stopped_by[0],
        )
    return document


def study_status(grid: Grid, out: Path) -> list[str]:
    """What a study folder holds, as lines: each run's state (finished with its metric,
    failed with its log, started, to do, or of other settings), then the counts, whether a
    runner holds the folder, and the time left at the finished runs' mean time."""
    study_dir = out / grid.name
    busy = study_busy(study_dir)
    counts: dict[str, int] = {}
    seconds: list[float] = []
    lines = []
    runs = grid.runs()
    for index, run in enumerate(runs, 1):
        run_dir = study_dir / run.relative_dir
        head = f"[{index}/{len(runs)}] {run.label} seed {run.seed}:"
        try:
            check_run_folder(grid, run, run_dir)
        except StaleRunError:
            state, text = "stale", "STALE (a run of other settings: `run` refuses the folder)"
            if _failed(run_dir):
                text = "STALE (a failed run of other settings: `run --rerun-failed` replaces it)"
        else:
            result = load_result(run_dir, echo=lambda line: None)
            if result is not None:
                state = result["status"]
                text = progress_line(index, len(runs), result, grid, "")[len(head) + 1 :]
                if state in FINISHED:
                    seconds.append(sum((result.get("wall_s") or {}).values()))
            elif (run_dir / SPEC).is_file():
                state = "started"
                text = "running" if busy else "cut short (`run` resumes it)"
            else:
                state, text = "to do", "to do"
        counts[state] = counts.get(state, 0) + 1
        lines.append(f"{head} {text}")
    order = ("ok", "diverged", "failed", "started", "to do", "stale")
    summary = ", ".join(f"{counts[s]} {s}" for s in order if counts.get(s))
    holder = (study_dir / LOCK).read_text().strip() if busy else ""
    lines.append(f"{summary}; {f'a runner is at work ({holder})' if busy else 'no runner at work'}")
    left = counts.get("started", 0) + counts.get("to do", 0)
    if left and seconds:
        mean = sum(seconds) / len(seconds)
        lines.append(
            f"left: {left} runs, ~{left * mean / 60:.0f} min one at a time "
            f"(the {len(seconds)} finished runs' mean, {mean / 60:.1f} min)"
        )
    return lines
