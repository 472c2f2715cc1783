"""YAML run configs: ``base:`` inheritance, dotted command-line overrides, strict keys, saved with outputs.

:func:`load_config` (``config_from_dict`` for a resolved dict, :func:`config_from_checkpoint` for a
checkpoint's) -> :class:`Config`, a ``dict`` with attribute access. Paths under ``configs/`` resolve to the
installed ``vit3.configs`` (:data:`CONFIG_DIR`). A file's keys must be those of vit3's configs; overrides
are ``key.sub=value`` (YAML values) and must name existing keys; values are typed by
``configs/default.yaml`` (:func:`check_types`) and checked against
:data:`~vit3.engine.config.schema.CONSTRAINTS` (:func:`check_config`). What the user wrote is listed in
``cfg["_written"]`` (:func:`written_keys`). :func:`save_config` writes ``config.yaml`` with ``_meta``.
The full rules: ``docs/design/engine.md``.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import functools
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ...errors import ConfigError
from ...outputs import write_text
from .kinds import Range, is_number
from .schema import CONSTRAINTS, check_values

# The installed configs: the repository's configs/ (package-dir mapping in pyproject.toml), a plain folder of
# an installed or editable package (vit3 is never imported from a zip).
try:
    CONFIG_DIR = Path(str(resources.files("vit3.configs")))
except ModuleNotFoundError as e:  # an editable install made before configs/ became vit3.configs
    raise ImportError(
        "vit3.configs (the repository's configs/) is not installed: reinstall vit3 (pip install -e .)"
    ) from e
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"
# The config that lists every key of each task (relative to CONFIG_DIR).
TASK_CONFIGS = {
    "classification": "default.yaml",
    "detection": "dense/dense_base.yaml",
    "segmentation": "dense/dense_base.yaml",
    "generation": "generation/default.yaml",
    "convert": "convert/base.yaml",
}
TASKS = tuple(TASK_CONFIGS)  # the tasks a config may name
# Keys that belong to one command rather than to its run: a config rebuilt from a checkpoint resets them.
COMMAND_KEYS = ("train.resume", "train.force_resume", "train.overwrite")
# The config's list of the dotted keys the user wrote (overrides, the user's own config files).
WRITTEN_KEY = "_written"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]

__all__ = [
    "COMMAND_KEYS",
    "CONFIG_DIR",
    "CONSTRAINTS",
    "DEFAULT_CONFIG",
    "NULLABLE",
    "TASKS",
    "TASK_CONFIGS",
    "WRITTEN_KEY",
    "Config",
    "ConfigError",
    "Range",
    "check_config",
    "check_types",
    "check_values",
    "check_whole",
    "config_from_checkpoint",
    "config_from_dict",
    "git_commit",
    "glued_key",
    "load_config",
    "parse_override",
    "resolve_config_path",
    "save_config",
    "to_plain",
    "written_keys",
]


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` / ``5E4`` as floats (YAML 1.1 needs a dot: ``1.0e-3``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(stream: Any) -> Any:
    return yaml.load(stream, Loader=_Loader)


# Keys whose default is a value but that also take null ("off", or "the pretrained model's").
NULLABLE = frozenset(
    {
        "aug.auto_augment",
        "aug.color_jitter",
        "aug.mixup",
        "aug.cutmix",
        "train.clip_grad",
        "train.mesa",
        "data.img_size",
        "data.crop_pct",
        "data.interpolation",
    }
)
# Keys that take a second type besides their default's.
ALTERNATIVES: dict[str, type] = {
    "train.progress": str,
    "train.warmup_epochs": float,
    "aug.color_jitter": list,
}
# Lists whose elements must have one type although the default list is empty.
LIST_ELEMENTS = {"eval.img_sizes": int}


class Config(dict):
    """A nested ``dict`` with attribute access; nested mappings are converted to :class:`Config`."""

    __module__ = "vit3.engine.config"  # its public name, which messages and earlier checkpoints use

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        for key, value in (data or {}).items():
            self[key] = _wrap(value)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(_unknown_key_message(name, self.keys())) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = _wrap(value)

    def __deepcopy__(self, memo: dict) -> Config:
        return Config(copy.deepcopy(self.to_dict(), memo))

    def to_dict(self) -> dict[str, Any]:
        """Returns plain nested dicts/lists (safe for YAML, JSON and ``torch.load(weights_only=True)``)."""
        return {k: (v.to_dict() if isinstance(v, Config) else copy.deepcopy(v)) for k, v in self.items()}

    def get_path(self, dotted: str) -> Any:
        """Returns the value at ``"a.b.c"``; raises :class:`ConfigError` naming an unknown key."""
        node: Any = self
        for i, part in enumerate(dotted.split(".")):
            if not isinstance(node, Mapping) or part not in node:
                known = node.keys() if isinstance(node, Mapping) else []
                prefix = ".".join(dotted.split(".")[:i])
                raise ConfigError(_unknown_key_message(dotted, _full_keys(known, prefix)))
            node = node[part]
        return node

    def set_path(self, dotted: str, value: Any) -> None:
        """Sets an existing key ``"a.b.c"``, or a new one inside a free-form mapping, the mappings on the way
        made (``model.kwargs.ttt_cfg.branches``); raises :class:`ConfigError` for an unknown one."""
        parent_path, _, leaf = dotted.rpartition(".")
        self._make_free_form_parents(parent_path)
        parent = self.get_path(parent_path) if parent_path else self
        if not isinstance(parent, Mapping) or (leaf not in parent and not _in_free_form(parent_path)):
            known = parent.keys() if isinstance(parent, Mapping) else []
            raise ConfigError(_unknown_key_message(dotted, _full_keys(known, parent_path)))
        parent[leaf] = _wrap(value)

    def _make_free_form_parents(self, dotted: str) -> None:
        """Makes the missing mappings of ``dotted`` below its first free-form mapping (``_free_form``), where
        that mapping exists; nothing where ``dotted`` is not inside one."""
        parts = dotted.split(".") if dotted else []
        node: Any = self
        for i, part in enumerate(parts):
            if not isinstance(node, Mapping):
                return
            if part not in node:
                if not _in_free_form(".".join(parts[:i])):
                    return
                node[part] = Config({})
            node = node[part]


def _wrap(value: Any) -> Any:
    if isinstance(value, Config):
        return value
    if isinstance(value, Mapping):
        return Config(value)
    return value


def _full_keys(keys: Iterable[str], prefix: str) -> list[str]:
    return [f"{prefix}.{k}" if prefix else str(k) for k in keys]


def _all_dotted_keys(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        out.append(dotted)
        if isinstance(value, Mapping):
            out.extend(_all_dotted_keys(value, dotted))
    return out


def _unknown_key_message(key: str, candidates: Iterable[str]) -> str:
    candidates = list(candidates)
    close = difflib.get_close_matches(key, candidates, n=5, cutoff=0.5)
    if not close:  # also match on the last component ("lr" -> "train.base_lr")
        leaf = key.rsplit(".", 1)[-1]
        close = [c for c in candidates if leaf and leaf in c.rsplit(".", 1)[-1]][:5]
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown config key '{key}'{hint}"


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Merges ``top`` over ``base`` (mappings recursively, everything else replaced)."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _leaf_keys(tree: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """The dotted keys of ``tree``'s values that are not mappings (bookkeeping keys ``_...`` left out)."""
    for key, value in tree.items():
        if not prefix and str(key).startswith("_"):
            continue
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            yield from _leaf_keys(value, dotted)
        else:
            yield dotted


