"""A study grid: heads x variants x seeds over one base experiment, read from a small YAML file.

A grid file is not a CLI config: it names CLI configs (``base``, head fragments) and the
options that differ between runs. Schema (paths relative to the repository root)::

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

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from heads.errors import UserError

REPO = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_KEYS = {
    "name",
    "description",
    "base",
    "heads",
    "seeds",
    "overrides",
    "budget",
    "variants",
    "metric",
    "mode",
    "baseline",
    "rank",
    "finetune",
    "reference",
    "instability_threshold",
}
_HIGHER_IS_BETTER = ("bleu", "acc", "top")


class StudyConfigError(UserError, ValueError):
    """A grid file that cannot describe a study (missing key, unknown head, bad seed...)."""


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


def _mapping(value: Any, what: str, path: Path | str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _fail(path, f"{what} must be a mapping of option names to values, got {value!r}")
    return dict(value)


def _config_file(value: Any, what: str, path: Path | str, root: Path) -> str:
    if not isinstance(value, str) or not value.endswith((".yaml", ".yml")):
        raise _fail(path, f"{what} must be a YAML config path, got {value!r}")
    if not (root / value).is_file():
        raise _fail(path, f"{what} {value!r} does not exist (paths are relative to {root})")
    return value


def _config_list(value: Any, what: str, path: Path | str, root: Path) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values:
        raise _fail(path, f"{what} must be a config path or a non-empty list of them")
    return [_config_file(v, what, path, root) for v in values]


def _heads(value: Any, path: Path | str, root: Path) -> list[HeadEntry]:
    if not isinstance(value, Mapping) or not value:
        raise _fail(path, "heads must be a non-empty mapping label -> head fragment")
    entries = []
    for label, spec in value.items():
        if not isinstance(label, str) or not _NAME.match(label) or "+" in label:
            raise _fail(path, f"head label {label!r} must match [A-Za-z0-9_.-]+")
        if isinstance(spec, str):
            spec = {"head": spec}
        if (
            not isinstance(spec, Mapping)
            or set(spec) - {"head", "overrides", "base"}
            or not ("head" in spec or "base" in spec)
        ):
            raise _fail(path, f"heads.{label} must be a fragment path or {{head, base, overrides}}")
        fragment = None
        if "head" in spec:
            fragment = _config_file(spec["head"], f"heads.{label}", path, root)
        base = (
            _config_list(spec["base"], f"heads.{label}.base", path, root)
            if ("base" in spec)
            else None
        )
        overrides = _mapping(spec.get("overrides"), f"heads.{label}.overrides", path)
        entries.append(HeadEntry(label, fragment, overrides, base))
    return entries


def _seeds(value: Any, path: Path | str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value)
        or len(set(value)) != len(value)
    ):
        raise _fail(
            path, f"seeds must be a non-empty list of distinct integers >= 0, got {value!r}"
        )
    return list(value)


def _rank(value: Any, path: Path | str) -> dict[str, Any] | None:
    if value is None:
        return None
    spec = _mapping(value, "rank", path)
    unknown = set(spec) - {"contexts", "split"}
    contexts, split = spec.get("contexts", 2000), spec.get("split", "val")
    if unknown or not isinstance(contexts, int) or contexts < 2 or split not in ("val", "test"):
        raise _fail(path, "rank must be {contexts: int >= 2, split: val|test}")
    return {"contexts": contexts, "split": split}


def _finetune(value: Any, path: Path | str, root: Path) -> dict[str, Any] | None:
    if value is None:
        return None
    spec = _mapping(value, "finetune", path)
    if set(spec) - {"configs", "overrides"}:
        raise _fail(path, f"finetune takes configs and overrides, got {sorted(spec)}")
    configs = spec.get("configs") or []
    configs = _config_list(configs, "finetune.configs", path, root) if configs else []
    return {"configs": configs, "overrides": _mapping(spec.get("overrides"), "finetune", path)}


def _reference(value: Any, path: Path | str) -> dict[str, Any] | None:
    if value is None:
        return None
    spec = _mapping(value, "reference", path)
    values = _mapping(spec.get("values"), "reference.values", path)
    if set(spec) - {"source", "values"} or not isinstance(spec.get("source"), str):
        raise _fail(path, "reference must be {source: text, values: {head label: number}}")
    if not all(isinstance(v, int | float) for v in values.values()):
        raise _fail(path, "reference.values must be numbers")
    return {"source": spec["source"], "values": values}


def parse_grid(content: Any, path: Path | str = "<grid>", root: Path = REPO) -> Grid:
    """A validated :class:`Grid` from a grid file's content; paths checked under ``root``."""
    if not isinstance(content, Mapping):
        raise _fail(path, "must be a YAML mapping")
    unknown = set(content) - _KEYS
    if unknown:
        raise _fail(path, f"unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    for key in ("name", "heads", "seeds"):
        if key not in content:
            raise _fail(path, f"missing {key!r}")
    name = content["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise _fail(path, f"name must match [A-Za-z0-9_.-]+, got {name!r}")
    heads = _heads(content["heads"], path, root)
    if "base" not in content and any(h.base is None for h in heads):
        raise _fail(path, "missing 'base' (needed by every head without a base of its own)")
    variants_raw = _mapping(content.get("variants"), "variants", path)
    variants = {}
    for label, options in variants_raw.items():
        if not _NAME.match(label) or "+" in label:
            raise _fail(path, f"variant label {label!r} must match [A-Za-z0-9_.-]+")
        variants[label] = _mapping(options, f"variants.{label}", path)
    metric = content.get("metric", "test/ppl")
    if not isinstance(metric, str) or not metric.startswith("test/"):
        raise _fail(path, f"metric must be a test metric such as test/ppl, got {metric!r}")
    mode = content.get("mode", default_mode(metric))
    if mode not in ("min", "max"):
        raise _fail(path, f"mode must be min or max, got {mode!r}")
    labels = [h.label for h in heads]
    baseline = content.get("baseline", labels[0])
    if baseline not in labels:
        raise _fail(path, f"baseline {baseline!r} is not one of the heads {labels}")
    threshold = content.get("instability_threshold", 0.1)
    if not isinstance(threshold, int | float) or not threshold > 0 or not math.isfinite(threshold):
        raise _fail(path, f"instability_threshold must be a positive number, got {threshold!r}")
    return Grid(
        name=name,
        description=str(content.get("description", "")),
        base=_config_list(content["base"], "base", path, root) if "base" in content else [],
        heads=heads,
        seeds=_seeds(content["seeds"], path),
        overrides=_mapping(content.get("overrides"), "overrides", path),
        budget=_mapping(content.get("budget"), "budget", path),
        variants=variants,
        metric=metric,
        mode=mode,
        baseline=baseline,
        rank=_rank(content.get("rank"), path),
        finetune=_finetune(content.get("finetune"), path, root),
        reference=_reference(content.get("reference"), path),
        instability_threshold=float(threshold),
        raw=dict(content),
    )


def load_grid(path: str | Path, root: Path = REPO) -> Grid:
    """Read and validate a grid file (see the module docstring for the schema)."""
    path = Path(path)
    if not path.is_file():
        raise StudyConfigError(f"study grid {path} does not exist")
    try:
        content = yaml.safe_load(path.read_text())
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
