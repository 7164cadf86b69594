"""``data.held_out`` on a parallel corpus: the training files' lines are counted once on the
first launch (the sides' alignment check, kept in the line-count cache, gives the cut its
counts) and not at all on the next; the cut is the one of counting them."""

from pathlib import Path

import datamodules.text_source as text_source
import datamodules.translation as translation
from datamodules import TranslationDataModule


def test_held_out_training_lines_are_counted_once(tmp_path, monkeypatch):
    counted: list[str] = []
    count_lines = text_source.count_lines

    def counting(path: Path) -> int:
        counted.append(Path(path).name)
        return count_lines(path)

    monkeypatch.setattr(text_source, "count_lines", counting)
    monkeypatch.setattr(translation, "count_lines", counting)
    for lang, word in (("de", "s"), ("en", "t")):
        lines = "".join(f"{word}{i % 7} {word}{i % 5}\n" for i in range(200))
        (tmp_path / f"train.{lang}").write_text(lines)

    def launch() -> TranslationDataModule:
        data = TranslationDataModule(path=str(tmp_path), held_out=0.05,
                                     cache_dir=str(tmp_path / "c"))  # fmt: skip
        data.prepare_data()
        data.setup("fit")
        return data

    data = launch()
    assert sorted(counted) == ["train.de", "train.en"]  # was each twice
    # 200 lines: 10 valid, 10 test, 180 training pairs
    assert [data.source.num_lines(f"{s}.source") for s in ("train", "valid", "test")] == [
        180, 10, 10,
    ]  # fmt: skip
    assert data.source.describe("valid.target").endswith("train.en (lines 181-190)")
    counted.clear()
    launch()
    assert counted == []
