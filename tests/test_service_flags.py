"""`kvcore serve`'s flags derive from ServiceConfig's fields: a setting is one field, and
its flag, its KVCORE_* variable and its TOML key give the same value; earlier flag
spellings still work; bad text is a BadRequest naming the flag, never a traceback."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvcore.cli import HelpFormatter
from kvcore.config import (
    EVENTS_FORMATS,
    LOG_FORMATS,
    LOG_LEVELS,
    SETTINGS,
    ServiceConfig,
    Setting,
    apply_env,
    load_toml,
)
from kvcore.daemon import flags
from kvcore.daemon.serve import add_arguments, build_config
from kvcore.errors import BadRequest

TABLES = ("pools", "tenants")  # the settings that are tables, not flags
# serve's flags that are no setting: where the settings come from, and an action of one start
OWN_FLAGS = {"config": "--config", "pool": "--pool", "takeover": "--takeover"}

# Every spelling `kvcore serve` accepted before its flags were derived from the fields.
EARLIER_FLAGS = frozenset(
    {
        "--endpoint",
        "--events",
        "--events-format",
        "--events-replay",
        "--lease-timeout",
        "--max-frame-bytes",
        "--max-batch",
        "--max-request-tokens",
        "--max-sessions",
        "--max-sessions-per-process",
        "--max-sessions-per-tenant",
        "--max-queued-bytes",
        "--fence-timeout",
        "--curve-secret-key-file",
        "--authorized-keys",
        "--insecure",
        "--insecure-remote-tier",
        "--allow-ephemeral",
        "--metrics-port",
        "--metrics-addr",
        "--metrics-socket",
        "--metrics-token-file",
        "--metrics-namespace-labels",
        "--no-metrics-namespace-labels",
        "--log-level",
        "--log-format",
        "--config",
        "--pool",
    }
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_arguments(parser)
    return parser


def _actions() -> dict[str, argparse.Action]:
    """The parser's actions by destination, --help aside."""
    return {a.dest: a for a in _parser()._actions if not isinstance(a, argparse._HelpAction)}


def _declared(setting: Setting) -> Any:
    return getattr(setting.type, "__origin__", setting.type)


def _sample(setting: Setting) -> tuple[str, object]:
    """Text for ``setting`` that is not its default, and the value it reads as."""
    if setting.spec.choices:
        return setting.spec.choices[-1], setting.spec.choices[-1]
    if setting.spec.text is not None:
        return "0640", 0o640
    by_type: dict[Any, tuple[str, object]] = {
        bool: ("false", False) if setting.default else ("true", True),
        int: ("3", 3),
        int | None: ("5", 5),
        float: ("0.5", 0.5),
        str: ("x", "x"),
    }
    return by_type[_declared(setting)]


def _flag_args(setting: Setting, text: str) -> list[str]:
    if _declared(setting) is not bool:
        return [setting.flag, text]
    return [setting.flag] if text == "true" else ["--no-" + setting.flag[2:]]


def test_a_setting_is_one_field_with_a_flag_a_variable_and_a_toml_key() -> None:
    """Every scalar field is a setting; its flag, KVCORE_<NAME> and TOML key each set it to
    the same value, and the flag's destination is the field's name."""
    fields = [f.name for f in msgspec.structs.fields(ServiceConfig) if f.name not in TABLES]
    assert [s.name for s in SETTINGS] == fields
    actions = _actions()
    for setting in SETTINGS:
        assert setting.flag in actions[setting.name].option_strings, setting.name
        text, value = _sample(setting)
        flagged = flags.given(_parser().parse_args(_flag_args(setting, text)))
        env = apply_env(ServiceConfig(), {setting.env: text})
        toml = msgspec.toml.decode(f"{setting.name} = {json.dumps(value)}", type=ServiceConfig)
        assert flagged == {setting.name: value}, setting.name
        assert getattr(env, setting.name) == getattr(toml, setting.name) == value, setting.name
        assert value != setting.default, setting.name  # so the sample proves something