def _read_yaml_tree(
    path: Path, stack: tuple[Path, ...] = (), origin: dict[str, Path | None] | None = None
) -> dict[str, Any]:
    """Reads ``path`` and its ``base:`` chain into one merged dict (``base`` removed). ``origin``, when given,
    gets for each leaf key the file that set it last (the merge's winner) where that file is the user's (not
    one of vit3's configs, ``_shipped``), else ``None``."""
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(str(p) for p in (*stack, path))
        raise ConfigError(f"config inheritance cycle: {chain}")
    if path.is_dir():
        inside = " (e.g. the run's config.yaml in it)" if (path / "config.yaml").is_file() else ""
        raise ConfigError(f"config file {path} is a folder: give a YAML file{inside}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = _yaml_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"cannot parse config file {path}: {_yaml_problem(e)}") from e
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping at the top level, got {type(data).__name__}"
        )
    glued = glued_key(data)
    if glued is not None:
        raise ConfigError(f"config file {path}: {_glued_message(glued)}")
    bases = data.pop("base", None) or []
    if isinstance(bases, str):
        bases = [bases]
    merged: dict[str, Any] = {}
    for base in bases:  # beside this file, else vit3's own configs/<file>
        where = path.parent / base
        where = where if where.exists() else _shipped_copy(Path(base)) or where
        merged = _deep_merge(merged, _read_yaml_tree(where, (*stack, path), origin))
    if origin is not None:
        origin.update(dict.fromkeys(_leaf_keys(data), None if _shipped(path) else path))
    return _deep_merge(merged, data)


