"""`kvcore serve`'s setting flags, derived from the fields of ServiceConfig.

Each scalar setting is one field, declared with its help and ``--help`` group
(:data:`kvcore.config.SETTINGS`); this module makes its flag and nothing else::

    field  lease_timeout_s: Annotated[float, _setting(Group.LIMITS, "seconds without
               a request ...", aliases=("--lease-timeout",))] = 10.0
    flag   --lease-timeout-s SECONDS, --lease-timeout SECONDS     (this module)
               under "limits": "seconds without a request ... (default: 10)"
    env    KVCORE_LEASE_TIMEOUT_S=5                              (config.apply_env)
    TOML   lease_timeout_s = 5.0                                 (msgspec)

* The flag is ``--`` and the field's name, ``-`` for ``_``; the aliases its declaration
  keeps are earlier spellings, still accepted.
* A switch (a bool setting) off by default is a flag that turns it on; one on by default
  also has a ``--no-`` form that turns it off.
* Every other flag takes text, which :func:`given` converts as the setting's
  ``KVCORE_<NAME>`` variable is converted (:meth:`~kvcore.config.Setting.convert`): a bad
  value is a BadRequest naming the flag and the value, as a bad variable is.
* A flag not given is None in the namespace and leaves the environment's and the file's
  value: the default is the field's, shown in ``--help`` and never applied here.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from kvcore.config import SETTINGS, Group, Setting

# A value's metavar unless one is declared: by the unit its field's name ends in, else
# argparse's (the name in capitals).
UNIT_METAVARS = {"_s": "SECONDS", "_bytes": "BYTES", "_file": "FILE", "_dir": "DIR"}


def add_groups(parser: argparse.ArgumentParser) -> dict[Group, argparse._ArgumentGroup]:
    """One ``--help`` section per :class:`~kvcore.config.Group`, in its order: its name in
    lower case ("limits"), and what it holds."""
    return {group: parser.add_argument_group(group.name.lower(), group.value) for group in Group}


def add_setting_flags(groups: Mapping[Group, argparse._ArgumentGroup]) -> None:
    """The flag of every setting of :data:`~kvcore.config.SETTINGS`, each in its group, in
    the order the fields are declared."""
    for setting in SETTINGS:
        _add(groups[setting.spec.group], setting)


def _add(group: argparse._ArgumentGroup, setting: Setting) -> None:
    names = (setting.flag, *setting.spec.aliases)
    if _declared(setting) is bool:
        action = argparse.BooleanOptionalAction if setting.default else "store_true"
        group.add_argument(
            *names, dest=setting.name, action=action, default=None, help=_help(setting)
        )
        return
    group.add_argument(
        *names,
        dest=setting.name,
        default=None,
        metavar=_metavar(setting),
        choices=setting.spec.choices or None,
        help=_help(setting),
    )


def _declared(setting: Setting) -> Any:
    """The field's type without its ``Annotated`` declaration (``int | None`` stays one)."""
    return getattr(setting.type, "__origin__", setting.type)


def _metavar(setting: Setting) -> str | None:
    """None where argparse's own reads best: the choices, or the setting's name."""
    if setting.spec.choices:
        return None
    unit = next((m for s, m in UNIT_METAVARS.items() if setting.name.endswith(s)), None)
    return setting.spec.metavar or unit


def _help(setting: Setting) -> str:
    """The declared help, and the field's default unless the help says it (a switch off by
    default says nothing: its flag turns it on). ``%`` escaped for argparse."""
    text = setting.help.replace("%", "%%")
    if "default" in text or setting.default is False:
        return text
    return f"{text} (default: {_shown(setting)})"


def _shown(setting: Setting) -> str:
    """The field's default as ``--help`` shows it: as its text form writes it (a mode in
    octal), switches on or off, byte counts also in MiB, floats without a needless ``.0``."""
    value = setting.default
    if setting.spec.text is not None:
        return setting.spec.text.show(value)
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "":
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    mib = 1 << 20
    if setting.name.endswith("_bytes") and isinstance(value, int) and value % mib == 0:
        return f"{value} = {value // mib} MiB"
    return str(value)


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings whose flags ``args`` holds, as their fields' values; flags not given
    (None) are absent. BadRequest naming the flag and its text if a value does not convert."""
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        raw = getattr(args, setting.name, None)
        if raw is None:
            continue
        values[setting.name] = setting.convert(setting.flag, raw) if isinstance(raw, str) else raw
    return values
