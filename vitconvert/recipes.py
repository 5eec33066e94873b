"""A training recipe: YAML + overrides -> one frozen Recipe of typed sections, through one path (``build_recipe``).

The recipe is data so that any run can be repeated: the run folder keeps the YAML text as given plus the
overrides (``recipe.yaml``), and the model card shows the resolved values. A recipe file is written in sections
(``schedule: {epochs: 300}``); the flat files written before the sections (``epochs: 300``), flat overrides
(``--set epochs=3``) and the flat recipe dicts that older run folders stored still read, each flat key mapped
to its section by ``FLAT_KEYS``.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from . import recipe_sections as sections
from .errors import VitconvertError, first_line, plural
from .recipe_checks import fail
from .recipe_sections import (
    Augmentation,
    Dataset,
    Distillation,
    Input,
    NewParams,
    Optimization,
    Reporting,
    Schedule,
    Section,
)

__all__ = ["Recipe", "NewParams", "build_recipe", "load_recipe", "find_recipe", "available_recipes", "FLAT_KEYS"]


@dataclass(frozen=True)
class Recipe(Section):
    """Every knob of a distill run, by section. Defaults: the Xu et al. (2024) small-dataset recipe (method.md).

    ``recipe.schedule.epochs`` is the way to read a field; ``recipe.epochs`` (the flat name) still reads for the
    transition from the flat recipe, through ``FLAT_KEYS``."""

    name: str = "default"
    seed: int = 0  # data order, augmentation and dropout
    dataset: Dataset = field(default_factory=Dataset)
    input: Input = field(default_factory=Input)
    augmentation: Augmentation = field(default_factory=Augmentation)
    optimization: Optimization = field(default_factory=Optimization)
    schedule: Schedule = field(default_factory=Schedule)
    distillation: Distillation = field(default_factory=Distillation)
    reporting: Reporting = field(default_factory=Reporting)

    def check(self) -> None:
        """The top-level fields, and the one rule across sections: the fresh weights' warm-up inside the run."""
        if self.seed >= 2 ** 63:
            raise fail("seed", self.seed, "must be below 2**63 (torch's generators take a 64-bit seed)")
        if self.seed < 0:
            raise fail("seed", self.seed, "must not be negative")
        if not _plain_name(self.name):
            raise fail("name", self.name, "must be a plain name (letters, digits, _ . + -; no '/' or '..'): it "
                                          "names the run folder under runs/")
        sections.check_warmup("new_params.warmup_epochs", self.optimization.new_params.warmup_epochs,
                              self.schedule.epochs)

    def __getattr__(self, name: str) -> Any:
        """``recipe.epochs``: a flat name read from its section (the transition from the flat recipe)."""
        path = FLAT_KEYS.get(name)
        if path is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(getattr(self, path.partition(".")[0]), name)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON: sections as mappings, tuples as lists (what a run stores and its card shows)."""
        return _plain(asdict(self))

    def leaves(self) -> dict[str, Any]:
        """``{"schedule.epochs": 300, "optimization.new_params.lr_scale": 1.0, ...}``."""
        return leaves(self.to_dict())

    def operational(self) -> set[str]:  # type: ignore[override]
        """The dotted paths of the fields marked OPERATIONAL (where or how fast, not what is trained)."""
        return {f"{s}.{name}" for s in SECTIONS for name in getattr(self, s).operational()}


TOP_LEVEL = ("name", "seed")
SECTIONS: dict[str, type[Section]] = {f.name: sections._hints(Recipe)[f.name] for f in dataclasses.fields(Recipe)
                                      if f.name not in TOP_LEVEL}
# The flat recipe's keys, each to its section: the one table of the old layout (derived from the sections,
# whose field names are the flat names: a field added to a section also reads flat).
FLAT_KEYS: dict[str, str] = {f.name: f"{section}.{f.name}" for section, kind in SECTIONS.items()
                             for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
FIELDS = (*TOP_LEVEL, *FLAT_KEYS)  # every field by the name a user writes (flat, or last in its dotted path)
SCALED_WITH_EPOCHS = ("schedule.warmup_epochs", "optimization.new_params.warmup_epochs",
                      "schedule.freeze_copied_epochs")


def _plain_name(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", name) is not None


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return list(value) if isinstance(value, tuple) else value


def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b.c": value}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# -- the one path: values (a file, flat or in sections) + overrides (dotted or flat keys) -> Recipe -------------
def field_path(key: str) -> str:
    """An override's key as a dotted path from the top: ``epochs`` -> ``schedule.epochs``, ``new_params.lr_scale``
    -> ``optimization.new_params.lr_scale``; a section path stays. An unknown first part is refused with a hint."""
    head, dot, rest = str(key).partition(".")
    if head in FLAT_KEYS:
        return FLAT_KEYS[head] + dot + rest
    if head in SECTIONS or head in TOP_LEVEL:
        return str(key)
    valid = [*TOP_LEVEL, *FLAT_KEYS, *SECTIONS]
    close = difflib.get_close_matches(head, valid, n=1)
    raise VitconvertError(f"unknown recipe key {key!r}" + (f"; did you mean {close[0]}?" if close else ""))


def override_paths(overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides as ``{dotted path: value}``; a mapping value (``new_params: {lr_scale: 10}``) becomes one path per
    key, so it merges into the file's mapping. Two keys naming one field are refused."""
    out: dict[str, Any] = {}
    named: dict[str, str] = {}
    for key, value in overrides.items():
        path = field_path(str(key))
        for sub, leaf in (leaves(value, f"{path}.") if isinstance(value, dict) else {path: value}).items():
            if sub in named and named[sub] != key:
                raise VitconvertError(f"recipe overrides {named[sub]} and {key} both set {sub}: give it once")
            out[sub], named[sub] = leaf, str(key)
    return out


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """A recipe file's mapping in sections: flat keys moved to theirs; a field given both ways is refused."""
    tree: dict[str, Any] = {}
    for key, value in values.items():
        key = str(key)
        if key in SECTIONS:
            section = tree.setdefault(key, {})
            if value is not None and not isinstance(value, dict):
                SECTIONS[key].from_value(value, key)  # refuses it: a section is a mapping
            for sub, leaf in (value or {}).items():
                _put(section, str(sub), leaf, f"{key}.{sub}")
        elif key in FLAT_KEYS:
            _put(tree.setdefault(FLAT_KEYS[key].partition(".")[0], {}), key, value, key)
        elif key in TOP_LEVEL:
            tree[key] = value
        else:
            field_path(key)  # refuses it, with a hint
    return tree


