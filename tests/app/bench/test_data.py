import json
from collections import Counter

import pytest

from app.bench.data import write_synthetic_corpus
from app.bench.run import main


@pytest.mark.slow  # prepares a synthetic corpus twice: ~20 s
def test_data_mode_times_a_first_preparation_and_a_cached_setup(tmp_path):
    argv = ["--mode", "data", "--tokens", "20000", "--types", "500", "--vocab", "word",
            "--repeats", "1", "--corpus-dir", str(tmp_path / "corpus"), "--out", str(tmp_path),
            "--name", "smoke"]  # fmt: skip
    main(argv)
    report = json.loads((tmp_path / "smoke.json").read_text())
    (entry,) = report["results"]
    prepare, (cached,) = entry["prepare"], entry["cached"]
    # an empty cache: the vocabulary and three token files built; then all read back
    assert (prepare["cache_misses"], prepare["cache_hits"]) == (4, 0)
    assert (cached["cache_misses"], cached["cache_hits"]) == (0, 3)  # vocabulary, train, valid
    assert prepare["tokens"] == cached["tokens"] == {"train": 21_000, "valid": 53}  # + <eos>
    for phase in (prepare, cached):
        times = [phase[key] for key in ("vocab_s", "ready_s", "first_batch_s", "process_s")]
        assert 0 < times[0] and times == sorted(times)
        assert 0.1 < phase["peak_rss_gib"] < 4
    assert report["corpus"]["tokens"] == 20_000 and report["machine"]["cpus"] > 0


def test_synthetic_corpus_is_deterministic_zipf_text(tmp_path):
    info = write_synthetic_corpus(tmp_path / "a", tokens=100_000, types=2_000, line_words=20)
    write_synthetic_corpus(tmp_path / "b", tokens=100_000, types=2_000, line_words=20)
    for name in info["bytes"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    lines = (tmp_path / "a" / "wiki.train.tokens").read_text().splitlines()
    assert len(lines) == 5_000 and {len(line.split()) for line in lines} == {20}
    counts = sorted(Counter(w for line in lines for w in line.split()).values(), reverse=True)
    assert counts[0] / counts[1] == pytest.approx(2**1.1, rel=0.1)  # Zipf 1.1
    assert 3 < info["bytes"]["wiki.train.tokens"] / 100_000 < 6  # words and a space
