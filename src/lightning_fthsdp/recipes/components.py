"""A recipe's ``model`` and ``data``: any LightningModule / LightningDataModule class with its arguments.

Two spellings, one meaning:

- LightningCLI's: ``{class_path: pkg.mod.Class, init_args: {lr: 0.1}}``;
- Hydra's: ``{_target_: pkg.mod.Class, lr: 0.1}`` (the arguments beside the target).

``check`` refuses a malformed section when the recipe loads (no import: ``fthsdp k8s`` resolves recipes for an image
it has no copy of); ``to_lightning`` turns either spelling into LightningCLI's, which ``fthsdp fit`` hands to
LightningCLI, so ``fit``, ``launch``, ``slurm`` and ``k8s`` instantiate a recipe the same way (nested objects too:
a nested ``_target_`` becomes a nested ``class_path``, instantiated where the parameter's type hint names a class, as
LightningCLI does); ``verify`` imports the classes and checks the arguments against their signatures, as LightningCLI
will, before a launcher starts any process.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: Section -> the Lightning base class it must name.
BASES = {"model": "lightning.pytorch.LightningModule", "data": "lightning.pytorch.LightningDataModule"}

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
_LIGHTNING_KEYS = ("class_path", "init_args")
#: Hydra's instantiate options that LightningCLI has no counterpart for.
_HYDRA_UNSUPPORTED = ("_args_", "_partial_", "_recursive_", "_convert_")
_EXAMPLE = {"model": "model: {class_path: my_pkg.MyModule, init_args: {lr: 0.1}} (or {_target_: my_pkg.MyModule, "
                     "lr: 0.1}), or a config group option: model=tiny_gpt",
            "data": "data: {class_path: my_pkg.MyData, init_args: {batch_size: 8}} (or {_target_: my_pkg.MyData, "
                    "batch_size: 8}), or null when the module has its own dataloaders"}


def check(key: str, value: Any) -> None:
    """Refuse a section that is neither spelling (ValueError naming ``key``, what is wrong and an example); None is
    allowed (``require`` says where it is not)."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}={value!r} must name a class: {_EXAMPLE[key]}")
    _check_object(key, value, top=True)


def require(key: str, value: Any) -> None:
    """A recipe that trains needs a model (ValueError naming the fix)."""
    if value is None:
        raise ValueError(f"the recipe names no {key}: set {_EXAMPLE[key]}")


def to_lightning(value: Mapping[str, Any]) -> dict[str, Any]:
    """LightningCLI's ``{class_path, init_args}`` of a checked section, nested objects translated too."""
    if "_target_" in value:
        args = {k: v for k, v in value.items() if k != "_target_"}
        target = value["_target_"]
    else:
        args, target = dict(value.get("init_args") or {}), value["class_path"]
    return {"class_path": target, "init_args": {k: _translate(v) for k, v in args.items()}}


def verify(model: Mapping[str, Any] | None, data: Mapping[str, Any] | None) -> None:
    """Import the classes and check the arguments against their signatures (types included) as LightningCLI does,
    without instantiating anything; ValueError naming the section, the class and what does not fit."""
    import importlib

    from jsonargparse import ArgumentParser

    sections = {"model": model, "data": data}
    require("model", model)
    for key, value in sections.items():
        if value is None:
            continue
        module, _, name = BASES[key].rpartition(".")
        parser = ArgumentParser(exit_on_error=False)
        parser.add_subclass_arguments(getattr(importlib.import_module(module), name), key, required=True,
                                      fail_untyped=False)
        translated = to_lightning(value)
        try:
            parser.parse_object({key: translated})
        except Exception as err:  # jsonargparse's ArgumentError (and whatever the import raised)
            raise ValueError(f"{key}: {translated['class_path']} with init_args {translated['init_args']} does not "
                             f"fit: {_reason(err, key)}; fix the recipe's {key} section (is its package importable "
                             "here: installed, or on PYTHONPATH?)") from None


def _check_object(key: str, value: Mapping[str, Any], top: bool) -> None:
    keys = [str(k) for k in value]
    if "_target_" in keys and "class_path" in keys:
        raise ValueError(f"{key} has both class_path and _target_: give one (LightningCLI's class_path/init_args or "
                         "Hydra's _target_ with the arguments beside it)")
    if "_target_" in keys:
        unsupported = [k for k in keys if k in _HYDRA_UNSUPPORTED]
        if unsupported:
            raise ValueError(f"{key}.{unsupported[0]} is not supported: Hydra's {', '.join(_HYDRA_UNSUPPORTED)} have "
                             f"no LightningCLI counterpart; give the arguments by name beside {key}._target_")
        _check_path(f"{key}._target_", value["_target_"])
        args = {k: v for k, v in value.items() if k != "_target_"}
    elif "class_path" in keys:
        foreign = [k for k in keys if k not in _LIGHTNING_KEYS]
        if foreign:
            raise ValueError(f"{key}.{foreign[0]} is not a key of LightningCLI's form: allowed keys class_path, "
                             f"init_args; put the class's arguments under {key}.init_args")
        _check_path(f"{key}.class_path", value["class_path"])
        args = value.get("init_args") or {}
        if not isinstance(args, Mapping):
            raise ValueError(f"{key}.init_args={args!r} must be a mapping of the class's arguments by name")
    elif top:
        raise ValueError(f"{key} names no class (keys {', '.join(keys) or 'none'}): set {_EXAMPLE[key]}")
    else:
        args = value
    for name, arg in args.items():
        if isinstance(arg, Mapping):
            _check_object(f"{key}.{name}", arg, top=False)


def _check_path(key: str, path: Any) -> None:
    if not isinstance(path, str) or not _DOTTED.fullmatch(path):
        raise ValueError(f"{key}={path!r} must be an import path, package.module.Class")


def _translate(value: Any) -> Any:
    if isinstance(value, Mapping):
        if "_target_" in value or "class_path" in value:
            return to_lightning(value)
        return {k: _translate(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_translate(v) for v in value]
    return value


def _reason(err: Exception, key: str) -> str:
    """The lines of jsonargparse's message that say what is wrong (not its Union bookkeeping about ``key``)."""
    noise = (f'Parser key "{key}"', "Does not validate", "Subtypes:", "Errors:", "Expected a <class 'NoneType'>",
             "Given value")
    lines = [line.strip(" -") for line in str(err).splitlines()]
    return " ".join(line for line in lines if line and not line.startswith(noise)) or str(err)
