"""What the manuals name exists: every config file, Python name and result file that README.md,
docs/design.md and the configs' own comments cite resolves in this checkout, and every
section of docs/design.md that README.md cites by its title is there."""

import importlib
import itertools
import re

import pytest

from tests.conftest import REPO

DOCS = ("README.md", "docs/design.md")
CONFIG_COMMENTS = sorted((REPO / "configs").rglob("*.yaml"))
PACKAGES = ("heads", "datamodules", "lightning_modules", "app")


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def expand_braces(path: str) -> list[str]:
    """``lm/awd_ptb_{softmax,mos}.yaml`` -> both names (the README's shorthand)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def config_paths(text: str) -> set[str]:
    """Config files a text names: ``configs/...yaml`` anywhere, and the README tables'
    ``lm/...``, ``mt/...``, ``ds/...``, ``presets/...`` names (relative to ``configs/``)."""
    found = set(re.findall(r"configs/[\w/{},*.-]+?\.yaml", text))
    for token in backticked(text):
        if re.fullmatch(r"(lm|mt|ds|presets|heads|data|studies)/[\w{},*.-]+\.yaml", token):
            found.add(f"configs/{token}")
    return found


def missing_configs(text: str) -> list[str]:
    missing = []
    for named in sorted(config_paths(text)):
        for path in expand_braces(named):
            if not list(REPO.glob(path)):  # a glob (ds/*.yaml) must match a file
                missing.append(path)
    return missing


def resolves(name: str) -> bool:
    """``heads.base.zipf_log_prior``: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def unresolved_names(text: str) -> list[str]:
    names = {t for t in backticked(text) if re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+", t)}
    ours = sorted(n for n in names if n.split(".")[0] in PACKAGES)
    return [n for n in ours if not resolves(n)]


def missing_results(text: str) -> list[str]:
    """Result files cited by name (``bench_gpu_lm_ptb_step.json``, ``bench_cpu_x_*``)."""
    results = REPO / "docs" / "results"
    prefixes = "bench|profile|study|ds_inference|data|rank|sweep|full_bench|kernels"
    missing = []
    for token in backticked(text):
        if re.fullmatch(rf"({prefixes})_[\w*]+(\.json)?", token):
            pattern = token if token.endswith(".json") else f"{token}.json"
            if not list(results.glob(pattern)):
                missing.append(token)
    return missing


def cited_design_sections(text: str) -> set[str]:
    """Titles cited as ``(`docs/design.md`, "Title")`` or ``docs/design.md ("Title")``."""
    return set(re.findall(r'`docs/design\.md`,? \(?"([^"]+)"', text))


def design_titles() -> set[str]:
    design = (REPO / "docs" / "design.md").read_text()
    headings = re.findall(r"^#+ (.+)$", design, flags=re.MULTILINE)
    bold = re.findall(r"\*\*([^*]+?)\.?\*\*", design)  # "**State.**" bullets
    return {t.strip().strip("`") for t in [*headings, *bold]}


@pytest.mark.parametrize("doc", DOCS)
def test_named_config_files_exist(doc):
    assert missing_configs((REPO / doc).read_text()) == []


@pytest.mark.parametrize("config", CONFIG_COMMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_config_comments_name_existing_configs(config):
    comments = "\n".join(line.partition("#")[2] for line in config.read_text().splitlines())
    assert missing_configs(comments) == []


@pytest.mark.parametrize("doc", DOCS)
def test_named_python_names_resolve(doc):
    assert unresolved_names((REPO / doc).read_text()) == []


@pytest.mark.parametrize("doc", DOCS)
def test_named_result_files_exist(doc):
    assert missing_results((REPO / doc).read_text()) == []


def test_readme_cites_design_sections_that_exist():
    cited = cited_design_sections((REPO / "README.md").read_text())
    assert cited  # the pattern still finds the README's citations
    assert cited - design_titles() == set()


def test_the_checks_catch_what_is_missing():
    text = (
        "`heads.NoSuchHead`, `heads.base.zipf_log_prior`, `lm/no_such.yaml`, `lm/ptb.yaml`, "
        "configs/heads/{mos,nope}.yaml, `bench_gpu_nope.json`, `bench_gpu_lm_ptb_step.json`"
    )
    assert unresolved_names(text) == ["heads.NoSuchHead"]
    assert missing_configs(text) == ["configs/heads/nope.yaml", "configs/lm/no_such.yaml"]
    assert missing_results(text) == ["bench_gpu_nope.json"]
    assert cited_design_sections('(`docs/design.md`, "Nope")') == {"Nope"}
    assert "Nope" not in design_titles() and "State" in design_titles()
