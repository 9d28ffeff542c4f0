"""``aiollama serve --models-dir DIR`` and ``--models-preset FILE``: the models of a router server,
each with its engine and server options.

A folder gives a model for each ``*.gguf`` file (named by its stem) and each subfolder holding
one (its ``mmproj*`` file the projector). A preset is llama-server's INI file: a section a model
(``[name]``, with ``model = PATH`` where the folder has no model of that name), and ``[*]`` for
every model; each key is a ``serve`` flag without its dashes (``c = 4096``, ``n-gpu-layers = 8``,
``temp = 0.2``, a switch as ``true`` or ``false``), plus ``alias`` (names, comma-separated),
``load-on-startup`` and ``keep-alive`` (seconds). The flags given on the command line come first,
then the model's section, then ``[*]``.
"""

from __future__ import annotations

import argparse
import configparser
from pathlib import Path
from typing import Any

from aiollama import ModelEntry, models_in

OWN_KEYS = ("model", "alias", "load-on-startup", "keep-alive")  # a preset's keys that are not flags
ROUTER_FLAGS = ("models_dir", "models_preset", "models_max", "models_autoload", "keep_alive", "host", "port",
                "api_key", "api_key_file", "replicas", "model", "model_option")


def read_preset(path: Path) -> dict[str, dict[str, str]]:
    """The sections of an INI preset (keys before any section, such as ``version``, left out)."""
    parser = configparser.ConfigParser(interpolation=None, comment_prefixes=(";", "#"))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    try:
        parser.read_string("[__top__]\n" + path.read_text(encoding="utf-8"), source=str(path))
    except configparser.Error as exc:
        raise ValueError(f"the preset {path} is not an INI file: {exc}") from None
    return {name: dict(parser[name]) for name in parser.sections() if name != "__top__"}


def _argv(serve: argparse.ArgumentParser, section: dict[str, str], where: str) -> list[str]:
    """A preset section's flags as command-line words."""
    out: list[str] = []
    for key, value in section.items():
        if key in OWN_KEYS:
            continue
        if key.startswith("LLAMA_ARG_"):
            raise ValueError(f"{where}: {key}: give the flag's name, not llama-server's environment variable")
        flag = next((f for f in (f"--{key}", f"-{key}") if f in serve._option_string_actions), None)
        if flag is None:
            raise ValueError(f"{where}: {key!r} is not a flag of aiollama serve")
        action = serve._option_string_actions[flag]
        if action.nargs == 0:  # a switch
            if value.lower() in ("true", "1", "on", ""):
                out.append(flag)
            elif value.lower() in ("false", "0", "off"):
                negative = f"--no-{flag.lstrip('-')}"
                if negative in serve._option_string_actions:
                    out.append(negative)
            else:
                raise ValueError(f"{where}: {key} is a switch: true or false, not {value!r}")
        else:
            out += [flag, value]
    return out


def model_settings(serve: argparse.ArgumentParser, args: argparse.Namespace,
                   engine_options: Any, app_options: Any) -> tuple[list[ModelEntry], dict[str, dict[str, Any]]]:
    """The router's models (their engine options) and each one's server options, from the flags
    ``args``, the models folder and the preset. ``engine_options`` and ``app_options`` make those
    of a parsed set of flags."""
    found: dict[str, Path] = {}
    projectors: dict[str, Path] = {}
    if args.models_dir is not None:
        for entry in models_in(args.models_dir):
            found[entry.name] = entry.path
            if "mmproj" in entry.options:
                projectors[entry.name] = entry.options["mmproj"]
    sections = read_preset(args.models_preset) if args.models_preset is not None else {}
    common = sections.pop("*", {})
    for name, section in sections.items():
        if "model" in section:
            found[name] = Path(section["model"]).expanduser()
        elif name not in found:
            raise ValueError(f"preset [{name}]: no model of that name in the models folder; give 'model = PATH'")
    if not found:
        raise ValueError("no models: the models folder holds no GGUF file, and the preset names none")
    entries, apps = [], {}
    for name, path in found.items():
        section = {**common, **sections.get(name, {})}
        flags = serve.parse_args([*_argv(serve, common, "preset [*]"), *_argv(serve, sections.get(name, {}),
                                                                             f"preset [{name}]"), str(path)])
        for dest, value in vars(args).items():  # the command line's own flags come first
            if dest not in ROUTER_FLAGS and value != serve.get_default(dest):
                setattr(flags, dest, value)
        if name in projectors and flags.mmproj is None:
            flags.mmproj = projectors[name]
        options = engine_options(flags)
        aliases = tuple(a.strip() for a in section.get("alias", "").split(",") if a.strip())
        keep = section.get("keep-alive")
        entries.append(ModelEntry(name, path, options, aliases, None if keep is None else float(keep),
                                  section.get("load-on-startup", "false").lower() in ("true", "1", "on")))
        apps[name] = {**app_options(flags), "model_name": name}
    return entries, apps