def test_the_parser_has_no_flag_that_is_not_a_setting() -> None:
    """Each flag is a setting's derived flag, one of its declared aliases, or the ``--no-``
    form of a switch on by default; --config, --pool and --takeover aside."""
    settings = {s.name: s for s in SETTINGS}
    for dest, action in _actions().items():
        if dest in OWN_FLAGS:
            assert action.option_strings == [OWN_FLAGS[dest]]
            continue
        setting = settings[dest]  # KeyError: a flag that is no field
        spellings = {setting.flag, *setting.spec.aliases}
        if setting.default is True:
            spellings |= {"--no-" + s[2:] for s in spellings}
        assert set(action.option_strings) == spellings, dest
        assert action.default is None, f"{dest}: a flag not given must leave env and TOML"


def test_every_earlier_spelling_still_sets_its_setting(tmp_path: Path) -> None:
    spellings = {s for a in _parser()._actions for s in a.option_strings}
    assert spellings >= EARLIER_FLAGS
    keys = tmp_path / "clients"
    args = ["--lease-timeout", "3", "--fence-timeout", "5", "--authorized-keys", str(keys)]
    config = build_config(_parser().parse_args(args))
    assert (config.lease_timeout_s, config.fence_timeout_s) == (3.0, 5.0)
    assert config.authorized_keys_dir == str(keys)
    derived = ["--lease-timeout-s", "3", "--fence-timeout-s", "5", "--authorized-keys-dir", "k"]
    assert flags.given(_parser().parse_args(derived)) == {
        "lease_timeout_s": 3.0,
        "fence_timeout_s": 5.0,
        "authorized_keys_dir": "k",
    }


@pytest.mark.parametrize("name", ["insecure", "insecure_remote_tier", "allow_ephemeral"])
def test_a_switch_flag_turns_its_setting_on_and_its_absence_leaves_env_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    flag = "--" + name.replace("_", "-")
    toml = tmp_path / "kvcore.toml"
    toml.write_text(f"{name} = true\n")
    monkeypatch.delenv("KVCORE_" + name.upper(), raising=False)
    assert getattr(build_config(_parser().parse_args(["--config", str(toml)])), name)
    assert getattr(build_config(_parser().parse_args([flag])), name)
    assert not getattr(build_config(_parser().parse_args([])), name)
    monkeypatch.setenv("KVCORE_" + name.upper(), "false")
    assert not getattr(build_config(_parser().parse_args(["--config", str(toml)])), name)
    assert getattr(build_config(_parser().parse_args([flag])), name)  # flag > env


def test_namespace_labels_turn_off_and_on_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for env, argv, expected in (
        ("true", ["--no-metrics-namespace-labels"], False),
        ("false", ["--metrics-namespace-labels"], True),
        ("false", [], False),
    ):
        monkeypatch.setenv("KVCORE_METRICS_NAMESPACE_LABELS", env)
        config = build_config(_parser().parse_args(argv))
        assert config.metrics_namespace_labels is expected, (env, argv)


@pytest.mark.parametrize("text", ["0660", "0o660", "660", "0O660"])
def test_socket_mode_is_octal_on_the_flag_and_in_the_environment(tmp_path: Path, text: str) -> None:
    assert flags.given(_parser().parse_args(["--socket-mode", text])) == {"socket_mode": 0o660}
    assert apply_env(ServiceConfig(), {"KVCORE_SOCKET_MODE": text}).socket_mode == 0o660
    toml = tmp_path / "kvcore.toml"  # a mode wider than 0600 needs tenants
    toml.write_text('socket_mode = 0o600\n[[tenants]]\nname = "alice"\nuids = [1001]\n')
    args = _parser().parse_args(["--config", str(toml), "--socket-mode", text])
    assert build_config(args).socket_mode == 0o660


