"""The command line's own text: what a bare ``hybridpar`` prints, ``--version``, and the config
keys ``hybridpar train --help`` lists (generated from the config dataclasses, so it never goes
stale)."""

from __future__ import annotations

import dataclasses
import textwrap

from hybridpar.config import Config

__all__ = ["config_keys", "top_level"]


def top_level(argv: list[str], commands: dict[str, str]) -> str:
    """``hybridpar --version``'s version line, else the usage and one line per command (a bare
    ``hybridpar`` and ``--help``: a user expecting help gets it, not a run)."""
    from hybridpar import __version__

    if argv[:1] == ["--version"]:
        return f"hybridpar {__version__}"
    width = max(map(len, commands)) + 2  # the longest name (calibrate) still leaves a gap
    lines = [f"usage: hybridpar {{{','.join(commands)}}} [options]   (hybridpar COMMAND --help)",
             f"hybridpar {__version__}: hybrid-parallel transformer training", ""]
    lines += [f"  {name:<{width}}{what}" for name, what in commands.items()]
    lines += ["", "`hybridpar train` with no arguments trains the built-in demo (8 local processes, 300 steps)."]
    return "\n".join(lines)


def config_keys(width: int = 100) -> str:
    """Every config section and key with its default, as ``--section.key`` options (the
    ``[section]`` tables of a ``--config`` TOML file take the same keys)."""
    cfg = Config()
    out = ["config keys (--section.key VALUE, or key = value under [section] in --config FILE); defaults shown:"]
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        items = [f"{f.name}={getattr(values, f.name)!r}" for f in dataclasses.fields(values)]
        out.append(f"  [{section.name}]")
        out += textwrap.wrap("  ".join(items), width, initial_indent="    ", subsequent_indent="    ",
                             break_long_words=False, break_on_hyphens=False)
    out.append("what each key means: docs/reference/config.md")
    return "\n".join(out)
