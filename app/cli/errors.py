"""One line for every mistake on the command line.

jsonargparse reports a bad option as a block of nested "Parser key" / "Does not validate against
any of the Union subtypes" lines with the usage above it; :class:`OneLineErrorParser` turns that
block into ``<key>: <what is wrong> (given <value>)``, with a "did you mean" for unknown options,
classes and files, and leaves the usage to ``--help``. :func:`known_error_line` does the same for
the exceptions of Lightning, PyTorch and datasets that mean "fix your command".
"""

from __future__ import annotations

import difflib
import errno
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from heads.errors import UserError


@rank_zero_only
def warn_line(message: str) -> None:
    """A ``warning:`` line on stderr, once under DDP: what the run does that the user may not
    have meant, in the same shape as the ``error:`` lines."""
    print(f"warning: {message}", file=sys.stderr)


class CommandLineError(UserError, ValueError):
    """An option, value, class or file on the command line that cannot work."""


_GIVEN_NESTED = re.compile(r"Given value: NestedArg\(key='(?P<key>[^']*)', val='(?P<val>.*)'\)$")
_GIVEN = re.compile(r"Given value: (?P<val>.*)$")
_TOP_KEY = re.compile(r'^Parser key "(?P<key>[^"]+)":\s*(?P<rest>.*)$')
_ANY_KEY = re.compile(r'^(?P<indent>\s*)(?:- )?Parser key "(?P<key>[^"]+)":\s*(?P<rest>.*)$')
_GIVEN_CLASS = re.compile(r"^Namespace\(class_path='(?P<cls>[^']+)'")
_REQUIRED = re.compile(r"the following arguments are required: (?P<names>.+)$")
# a value that is neither an existing file nor an import path (a class)
_UNRESOLVED = ("Expected a path but", "Expected a dot import path string")
# the longest given value quoted in a line (a whole config is no help)
_LONGEST_VALUE = 200
_CLASS_PATH = re.compile(r"Problem with given class_path '(?P<cls>[^']+)'")
_NOT_ACCEPTED = re.compile(r"Option '(?P<option>[^']+)' is not accepted")
_NO_ATTRIBUTE = re.compile(r"module '(?P<module>[^']+)' has no attribute '(?P<name>[^']+)'")
_EXPECTED = re.compile(r"Expected an? (?P<type>.+?)(?:\. Got value: .*)?$")
_LITERAL = re.compile(r"typing\.Literal\[(?P<choices>.*)\]")
_CLASS = re.compile(r"<class '(?:builtins\.)?(?P<name>[\w.]+)'>")
_UNSPACED_COLON = re.compile(r"^\{.*[^\s:]:[^\s/:]")
# lines of jsonargparse's blocks that only frame the reason
_FRAME = (
    "Does not validate",
    "Subtypes:",
    "Errors:",
    "Given value",
    "Parser key",
    "Problem with given class_path",
    "Expected a path but",
)


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Up to three candidates: the word cut short (``max_epoch``), the word with a suffix
    (``bptt_length`` for ``bptt``), then the closest spellings."""
    pool = sorted(set(candidates))
    longer = [c for c in pool if len(word) >= 3 and c.startswith(word)]
    shorter = [c for c in pool if len(c) >= 3 and word.startswith(c + "_")]
    prefixed = longer + shorter
    close = difflib.get_close_matches(word, pool, n=3, cutoff=0.6)
    chosen = list(dict.fromkeys([*prefixed, *close]))[:3]
    return f"; did you mean {' or '.join(chosen)}?" if chosen else ""


def _type_name(text: str) -> str:
    literal = _LITERAL.search(text)
    if literal:
        return ", ".join(c.strip().strip("'") for c in literal.group("choices").split(","))
    match = _CLASS.search(text)
    return match.group("name").rpartition(".")[2] if match else text


def _expectations(reasons: list[str]) -> str | None:
    """``expected an int`` / ``expected one of: ...`` from jsonargparse's "Expected a ..." lines
    (None and import-path alternatives left out: nobody meant them)."""
    wanted: list[str] = []
    for reason in reasons:
        match = _EXPECTED.match(reason)
        if not match or "NoneType" in reason or "dot import path" in reason:
            continue
        name = _type_name(match.group("type"))
        if name not in wanted:
            wanted.append(name)
    if not wanted:
        return None
    choices = [name for name in wanted if "," in name]
    if choices:  # literal choices: the class-typed alternatives are their values' types
        return "expected one of: " + ", ".join(choices)
    if len(wanted) > 2:
        return "expected one of: " + ", ".join(wanted)
    return "expected " + " or ".join(f"a{'n' if n[0] in 'aeiou' else ''} {n}" for n in wanted)


def _class_options(class_path: str) -> list[str]:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    except Exception:  # the message stays useful without the suggestions
        return []


def _module_classes(module: str) -> list[str]:
    try:
        found = importlib.import_module(module)
    except Exception:
        return []
    return [f"{module}.{n}" for n, obj in vars(found).items() if inspect.isclass(obj)]


def _sibling_files(value: str) -> list[str]:
    folder = Path(value).parent
    return [str(folder / p.name) for p in folder.glob("*")] if folder.is_dir() else []


def _path_is(value: str, test: Callable[[Path], bool]) -> bool:
    """``test(Path(value))``, False where ``value`` cannot be a path (a YAML string or a
    config longer than any path, a line break or a NUL in it)."""
    try:
        return "\n" not in value and test(Path(value))
    except (OSError, ValueError):
        return False


# an option's shipped fragments (a folder of configs/) and the module of its classes, for "did
# you mean" on a short name such as --model.head mixtape
_FRAGMENTS = {
    "head": ("heads", "heads"),
    "backbone": ("backbones", "lightning_modules.backbones"),
    "data": ("data", "datamodules"),
    "optimizer": ("optimizers", "torch.optim"),
    "scheduler": ("optimizers", "torch.optim.lr_scheduler"),
}
_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _fragment_folder(name: str) -> Path:
    """``configs/<name>`` as the user can type it: relative where the working folder is the
    project's, else absolute."""
    relative = Path("configs") / name
    return relative if (relative / "..").resolve() == _CONFIGS else _CONFIGS / name