def _put(section: dict[str, Any], key: str, value: Any, given: str) -> None:
    if key in section:
        raise VitconvertError(f"recipe key {given} is given twice (flat and in its section): keep one")
    section[key] = value


def build_recipe(values: dict[str, Any], overrides: Optional[dict[str, Any]] = None) -> Recipe:
    """The recipe of ``values`` (a file's mapping, flat or in sections) with ``overrides`` applied over it, and
    the warm-ups scaled to the epochs (``scale_schedule``). The only way values become a Recipe."""
    return resolve(values, overrides or {})[0]


def resolve(values: dict[str, Any], overrides: dict[str, Any]) -> tuple[Recipe, dict[str, Any]]:
    """(recipe, every path set over the file's values: the overrides and what scaling changed)."""
    tree = nest(values)
    paths = scale_schedule(tree, override_paths(overrides))
    for path, value in paths.items():
        _set(tree, path, value)
    return Recipe(**tree), paths


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        if not isinstance(tree.get(part), dict):  # absent, or null in the file (the defaults)
            tree[part] = {}
        tree = tree[part]
    tree[last] = value


def _get(tree: dict[str, Any], path: str, default: Any = None) -> Any:
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


def scale_schedule(tree: dict[str, Any], paths: dict[str, Any]) -> dict[str, Any]:
    """``paths`` plus the epoch counts (warm-ups, frozen epochs) scaled to the run's epochs.

    Each count keeps its proportion of the epochs it was written for: the file's own epochs for the values the
    file sets, the built-in 300 for the defaults. A 300-epoch recipe run for 15 epochs would otherwise spend them
    all in its 50-epoch warm-up and never reach its peak lr or its cosine. Values the overrides set are kept, as
    is everything when ``scale_schedule`` is false. The scaled values are stored with the overrides, so
    recipe.yaml says what was scaled and re-reads the same.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(Schedule)}
    default_tree = {"schedule": defaults, "optimization": {"new_params": asdict(NewParams())}}
    written_epochs = _get(tree, "schedule.epochs", defaults["epochs"])
    epochs = paths.get("schedule.epochs", written_epochs)
    scale = paths.get("schedule.scale_schedule", _get(tree, "schedule.scale_schedule", True))
    if not scale or not _count(epochs):
        return paths
    out, notes = dict(paths), []
    for path in SCALED_WITH_EPOCHS:
        in_file = _get(tree, path, _MISSING) is not _MISSING
        value = _get(tree, path) if in_file else _get(default_tree, path)
        base = written_epochs if in_file else defaults["epochs"]
        if path in paths or not _count(value) or not _count(base) or base == epochs:
            continue
        out[path] = round(value * epochs / base)
        notes.append(f"{path.removeprefix('schedule.').removeprefix('optimization.')} {value} -> {out[path]} "
                     f"(written for {plural(base, 'epoch')})")
    if notes:
        out["schedule.schedule_scaled"] = f"to {plural(epochs, 'epoch')}: " + ", ".join(notes)
    return out


_MISSING = object()


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# -- recipe files: where they are, their text, what a run stores ----------------------------------------------
def recipe_dirs() -> list[Path]:
    """Where named recipes live: ``vitconvert/recipe_files``, a link to the repository's recipes/ that
    wheels ship as real files, so `--recipe cifar100` works in a checkout and in an installed package alike."""
    packaged = Path(__file__).resolve().parent / "recipe_files"
    return [packaged] if packaged.is_dir() else []


def available_recipes() -> list[str]:
    return sorted({p.stem for d in recipe_dirs() for p in d.glob("*.yaml")})


def find_recipe(spec: str) -> Path:
    """A recipe file: a path, or a name in recipes/ (``cifar100`` -> recipes/cifar100.yaml)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    for folder in recipe_dirs():
        candidate = folder / f"{spec.removesuffix('.yaml')}.yaml"
        if candidate.is_file():
            return candidate
    names = ", ".join(available_recipes()) or "none installed"
    raise VitconvertError(f"recipe not found: {spec} (a YAML file, or one of: {names})")


