"""A study grid: heads x variants x seeds over one base experiment, read from a small YAML file.

A grid file is not a CLI config: it names CLI configs (``base``, head fragments) and the
options that differ between runs. Schema (``GridFile`` below, checked by jsonargparse; paths
relative to the repository root)::

    name: ptb_medium_gpu               # [A-Za-z0-9_.-]+, names the output folder and files
    description: PTB medium LSTM ...   # one line for the report
    base: configs/lm/ptb.yaml  # or a list: later files override earlier ones
    heads:                             # label -> head fragment (--model.head FILE), or
      softmax: configs/heads/softmax.yaml
      mixtape:                         # a mapping with the fragment and head-only options
        head: configs/heads/mixtape.yaml
        overrides: {model.init_args.head.init_args.gate_noise: 0.0}
      mos:                             # or a base of its own (a whole experiment per head)
        base: configs/lm/awd_ptb_mos.yaml
    seeds: [1, 2, 3]
    overrides: {trainer.precision: bf16-mixed}   # --key value for every run
    budget: {max_epochs: 6}            # trainer options (trainer.<key>), shown in the report
    variants: {}                       # optional label -> overrides, crossed with the heads
    metric: test/ppl                   # quality metric of the table; mode min/max inferred
    baseline: softmax                  # the head the others are compared with (first head)
    rank: {contexts: 2000, split: val} # optional: app.rank on every best checkpoint
    finetune: {configs: [...], overrides: {...}}  # optional second fit from the best one
    reference: {source: Mixtape Table 3, values: {softmax: 59.19}}  # optional paper numbers
    instability_threshold: 0.1         # a validation regression above this marks a run
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import ArgumentError, ArgumentParser

from heads.errors import UserError

REPO = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_HIGHER_IS_BETTER = ("bleu", "acc", "top")


class StudyConfigError(UserError, ValueError):
    """A grid file that cannot describe a study (missing key, unknown head, bad seed...)."""


# -- the grid file's schema, checked by jsonargparse (types, unknown and missing keys) ---------
@dataclass
class HeadSpec:
    head: str | None = None  # a head fragment, given as --model.head FILE
    base: str | list[str] | None = None  # this head's own base configs
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class RankSpec:
    contexts: int = 2000
    split: Literal["val", "test"] = "val"


@dataclass
class FinetuneSpec:
    configs: str | list[str] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReferenceSpec:
    source: str
    values: dict[str, float] = field(default_factory=dict)


@dataclass
class GridFile:
    """A grid file as written (the module docstring's schema)."""

    name: str
    heads: dict[str, str | HeadSpec]
    seeds: list[int]
    description: str = ""
    base: str | list[str] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    budget: dict[str, Any] = field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    metric: str = "test/ppl"
    mode: Literal["min", "max"] | None = None
    baseline: str | None = None
    rank: RankSpec | None = None
    finetune: FinetuneSpec | None = None
    reference: ReferenceSpec | None = None
    instability_threshold: float = 0.1


_KEYS = {f.name for f in fields(GridFile)}
_MAPPING = "must be a mapping of option names to values"
# what each key must be, for the one-line error when jsonargparse rejects its value
_SHAPES = {
    "name": "name must match [A-Za-z0-9_.-]+",
    "description": "description must be one line of text",
    "base": "base must be a config path or a non-empty list of them",
    "heads": "heads must be a non-empty mapping label -> head fragment or {head, base, overrides}",
    "seeds": "seeds must be a non-empty list of distinct integers >= 0",
    "overrides": f"overrides {_MAPPING}",
    "budget": f"budget {_MAPPING}",
    "variants": "variants must be a mapping label -> {option name: value}",
    "metric": "metric must be a test metric such as test/ppl",
    "mode": "mode must be min or max",
    "baseline": "baseline must be a head label",
    "rank": "rank must be {contexts: int >= 2, split: val|test}",
    "finetune": "finetune takes configs (paths) and overrides (a mapping)",
    "reference": "reference must be {source: text, values: {head label: number}}",
    "instability_threshold": "instability_threshold must be a positive number",
}


@dataclass(frozen=True)
class HeadEntry:
    label: str
    fragment: str | None  # a head fragment, given as --model.head FILE
    overrides: dict[str, Any] = field(default_factory=dict)
    base: list[str] | None = None  # this head's own base configs instead of the grid's


@dataclass(frozen=True)
class RunSpec:
    """One run of the grid: a head (label), an optional variant and a seed."""

    head: HeadEntry
    variant: str | None
    seed: int

    @property
    def label(self) -> str:
        """The group the run's seeds are averaged in: ``head`` or ``head+variant``."""
        return self.head.label if self.variant is None else f"{self.head.label}+{self.variant}"

    @property
    def relative_dir(self) -> Path:
        return Path(self.label.replace("+", "__")) / f"seed{self.seed}"


@dataclass(frozen=True)
class Grid:
    name: str
    description: str
    base: list[str]
    heads: list[HeadEntry]
    seeds: list[int]
    overrides: dict[str, Any]
    budget: dict[str, Any]
    variants: dict[str, dict[str, Any]]
    metric: str
    mode: str
    baseline: str
    rank: dict[str, Any] | None
    finetune: dict[str, Any] | None
    reference: dict[str, Any] | None
    instability_threshold: float
    raw: dict[str, Any]

    @property
    def curve_metric(self) -> str:
        """The validation metric of the curves, e.g. ``val/ppl`` for ``test/ppl``."""
        return "val/" + self.metric.split("/", 1)[-1]

    def runs(self) -> list[RunSpec]:
        """Every run, seeds innermost (so a partial study has whole groups first)."""
        variants: list[str | None] = list(self.variants) or [None]
        return [
            RunSpec(head, variant, seed)
            for variant in variants
            for head in self.heads
            for seed in self.seeds
        ]

    def run_base(self, run: RunSpec) -> list[str]:
        """The config files a run's fit starts from."""
        return list(run.head.base) if run.head.base is not None else list(self.base)

    def run_overrides(self, run: RunSpec) -> dict[str, Any]:
        """All ``--key value`` options of a run, later ones winning: the grid's, the budget,
        the variant's, the head's."""
        merged = dict(self.overrides)
        merged.update({f"trainer.{k}": v for k, v in self.budget.items()})
        if run.variant is not None:
            merged.update(self.variants[run.variant])
        merged.update(run.head.overrides)
        return merged


def default_mode(metric: str) -> str:
    return "max" if any(word in metric.lower() for word in _HIGHER_IS_BETTER) else "min"


def _fail(path: Path | str, message: str) -> StudyConfigError:
    return StudyConfigError(f"study grid {path}: {message}")


@functools.cache
def _parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(GridFile)
    return parser


def _schema(content: Mapping[str, Any], path: Path | str) -> GridFile:
    """``content`` as a :class:`GridFile`, or one error naming the key and what it must be."""
    unknown = set(content) - _KEYS
    if unknown:
        raise _fail(path, f"unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    for key in ("name", "heads", "seeds"):
        if content.get(key) is None:
            raise _fail(path, f"missing {key!r}")
    # an empty key: its default; a copy, as jsonargparse rewrites what it parses
    given = copy.deepcopy({k: v for k, v in content.items() if v is not None})
    parser = _parser()
    try:
        return GridFile(**vars(parser.instantiate(parser.parse_object(given))))
    except ArgumentError as error:
        key = re.search(r'Parser key "(\w+)"', str(error))
        if key is None or key[1] not in _SHAPES:
            raise _fail(path, str(error).splitlines()[0]) from None
        raise _fail(path, f"{_SHAPES[key[1]]}, got {content[key[1]]!r}") from None


def _config_list(value: str | list[str], what: str, path: Path | str, root: Path) -> list[str]:
    values = [value] if isinstance(value, str) else list(value)
    if not values:
        raise _fail(path, f"{what} must be a config path or a non-empty list of them")
    for v in values:
        if not v.endswith((".yaml", ".yml")):
            raise _fail(path, f"{what} must be a YAML config path, got {v!r}")
        if not (root / v).is_file():
            raise _fail(path, f"{what} {v!r} does not exist (paths are relative to {root})")
    return values


def _label(label: str, what: str, path: Path | str) -> str:
    if not _NAME.match(label) or "+" in label:
        raise _fail(path, f"{what} label {label!r} must match [A-Za-z0-9_.-]+")
    return label


def _heads(spec: GridFile, raw: Mapping[str, Any], path: Path | str, root: Path):
    if not spec.heads:
        raise _fail(path, "heads must be a non-empty mapping label -> head fragment")
    entries = []
    for label, head in spec.heads.items():
        _label(label, "head", path)
        head = HeadSpec(head) if isinstance(head, str) else head
        if head.head is None and head.base is None:
            raise _fail(path, f"heads.{label} must be a fragment path or {{head, base, overrides}}")
        fragment = head.head and _config_list(head.head, f"heads.{label}", path, root)[0]
        base = None if head.base is None else _config_list(head.base, f"heads.{label}.base", path,
                                                           root)  # fmt: skip
        overrides = raw[label].get("overrides") if isinstance(raw[label], Mapping) else None
        entries.append(HeadEntry(label, fragment, dict(overrides or {}), base))
    if spec.base is None and any(h.base is None for h in entries):
        raise _fail(path, "missing 'base' (needed by every head without a base of its own)")
    return entries


def _checked(spec: GridFile, path: Path | str) -> None:
    """What types cannot say: name and seeds, the metric and its baseline, the thresholds."""
    if not _NAME.match(spec.name):
        raise _fail(path, f"name must match [A-Za-z0-9_.-]+, got {spec.name!r}")
    seeds = spec.seeds
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise _fail(
            path, f"seeds must be a non-empty list of distinct integers >= 0, got {seeds!r}"
        )
    if not spec.metric.startswith("test/"):
        raise _fail(path, f"metric must be a test metric such as test/ppl, got {spec.metric!r}")
    if spec.baseline is not None and spec.baseline not in spec.heads:
        raise _fail(path, f"baseline {spec.baseline!r} is not one of the heads {list(spec.heads)}")
    threshold = spec.instability_threshold
    if not threshold > 0 or not math.isfinite(threshold):
        raise _fail(path, f"instability_threshold must be a positive number, got {threshold!r}")
    if spec.rank is not None and spec.rank.contexts < 2:
        raise _fail(path, _SHAPES["rank"])


def parse_grid(content: Any, path: Path | str = "<grid>", root: Path = REPO) -> Grid:
    """A validated :class:`Grid` from a grid file's content; paths checked under ``root``.
    Option values (``overrides``, ``budget``, ``variants``) are kept as written: they become
    ``--key value`` arguments of the CLI, which reads them itself."""
    if not isinstance(content, Mapping):
        raise _fail(path, "must be a YAML mapping")
    spec = _schema(content, path)
    _checked(spec, path)
    heads = _heads(spec, content["heads"], path, root)
    variants = {_label(k, "variant", path): dict(v or {})
                for k, v in (content.get("variants") or {}).items()}  # fmt: skip
    finetune = spec.finetune and {
        "configs": _config_list(spec.finetune.configs, "finetune.configs", path, root)
        if spec.finetune.configs else [],
        "overrides": dict((content["finetune"] or {}).get("overrides") or {}),
    }  # fmt: skip
    grid = Grid(
        name=spec.name,
        description=spec.description,
        base=[] if spec.base is None else _config_list(spec.base, "base", path, root),
        heads=heads,
        seeds=list(spec.seeds),
        overrides=dict(content.get("overrides") or {}),
        budget=dict(content.get("budget") or {}),
        variants=variants,
        metric=spec.metric,
        mode=spec.mode or default_mode(spec.metric),
        baseline=spec.baseline or heads[0].label,
        rank=None if spec.rank is None else vars(spec.rank),
        finetune=finetune,
        reference=spec.reference
        and {
            "source": spec.reference.source,
            "values": dict(content["reference"].get("values") or {}),  # as written
        },
        instability_threshold=float(spec.instability_threshold),
        raw=dict(content),
    )
    # a head "a__b" and head "a" with variant "b" share the folder a__b/ (labels keep "_")
    folders: dict[Path, str] = {}
    for run in grid.runs():
        if (other := folders.setdefault(run.relative_dir.parent, run.label)) != run.label:
            raise _fail(path, f"runs {other!r} and {run.label!r} would share the folder "
                        f"{run.relative_dir.parent}: rename a head or a variant")  # fmt: skip
    return grid


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last
    silently, so a head label pasted twice (``softmax: a.yaml`` then ``softmax: b.yaml``) ran
    one of them and said nothing."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                line = key_node.start_mark.line + 1
                raise _DuplicateKey(f"key {key!r} is given twice in one mapping (line {line})")
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_grid(path: str | Path, root: Path = REPO) -> Grid:
    """Read and validate a grid file (see the module docstring for the schema)."""
    path = Path(path)
    if not path.is_file():
        raise StudyConfigError(f"study grid {path} does not exist")
    try:
        content = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader
    except _DuplicateKey as exc:
        raise _fail(path, str(exc)) from None
    except yaml.YAMLError as exc:
        raise _fail(path, f"is not valid YAML: {exc}") from exc
    return parse_grid(content, path, root)


def cli_value(value: Any) -> str:
    """A YAML value as one command-line argument jsonargparse reads back as the same value."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, int | float):
        return repr(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()


def override_args(overrides: Mapping[str, Any]) -> list[str]:
    """``{key: value}`` -> ``["--key", "value", ...]``."""
    return [arg for key, value in overrides.items() for arg in (f"--{key}", cli_value(value))]


def fit_extra_args(grid: Grid, run: RunSpec) -> list[str]:
    """A run's ``cli.py fit`` options after its base configs: its head fragment, then the
    grid's overrides (the runner's fit, and the preflight check's parse of it)."""
    head = [] if run.head.fragment is None else ["--model.head", run.head.fragment]
    return head + override_args(grid.run_overrides(run))