def _short_name_hint(key: str, value: str) -> str:
    """The "did you mean" of a value that names a shipped fragment or a class of the option
    ``key`` without its folder or module (configs/heads/mixtape.yaml or heads.MixtapeHead for
    ``--model.head mixtape``)."""
    option = key.rpartition(".")[2]
    if option not in _FRAGMENTS or not value or "/" in value:
        return ""
    folder_name, module = _FRAGMENTS[option]
    folder = _fragment_folder(folder_name)
    stem = value.removesuffix(".yaml").removesuffix(".yml")
    files = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
    prefixed = [name for name in files if len(stem) >= 2 and name.startswith(stem)]
    close = difflib.get_close_matches(stem, files, n=2, cutoff=0.7)
    chosen = [stem] if stem in files else [*prefixed, *close][:2]
    found = [str(folder / f"{name}.yaml") for name in chosen]
    classes = _module_classes(module)
    names = {c.rpartition(".")[2].lower(): c for c in classes}
    found += [c for n, c in sorted(names.items()) if len(stem) >= 2 and n.startswith(stem.lower())]
    chosen = list(dict.fromkeys(found))[:3]
    return f"; did you mean {' or '.join(chosen)}?" if chosen else ""


def _reason(lines: list[str], value: str, key: str = "") -> str:
    """What is wrong, from the innermost lines of a jsonargparse block (``key``: the option,
    for suggestions)."""
    reasons = [
        line.strip().removeprefix("- ").strip()
        for line in lines
        if line.strip() and not line.strip().removeprefix("- ").startswith(_FRAME)
    ]
    classes = [m.group("cls") for line in lines if (m := _CLASS_PATH.search(line))]
    for reason in reasons:
        if match := _NOT_ACCEPTED.search(reason):
            option, owner = match.group("option"), classes[-1] if classes else "the class"
            return f"{owner} has no option {option!r}" + _did_you_mean(
                option, _class_options(owner)
            )
        if match := _NO_ATTRIBUTE.search(reason):
            module, name = match.group("module"), match.group("name")
            return f"no class {name!r} in module {module!r}" + _did_you_mean(
                f"{module}.{name}", _module_classes(module)
            )
    for reason in reasons:
        if match := _REQUIRED.search(reason):
            names = [name.strip() for name in match.group("names").split(",")]
            owner = _GIVEN_CLASS.match(value)
            what = owner.group("cls") if owner else "the class"
            options = " and ".join(f"--{key}.init_args.{name}" for name in names if key)
            return f"{what} requires {', '.join(names)}" + (f": give {options}" if key else "")
    # a whole config given as the value (a model jsonargparse could not validate) is no path
    path_like = not value.startswith("Namespace(") and (
        "/" in value or value.endswith((".yaml", ".yml"))
    )
    if path_like and not _path_is(value, Path.exists):
        return "no such file or class" + _did_you_mean(value, _sibling_files(value))
    expected = _expectations(reasons)
    unresolved = any(line.strip().removeprefix("- ").startswith(_UNRESOLVED) for line in lines)
    if value and unresolved and expected is None:  # a class-typed option: a file or a class
        if _path_is(value, Path.is_dir):
            return "no such file or class: a folder, give one of its files"
        return "no such file or class" + _short_name_hint(key, value)
    if expected and "dict" in expected and _UNSPACED_COLON.search(value):
        # YAML reads {train:dev} as one string key: its mapping needs a space after the colon
        return f"{expected}; YAML needs a space after each colon, as in '{{train: train}}'"
    if expected:
        return expected
    rest = [r for r in reasons if not r.startswith("Expected")]
    return (rest or reasons or ["invalid value"])[-1]


