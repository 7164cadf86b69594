"""``python -m app.study``: what its commands print and the exit status they give."""

import json
import re
from pathlib import Path

import yaml

from app.study import __main__ as study_main
from app.study import runner
from app.study.__main__ import main


def test_a_study_stopped_by_a_signal_says_how_to_continue_and_exits_with_it(
    tmp_path, monkeypatch, capsys
):
    grid = tmp_path / "stopped.yaml"
    heads = {"softmax": "configs/heads/softmax.yaml"}
    grid.write_text(yaml.safe_dump(
        {"name": "stopped", "base": "configs/lm/ptb.yaml", "seeds": [1], "heads": heads}
    ))  # fmt: skip
    monkeypatch.setattr(runner._STAGES, "call", lambda args, **kwargs: 143)  # SIGTERM
    assert main(["run", str(grid), "--out", str(tmp_path / "runs")]) == 143
    out, err = capsys.readouterr()
    assert "[1/1] softmax seed 1: INTERRUPTED (fit stopped by a signal (exit status 143))" in out
    assert err.strip() == (
        "interrupted: study 'stopped' stopped with 1 of 1 runs to do: run the same command "
        "again to continue (finished runs are skipped, a cut-short fit resumes from its "
        "last.ckpt)"
    )


def _study(name: str) -> dict:
    points = [{"epoch": 0, "step": 1, "val/ppl": 120.0, "train_s": 10.0}]
    runs = [{"label": "softmax", "seed": seed, "status": "ok", "test": {"test/ppl": 100.0 + seed},
             "fit": {"curve": points}, "train_s": 10.0} for seed in (1, 2)]  # fmt: skip
    return {"schema": "study/1", "name": name, "metric": "test/ppl", "mode": "min",
            "curve_metric": "val/ppl", "baseline": "softmax", "runs": runs}  # fmt: skip


def _image_links(markdown: Path) -> list[Path]:
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", markdown.read_text())
    assert len(links) == 2
    return [markdown.parent / link for link in links]


def test_run_with_images_links_them_from_the_report(tmp_path, monkeypatch):
    grid = tmp_path / "imgs.yaml"
    heads = {"softmax": "configs/heads/softmax.yaml"}
    grid.write_text(yaml.safe_dump(
        {"name": "imgs", "base": "configs/lm/ptb.yaml", "seeds": [1, 2], "heads": heads}
    ))  # fmt: skip

    def run_study(grid, out, *args):  # the study's document, as the runner leaves it
        (out / grid.name).mkdir(parents=True)
        (out / grid.name / "study.json").write_text(json.dumps(_study(grid.name)))
        return _study(grid.name)

    monkeypatch.setattr(study_main, "run_study", run_study)
    images = tmp_path / "docs" / "images"
    assert main(["run", str(grid), "--out", str(tmp_path / "runs"), "--images", str(images)]) == 0
    links = _image_links(tmp_path / "runs" / "imgs" / "report.md")
    assert all(link.is_file() for link in links), links
    assert {link.resolve().parent for link in links} == {images.resolve()}


def test_render_to_a_markdown_file_links_the_images_from_its_folder(tmp_path, capsys):
    study_json = tmp_path / "study.json"
    study_json.write_text(json.dumps(_study("rendered")))
    markdown = tmp_path / "docs" / "report.md"
    markdown.parent.mkdir()
    assert main(["render", str(study_json), "--markdown", str(markdown)]) == 0
    assert all(link.is_file() for link in _image_links(markdown))