@pytest.mark.parametrize("text", ["rw-rw----", "0999", "", "06600", "-660", "0x1b0", "٦٦٠"])
def test_a_bad_socket_mode_names_the_flag_or_variable_and_the_value(text: str) -> None:
    with pytest.raises(BadRequest, match=f"--socket-mode={text!r}: not an octal file mode"):
        build_config(_parser().parse_args(["--socket-mode", text]))
    with pytest.raises(BadRequest, match=f"KVCORE_SOCKET_MODE={text!r}"):
        apply_env(ServiceConfig(), {"KVCORE_SOCKET_MODE": text})


def test_the_new_flags_override_the_environment_which_overrides_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "kvcore.toml"
    toml.write_text("events_buffer_bytes = 1024\nsocket_mode = 0o600\n")
    monkeypatch.setenv("KVCORE_EVENTS_BUFFER_BYTES", "2048")
    monkeypatch.setenv("KVCORE_SOCKET_MODE", "0400")
    config = build_config(_parser().parse_args(["--config", str(toml)]))
    assert (config.events_buffer_bytes, config.socket_mode) == (2048, 0o400)
    argv = ["--config", str(toml), "--events-buffer-bytes", "4096", "--socket-mode", "0200"]
    config = build_config(_parser().parse_args(argv))
    assert (config.events_buffer_bytes, config.socket_mode) == (4096, 0o200)
    with pytest.raises(BadRequest, match="events_buffer_bytes"):  # validated at the end
        build_config(_parser().parse_args(["--events-buffer-bytes", "0"]))


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--max-batch", "many"], "--max-batch='many'"),
        (["--lease-timeout", "soon"], "--lease-timeout-s='soon'"),
        (["--metrics-port", "http"], "--metrics-port='http'"),
        (["--events-buffer-bytes", "16MiB"], "--events-buffer-bytes='16MiB'"),
    ],
)
def test_a_flag_that_does_not_convert_is_a_bad_request_naming_it(
    argv: list[str], named: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        build_config(_parser().parse_args(argv))
    assert named in str(refused.value)


def test_the_daemon_refuses_bad_flag_text_with_a_message_not_a_traceback() -> None:
    command = [sys.executable, "-m", "kvcore.daemon", "--socket-mode", "rw"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("kvcore serve: --socket-mode='rw'"), done.stderr
    assert "Traceback" not in done.stderr


def test_choices_are_the_values_the_schema_allows() -> None:
    actions = _actions()
    for name, allowed in (
        ("events_format", EVENTS_FORMATS),
        ("log_level", LOG_LEVELS),
        ("log_format", LOG_FORMATS),
    ):
        assert tuple(actions[name].choices or ()) == allowed
        for value in allowed:
            ServiceConfig(**{name: value}).validate()
        with pytest.raises(BadRequest):
            ServiceConfig(**{name: "other"}).validate()
    with pytest.raises(SystemExit):
        _parser().parse_args(["--log-level", "LOUD"])


def test_help_lists_the_flags_in_their_groups_with_the_fields_defaults() -> None:
    parser = _parser()
    text = parser.format_help()
    titles = [g.title for g in parser._action_groups]
    assert titles == ["positional arguments", "options", "where", "limits", "access", "observing"]
    assert text.index("--config") < text.index("--endpoint") < text.index("--lease-timeout-s")
    groups = {g.title: g for g in parser._action_groups}
    for setting in SETTINGS:
        group = groups[setting.spec.group.name.lower()]
        action = next(a for a in group._group_actions if a.dest == setting.name)
        help_text = parser._get_formatter()._expand_help(action)
        assert setting.default is False or "default" in help_text, setting.name
    for shown in ("(default: 10)", "(default: 0600)", "16777216 = 16 MiB", "(default: on)"):
        assert shown in " ".join(text.split()), shown


def test_the_file_and_the_flags_read_a_mode_alike(tmp_path: Path) -> None:
    """TOML gives socket_mode as an int (0o660); the flag's "0660" is the same mode."""
    toml = tmp_path / "kvcore.toml"
    toml.write_text("socket_mode = 0o660\n")
    assert (
        load_toml(toml).socket_mode
        == flags.given(_parser().parse_args(["--socket-mode", "0660"]))["socket_mode"]
    )