def one_line(message: str, known_options: Iterable[str] = ()) -> str:
    """jsonargparse's error ``message`` as ``<key>: <what is wrong> (given <value>)``."""
    lines = message.strip().splitlines() or ["invalid command line"]
    first = lines[0].strip()
    if first.startswith("unrecognized arguments:"):
        given = first.removeprefix("unrecognized arguments:").split()
        option = next((a for a in given if a.startswith("-")), given[0] if given else "")
        return f"unknown option {option}" + _did_you_mean(option.split("=")[0], known_options)
    if match := re.match(r"argument subcommand: invalid choice: '(?P<cmd>[^']*)'", first):
        commands = ("fit", "validate", "test", "predict")
        return f"unknown subcommand {match.group('cmd')!r}" + (
            _did_you_mean(match.group("cmd"), commands) or f" (one of: {', '.join(commands)})"
        )
    if (required := _REQUIRED.match(first)) and (missing := _missing_setting(required)):
        return missing
    top = _TOP_KEY.match(first)
    if top is None:
        return first
    key, rest = top.group("key"), top.group("rest")
    if rest:  # one-line messages such as "File does not exist: ..."
        return f"{'--config' if key == 'config' else key}: {rest}"
    value = ""
    last = lines[-1].strip()
    if nested := _GIVEN_NESTED.match(last):
        key, value = f"{key}.init_args.{nested.group('key')}", nested.group("val")
    elif given := _GIVEN.match(last):
        value = given.group("val")
    body = lines[1:]
    if value.startswith("Namespace(") and (inner := _innermost(lines)) is not None:
        # a whole config given (a model whose option failed): the option that failed, its own
        # lines and value
        key, body, value = inner
    reason = _reason(body, value, key)
    if owner := _GIVEN_CLASS.match(value):  # a class and its options: the class
        value = "" if owner.group("cls") in reason else owner.group("cls")
    shown = value and not value.startswith("Namespace(") and len(value) <= _LONGEST_VALUE
    return f"{key}: {reason}" + (f" (given {value!r})" if shown else "")


def _missing_setting(required: re.Match) -> str | None:
    """``fit`` without a model (no ``--config`` setting, or a preset alone): the setting to
    start from, not jsonargparse's "the following arguments are required: fit.model"."""
    names = [name.strip() for name in required.group("names").split(",")]
    model = next((name for name in names if name.rpartition(".")[2] == "model"), None)
    if model is None:
        return None
    subcommand = model.rpartition(".")[0] or "the command"
    return (
        f"{subcommand} has no model: give a setting first, e.g. --config configs/lm/ptb.yaml "
        f"(configs/lm, configs/mt and configs/ds hold them; presets stack after one)"
    )


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _innermost(lines: list[str]) -> tuple[str, list[str], str] | None:
    """The deepest ``Parser key`` of a jsonargparse block: its whole key (``model.init_args.
    scheduler``), its own lines and the value it was given."""
    keys = [(len(m.group("indent")), m.group("key"), i)
            for i, line in enumerate(lines) if (m := _ANY_KEY.match(line))]  # fmt: skip
    if len(keys) < 2:
        return None
    depth = max(indent for indent, _, _ in keys)
    indent, key, start = next(k for k in keys if k[0] == depth)
    path, child = [key], start
    for outer, name, at in reversed([k for k in keys if k[2] < start]):
        if outer < indent:  # the key whose block holds the one found so far
            subclass = any(_CLASS_PATH.search(line) for line in lines[at + 1 : child])
            path.insert(0, f"{name}.init_args" if subclass else name)
            indent, child = outer, at
    own = [lines[start].split(":", 1)[1]] if _ANY_KEY.match(lines[start]).group("rest") else []
    for line in lines[start + 1 :]:
        if line.strip() and _indent(line) <= depth:
            break
        own.append(line)
    values = [m.group("val") for line in own if (m := _GIVEN.match(line.strip()))]
    return ".".join(path), own, values[-1] if values else ""