@functools.lru_cache(maxsize=1)
def _shipped_keys() -> frozenset[str]:
    """Every dotted key of vit3's configs (each file as written, ``base`` left out)."""
    keys: set[str] = set()
    for file in CONFIG_DIR.rglob("*.yaml"):
        with open(file, encoding="utf-8") as f:
            data = _yaml_load(f) or {}
        data.pop("base", None)
        keys.update(_all_dotted_keys(data))
    return frozenset(keys)


# Mappings whose keys are the user's own besides every ``...kwargs`` one (a constructor's arguments).
_OPEN = ("dense.synthetic.splits",)


def _free_form(mapping: str) -> bool:
    """Whether the mapping at dotted ``mapping`` takes keys of the user's own: a ``...kwargs`` one (e.g.
    ``model.kwargs``, a model's arguments) or one of ``_OPEN``; every other mapping has vit3's keys."""
    return mapping.rpartition(".")[2].endswith("kwargs") or mapping in _OPEN


def _in_free_form(mapping: str) -> bool:
    """Whether the mapping at dotted ``mapping`` is free-form (``_free_form``) or lies inside one."""
    parts = mapping.split(".") if mapping else []
    return any(_free_form(".".join(parts[:i])) for i in range(1, len(parts) + 1))


def _known_key(key: str) -> bool:
    """Whether a config file may write ``key``: a key of vit3's configs, or one inside a free-form mapping."""
    return key in _shipped_keys() or _in_free_form(key.rpartition(".")[0])


def _shipped(path: Path) -> bool:
    """Whether ``path`` (resolved) is one of vit3's configs: under :data:`CONFIG_DIR`, or a copy of one (the
    same bytes at the same place under a ``configs`` folder: a checkout's beside the installed package's).
    An edited copy is the user's."""
    root = CONFIG_DIR.resolve()
    if path.is_relative_to(root):
        return True
    parts = path.parts
    if "configs" not in parts[:-1]:
        return False
    at = len(parts) - 1 - parts[::-1].index("configs")
    twin = root.joinpath(*parts[at + 1 :])
    return twin.is_file() and twin.read_bytes() == path.read_bytes()