def parse_recipe_text(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        reason = first_line(e)
        raise VitconvertError(f"{where} is not valid YAML ({reason})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise VitconvertError(f"{where} must be a mapping of recipe keys to values")
    return data


OVERRIDES = "overrides"  # a recipe file's mapping of dotted keys applied after its sections (as --set is)


def overrides_text(paths: dict[str, Any]) -> str:
    if not paths:
        return ""
    body = yaml.safe_dump({OVERRIDES: paths}, sort_keys=False, default_flow_style=False).strip()
    return f"\n# overrides from the command line (applied after the values above; the last `overrides:` wins)\n{body}\n"


def load_recipe(spec: Optional[str] = None, overrides: Optional[dict[str, Any]] = None) -> tuple[Recipe, str]:
    """(recipe, text to store): the file's text as written plus every override (the file's own ``overrides:``,
    then ``overrides``, then what scaling changed) as one ``overrides:`` block, which a re-read applies alike."""
    if spec is None:
        values: dict[str, Any] = {}
        text = "# vitconvert's default recipe (no --recipe given)\n" + yaml.safe_dump(Recipe().to_dict(),
                                                                                        sort_keys=False)
    else:
        path = find_recipe(spec)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise VitconvertError(f"{path} is not a recipe: a recipe is YAML text, and this file is binary (not "
                                  f"UTF-8 at byte {e.start})") from None
        values = parse_recipe_text(text, str(path))
        values.setdefault("name", path.stem)
    stored = values.pop(OVERRIDES, None) or {}
    if not isinstance(stored, dict):
        raise VitconvertError(f"recipe {OVERRIDES}: expected a mapping of keys (schedule.epochs: 3), got {stored!r}")
    recipe, paths = resolve(values, {**override_paths(stored), **override_paths(overrides or {})})
    text = text if text.endswith("\n") else text + "\n"
    return recipe, text + (overrides_text(paths) if paths != override_paths(stored) else "")


def stored_leaves(stored: dict[str, Any]) -> dict[str, Any]:
    """A recipe dict a run stored (sections, or the flat dict of older runs) as dotted paths; keys this version
    does not know are kept as written, so they show as changes rather than fail."""
    out: dict[str, Any] = {}
    for key, value in stored.items():
        if key in FLAT_KEYS:
            out.update(leaves({FLAT_KEYS[key]: value}) if not isinstance(value, dict) else
                       leaves(value, FLAT_KEYS[key] + "."))
        elif key in SECTIONS and isinstance(value, dict):
            out.update(leaves(value, f"{key}."))
        else:
            out[key] = value
    return out