class OneLineErrorParser(LightningArgumentParser):
    """LightningCLI's parser that raises :class:`CommandLineError` (one line, exit status 2
    through ``cli.py``) instead of printing the usage and the nested error block."""

    def error(self, message: str, ex: Exception | None = None) -> Any:
        if not self.exit_on_error:  # jsonargparse's inner parsers try alternatives this way
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        raise CommandLineError(one_line(message, parser._option_string_actions)) from ex


def _config_files(args: Sequence[str]) -> list[Path]:
    """The ``--config`` values that name existing files (others are YAML strings, which
    ``app.cli.lightning_cli.build`` passes, or missing files, which the parser reports)."""
    files = []
    for flag, value in zip(args, args[1:], strict=False):
        if flag not in ("--config", "-c") or "\n" in value:
            continue
        try:
            if Path(value).is_file():
                files.append(Path(value))
        except OSError:  # a name too long to be a path
            continue
    return files


def check_config_files(args: Sequence[str]) -> None:
    """Every ``--config`` file that exists parses as YAML, or one line names the file (the
    parser's own message names none)."""
    for value in _config_files(args):
        try:
            yaml.safe_load(value.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            where = getattr(exc, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise CommandLineError(
                f"--config {str(value)!r} is not a YAML file ({problem}{line})"
            ) from exc


# Options the CLI links from elsewhere (app/cli/lightning_cli.py): a value given by hand would be
# silently replaced, so it is refused. Keys without their ``init_args`` segments.
LINKED = {
    "model.head.hidden_size": "the backbone's output size",
    "model.head.vocab_size": "data.vocab_size",
    "model.backbone.vocab_size": "data.vocab_size",
    "model.backbone.src_vocab_size": "data.src_vocab_size",
}


def _plain_key(key: str) -> str:
    return ".".join(part for part in key.split(".") if part != "init_args")


def _config_keys(tree: Any, prefix: str = "") -> Iterable[str]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _config_keys(value, f"{prefix}{key}.")
    if prefix:
        yield prefix[:-1]


# options whose value may be a config file of their own (a fragment: ``class_path`` and
# ``init_args``), keys without their ``init_args`` segments
_FRAGMENT_OPTIONS = ("model", "model.head", "model.backbone", "data")


def _file_keys(path: Path, prefix: str, seen: set[Path]) -> Iterable[tuple[str, Path]]:
    """The keys a config file sets, under ``prefix``, with those of the fragments it names
    (``head: ../heads/softmax.yaml``, relative to the file), each file once; each key with
    the file that sets it."""
    path = path.resolve()
    if path in seen:
        return
    seen.add(path)
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):  # the parser names a broken file
        return
    for key in _config_keys(tree):
        full = f"{prefix}.{key}" if prefix else key
        yield full, path
        value = _lookup(tree, key)
        if isinstance(value, str) and value.endswith((".yaml", ".yml")):
            fragment = path.parent / value
            if _path_is(str(fragment), Path.is_file):
                yield from _file_keys(fragment, full, seen)


def _lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def check_linked_options(args: Sequence[str]) -> None:
    """Refuse, naming the link, an option that the CLI sets from another: given on the command
    line, or in a config file (a ``--config`` file, a fragment given as the value of
    ``--model.head``, ``--model.backbone``, ``--model`` or ``--data``, or one they name)."""
    given: list[tuple[str, Path | None]] = [
        (a[2:].split("=")[0], None) for a in args if a.startswith("--")
    ]
    seen: set[Path] = set()
    for value in _config_files(args):
        given += list(_file_keys(value, "", seen))
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        flag, equals, value = arg[2:].partition("=")
        if not equals:
            value = args[i + 1] if i + 1 < len(args) else ""
        if _plain_key(flag) not in _FRAGMENT_OPTIONS:
            continue
        if _path_is(value, Path.is_file):
            given += list(_file_keys(Path(value), flag, seen))
        elif value.lstrip().startswith("{"):  # a fragment written out: {init_args: {...}}
            try:
                given += [(f"{flag}.{key}", None) for key in _config_keys(yaml.safe_load(value))]
            except yaml.YAMLError:  # the parser names it
                pass
    for key, file in given:
        source = LINKED.get(_plain_key(key))
        if source is not None:
            where = f" (in {str(file)!r})" if file is not None else ""
            raise CommandLineError(
                f"{key}{where}: set by the CLI from {source}; leave it out (a value given here "
                f"would be replaced)"
            )


# Lightning's messages name Trainer options in backticks: `max_epochs`, `strategy='ddpp'`
_TRAINER_OPTION = re.compile(r"`(?P<name>[a-z_]+)(?:=[^`]*)?`")


def known_error_line(exc: BaseException) -> str | None:
    """One line for the exceptions of Lightning and PyTorch that mean "fix your command", or
    None for the rest (bugs keep their traceback)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    message = " ".join(str(exc).split())
    origin = _raised_in(exc)
    lightning_check = isinstance(exc, ValueError) and "lightning/" in origin
    # a device count the accelerator cannot take (``devices: -1`` of a GPU setting on a CPU)
    device_check = (
        isinstance(exc, TypeError)
        and "lightning/fabric/accelerators/" in origin
        and _trainer_option(message) is not None
    )
    if isinstance(exc, MisconfigurationException) or lightning_check or device_check:
        if "No supported gpu backend found" in message or "CUDA" in message and "not" in message:
            return (
                "trainer.accelerator: no GPU is usable on this machine; use --trainer.accelerator "
                "cpu (or auto)"
            )
        if "ckpt_path" in message:
            return f"ckpt_path: {message.replace('`', '')}"
        option = _trainer_option(message)
        if option is not None:
            return f"trainer.{option}: {message.replace('`', '')}"
        if isinstance(exc, MisconfigurationException):
            return message.replace("`", "")
        return None
    if isinstance(exc, ValueError) and "torch/optim/" in origin:
        kind = "scheduler" if "lr_scheduler" in origin else "optimizer"
        return f"model.init_args.{kind}: {message}"
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRORS:
        return _disk_error_line(exc)
    if isinstance(exc, ValueError) and "/torch/" in origin and _raised_while_parsing(exc):
        # a class of the config that leaves a value to torch to check (nn.Dropout's p):
        # raised while jsonargparse built it, so it is the config's value
        return f"{_constructed_class(exc) or 'the config'}: {message}"
    return None


# what the machine refuses to store: a full disk, a quota, a read-only or forbidden folder
_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


def _disk_error_line(exc: OSError) -> str:
    """A file the run could not write (a checkpoint when the disk filled up mid-run): the
    file, the system's reason and where to point the run instead."""
    # a rename's target (a checkpoint is written beside and moved into place) is the file
    path = exc.filename2 if exc.filename2 is not None else exc.filename
    where = f"{str(path)!r}: " if path is not None else ""
    fix = {errno.EROFS: "write elsewhere", errno.EACCES: "check its permissions or write "
           "elsewhere"}.get(exc.errno, "free space on its disk or write elsewhere")  # fmt: skip
    return (
        f"{where}{exc.strerror or exc}: {fix} (logs and checkpoints go under "
        f"--trainer.logger.init_args.save_dir, the data cache under $OUTPUT_HEADS_CACHE)"
    )


def _frames(exc: BaseException) -> Iterable[Any]:
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _raised_while_parsing(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while jsonargparse instantiated the config's classes."""
    return any("jsonargparse/" in f.f_code.co_filename.replace("\\", "/") for f in _frames(exc))


def _constructed_class(exc: BaseException) -> str | None:
    """The innermost class outside torch whose ``__init__`` was running when ``exc`` was
    raised (the head that gave ``nn.Dropout`` its probability), as ``module.Name``."""
    found = None
    for frame in _frames(exc):
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        name = frame.f_code.co_filename.replace("\\", "/")
        if owner is not None and "/torch/" not in name and "jsonargparse/" not in name:
            found = f"{type(owner).__module__}.{type(owner).__qualname__}"
    return found


def _raised_in(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.replace("\\", "/") if tb is not None else ""


def _trainer_option(message: str) -> str | None:
    """The Trainer option a Lightning message names in backticks, if any."""
    from lightning.pytorch import Trainer

    options = set(inspect.signature(Trainer.__init__).parameters)
    named = (m.group("name") for m in _TRAINER_OPTION.finditer(message))
    return next((name for name in named if name in options), None)