def glued_key(value: Any) -> str | None:
    """The first key of a mapping in ``value`` (nested mappings and lists searched too) that YAML read from a
    ``key:value`` written without a space after the colon: one key ``"img_size:32"`` with no value, where
    ``{img_size: 32}`` was meant; ``None`` when there is none."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and item is None and re.fullmatch(r"[^:\s]+:\S.*", key):
                return key
            found = glued_key(item)
            if found is not None:
                return found
    elif isinstance(value, list):
        for item in value:
            found = glued_key(item)
            if found is not None:
                return found
    return None


def _glued_message(key: str) -> str:
    name, _, value = key.partition(":")
    return (
        f"YAML reads '{key}' as one key without a value: write a space after the colon ({name}: {value}), "
        f"as YAML mappings need"
    )


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML parser's error in one line: what is wrong and where (its own message spans several)."""
    mark = getattr(error, "problem_mark", None)
    problem = ", ".join(filter(None, (getattr(error, "context", None), getattr(error, "problem", None))))
    if mark is None or not problem:
        return " ".join(str(error).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def parse_override(text: str) -> tuple[str, Any]:
    """Parses ``"key.sub=value"`` into ``("key.sub", value)`` with the value read as YAML.

    Raises:
        ConfigError: no ``key=``, or a mapping with a ``key:value`` that lacks the space after its colon
            (:func:`glued_key`: YAML would read one key without a value).
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override '{text}': expected key.sub=value (e.g. train.epochs=10)")
    try:
        value = _yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # a string YAML cannot parse (e.g. "a: b") is taken literally
    glued = glued_key(value)
    if glued is not None:
        raise ConfigError(f"bad override '{text}': {_glued_message(glued)}")
    return key, value


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Loads a YAML config with its ``base:`` chain and applies dotted ``key=value`` overrides.

    Args:
        path: config file; ``None`` loads :data:`DEFAULT_CONFIG`.
        overrides: ``"key.sub=value"`` strings; each must name a key present after the files are merged.

    Returns:
        The resolved :class:`Config`, with ``_config_file`` recording the file it came from and
        :data:`WRITTEN_KEY` the keys the user wrote (the overrides, the keys of the user's own files).

    Raises:
        ConfigError: missing/unparsable file, inheritance cycle, a file's key that no config of vit3's has
            (naming the file), bad override syntax or unknown key.
    """
    path = resolve_config_path(path) if path is not None else DEFAULT_CONFIG
    origin: dict[str, Path | None] = {}
    data = _read_yaml_tree(path, origin=origin)
    for key, where in origin.items():
        if where is not None and not _known_key(key):
            alike = [k for k in _shipped_keys() if k.count(".") == key.count(".")]  # keys at its depth
            raise ConfigError(f"{where}: {_unknown_key_message(key, sorted(alike))}")
    data[WRITTEN_KEY] = [key for key, where in origin.items() if where is not None]
    try:
        cfg = config_from_dict(data, overrides)
    except ConfigError:  # a file that is no whole config: that, rather than the first key it lacks
        check_whole(data, path)
        raise
    cfg["_config_file"] = str(path.resolve())
    return cfg


def resolve_config_path(path: str | Path) -> Path:
    """``path`` itself when it exists, else the installed copy of a ``configs/<file>`` path (what the README
    names, run from outside the repository): ``configs/dense/demo_detection.yaml`` ->
    ``CONFIG_DIR / "dense/demo_detection.yaml"``. A path found nowhere is returned unchanged (loading it
    raises :class:`ConfigError` naming it)."""
    path = Path(path)
    return path if path.exists() else _shipped_copy(path) or path


def _shipped_copy(path: Path) -> Path | None:
    """vit3's installed copy of a relative ``configs/<file>`` path, where there is one."""
    if path.is_absolute() or not path.parts or path.parts[0] != "configs":
        return None
    installed = CONFIG_DIR.joinpath(*path.parts[1:])
    return installed if installed.is_file() else None


def config_from_dict(data: Mapping[str, Any], overrides: Iterable[str] = ()) -> Config:
    """Builds a :class:`Config` from a resolved dict (e.g. the one stored in a checkpoint) plus overrides.

    The keys ``data`` lists under :data:`WRITTEN_KEY` (a checkpoint's: what its run's user wrote) and those
    of the overrides are the user's (:func:`written_keys`); every other value of ``data`` is a default.

    Raises:
        ConfigError: bad override syntax or unknown key.
    """
    cfg = Config({k: v for k, v in data.items() if k not in ("_meta", WRITTEN_KEY)})
    written = dict.fromkeys(data.get(WRITTEN_KEY) or ())
    for text in overrides:
        key, value = parse_override(text)
        try:
            cfg.set_path(key, value)
        except ConfigError:  # re-raise with close matches searched over every key of the config
            raise ConfigError(_unknown_key_message(key, _all_dotted_keys(cfg))) from None
        if isinstance(value, Mapping):  # it replaces the mapping there, with the keys written before
            written = {k: None for k in written if not k.startswith(f"{key}.")}
            written.update(dict.fromkeys(_leaf_keys(value, key)))
        else:
            written[key] = None
    if written:
        cfg[WRITTEN_KEY] = list(written)
    check_config(cfg)
    return cfg


def written_keys(cfg: Mapping[str, Any]) -> frozenset[str]:
    """The dotted keys whose values the user wrote (:data:`WRITTEN_KEY`: the command line's overrides and the
    user's own config files; the shipped configs' values are defaults)."""
    return frozenset(cfg.get(WRITTEN_KEY) or ())


def config_from_checkpoint(saved: Mapping[str, Any], overrides: Iterable[str] = ()) -> Config:
    """The config a checkpoint's run had (``saved``: its ``config``), plus ``overrides``.

    It is merged over the shipped defaults of its task (:data:`TASK_CONFIGS`), so that keys added to vit3
    after the checkpoint was written take their default values; the keys of :data:`COMMAND_KEYS` (what one
    command asked for: resume, force the resume, overwrite) are reset to their defaults.

    Raises:
        ConfigError: bad override syntax, unknown key, or a value of the wrong type or range.
    """
    task = str(saved.get("task", "classification"))
    defaults = _read_yaml_tree(CONFIG_DIR / TASK_CONFIGS.get(task, "default.yaml"))
    data = _deep_merge(defaults, {k: v for k, v in saved.items() if k != "_meta"})
    for key in COMMAND_KEYS:
        section, _, leaf = key.rpartition(".")
        if leaf in defaults.get(section, {}):
            data[section][leaf] = defaults[section][leaf]
    return config_from_dict(data, overrides)


def check_config(cfg: Config, mode: str | None = None) -> None:
    """Checks the types (:func:`check_types`) and the values (:func:`~vit3.engine.config.schema.check_values`:
    ranges, choices, policies, names; with ``mode``, ``"train"`` or ``"eval"``, also what a run of that mode
    needs on this machine: writable outputs, existing inputs) of ``cfg``'s values.

    Raises:
        ConfigError: naming each key with a value of the wrong type, or else one it does not allow.
    """
    check_types(cfg)
    check_values(cfg, mode)


def check_whole(cfg: Mapping[str, Any], source: str | Path | None = None) -> None:
    """Checks that ``cfg`` (a run's config, or a config file's merged tree) has every top-level key of its
    task's shipped config (:data:`TASK_CONFIGS`), as a file whose ``base:`` chain reaches a shipped config
    has; ``source``: the file, for the message (default: ``cfg``'s ``_config_file``).

    Raises:
        ConfigError: naming the file, the keys it lacks and the ``base:`` line that gives them.
    """
    task = str(cfg.get("task", "classification"))
    shipped = TASK_CONFIGS.get(task, "default.yaml")
    missing = [key for key in _shipped_tree(shipped) if key not in cfg]
    if not missing:
        return
    source = source or cfg.get("_config_file") or "the config"
    shown = ", ".join(missing[:6]) + (f", ... ({len(missing)} keys)" if len(missing) > 6 else "")
    what = "is empty" if not [k for k in cfg if not str(k).startswith("_")] else f"lacks {shown}"
    raise ConfigError(
        f"config file {source} {what}: a run config builds on a shipped one; begin it with "
        f"'base: {CONFIG_DIR / shipped}' (the {task} defaults) and set only what differs"
    )


def to_plain(value: Any) -> Any:
    """``value`` as plain data: every mapping (a :class:`Config` too) a ``dict``, every tuple a list, all the
    way down (what ``torch.load(weights_only=True)``, YAML and JSON read back)."""
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value


@functools.cache
def _default_tree() -> dict[str, Any]:
    return _read_yaml_tree(DEFAULT_CONFIG)


@functools.cache
def _shipped_tree(name: str) -> dict[str, Any]:
    return _read_yaml_tree(CONFIG_DIR / name)


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _coerce(key: str, value: Any, default: Any) -> Any:
    """``value`` in the type of ``default`` (see the module docstring); raises :class:`ConfigError`."""
    if default is None or not isinstance(default, bool | int | float | str | list):
        return value
    if value is None:
        if key in NULLABLE:
            return None
        raise ConfigError(f"config key {key} must be {_expected(key, default)}, got null")
    if key in ALTERNATIVES and isinstance(value, ALTERNATIVES[key]):
        return list(value) if isinstance(value, tuple) else value
    kind = type(default)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and number and float(value).is_integer():
        return int(value)
    if kind is float and number:
        return value
    if kind is str and (isinstance(value, str) or number):
        return str(value)
    if kind is list and isinstance(value, list | tuple):
        element = LIST_ELEMENTS.get(key) or (
            float if default and all(is_number(v) for v in default) else None
        )
        if element is not None and not all(
            is_number(v) and (element is float or float(v).is_integer()) for v in value
        ):
            raise ConfigError(f"config key {key} must be {_expected(key, default)}, got {value!r}")
        return [int(v) for v in value] if element is int else list(value)
    raise ConfigError(f"config key {key} must be {_expected(key, default)}, got {value!r}")


def _expected(key: str, default: Any) -> str:
    if isinstance(default, list):
        element = LIST_ELEMENTS.get(key) or (
            float if default and all(is_number(v) for v in default) else None
        )
        what = {int: "a list of integers", float: "a list of numbers"}.get(element, "a list")
    else:
        what = _TYPE_NAMES.get(type(default), type(default).__name__)
    if key in ALTERNATIVES:
        what += f" or {_TYPE_NAMES.get(ALTERNATIVES[key], 'a ' + ALTERNATIVES[key].__name__)}"
    return f"{what} (or null)" if key in NULLABLE else what


def check_types(cfg: Config) -> None:
    """Checks every value of ``cfg`` whose key ``configs/default.yaml`` defines against the default's type
    (normalising ``2.0`` -> ``2`` for integers and numbers -> strings for strings, in place).

    Raises:
        ConfigError: naming each key with a value of the wrong type and the type expected.
    """
    errors: list[str] = []

    def walk(node: dict[str, Any], ref: Mapping[str, Any], prefix: str) -> None:
        for key in list(node):
            if key not in ref:
                continue
            dotted, default, value = f"{prefix}{key}", ref[key], node[key]
            if isinstance(default, Mapping):
                if not isinstance(value, Mapping):
                    errors.append(f"config key {dotted} must be a mapping (key: value), got {value!r}")
                elif not _free_form(dotted):
                    walk(value, default, f"{dotted}.")
                continue
            try:
                node[key] = _coerce(dotted, value, default)
            except ConfigError as e:
                errors.append(str(e))

    walk(cfg, _default_tree(), "")
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else "bad config values:\n  " + "\n  ".join(errors))


@functools.cache
def _source_checkout() -> Path | None:
    """The git work tree that holds this vit3 package at its top level (``None`` for an installed wheel, even
    one installed inside some other repository)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=_PACKAGE_DIR, capture_output=True, text=True,
            timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    top = Path(out.stdout.strip())
    return top if (top / "vit3").resolve() == _PACKAGE_DIR else None


def git_commit(cwd: str | Path | None = None) -> str | None:
    """Returns the commit hash of the checkout at ``cwd`` (default: vit3's source checkout; ``None`` when git
    or the checkout is absent, e.g. for an installed wheel)."""
    cwd = cwd if cwd is not None else _source_checkout()
    if cwd is None:
        return None
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _git_dirty(cwd: str | Path | None = None) -> bool | None:
    cwd = cwd if cwd is not None else _source_checkout()
    if cwd is None:
        return None
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip())


def run_metadata() -> dict[str, Any]:
    """Git commit, dirty flag, command line and UTC time of this run (stored with configs and checkpoints)."""
    return {
        "git_commit": git_commit(),
        "git_dirty": _git_dirty(),
        "command": " ".join(sys.argv),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def save_config(cfg: Config, out_dir: str | Path) -> Path:
    """Writes the resolved config plus run metadata (git commit, command) to ``out_dir/config.yaml``.

    Raises:
        OutputError: the system refused the write (naming the file and the reason; an earlier config.yaml is
            left as it was).
    """
    data = cfg.to_dict()
    data["_meta"] = run_metadata()
    return write_text(Path(out_dir) / "config.yaml", yaml.safe_dump(data, sort_keys=False), "config")
