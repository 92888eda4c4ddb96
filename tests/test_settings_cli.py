"""`omlx settings` as scripts use it: precedence, profiles, and exit-2 errors that help."""

import json

import pytest

from omlx_core.errors import InputError
from omlx_core.settings import load_settings, save_working, set_setting
from omlx_core.units import parse_count, parse_memory

from conftest import omlx_env, run_omlx


def test_precedence_cli_over_env_over_model_over_file_over_default(home):
    set_setting(home, "server.port", "9000")
    set_setting(home, "prefill.chunk_size", "1k")
    set_setting(home, "prefill.chunk_size", "4k", model_key="m")
    settings = load_settings(home, "m", environ={})
    assert settings["server.port"] == 9000 and settings.resolved["server.port"].source == "file"
    assert settings["prefill.chunk_size"] == 4096 and settings.resolved["prefill.chunk_size"].source == "model"
    assert settings["server.max_queue"] == 64 and settings.resolved["server.max_queue"].source == "default"
    env = {"OMLX_SERVER_PORT": "7000", "OMLX_PREFILL_CHUNK_SIZE": "512"}
    settings = load_settings(home, "m", environ=env)
    assert settings["server.port"] == 7000 and settings["prefill.chunk_size"] == 512
    assert settings.resolved["server.port"].where == "OMLX_SERVER_PORT"
    settings = load_settings(home, "m", environ=env, cli={"server.port": 6000})
    assert settings["server.port"] == 6000 and settings.resolved["server.port"].source == "cli"


def test_show_effective_names_each_source(home):
    run_omlx(home, "settings", "set", "server.port", "9001", check=True)
    result = run_omlx(home, "settings", "show", "--effective", "--json",
                      env=omlx_env(home, OMLX_SERVER_HOST="0.0.0.0"), check=True)
    shown = json.loads(result.stdout)
    assert shown["server.port"] == {"value": 9001, "source": "file", "where": str(home / "settings.json")}
    assert shown["server.host"]["source"] == "env" and shown["server.host"]["where"] == "OMLX_SERVER_HOST"
    assert shown["server.max_queue"]["source"] == "default"


def test_staging_never_changes_the_active_profile_until_saved(home):
    set_setting(home, "prefill.chunk_size", "2k", model_key="m")
    set_setting(home, "prefill.chunk_size", "8k", model_key="m", stage=True)
    assert load_settings(home, "m", environ={})["prefill.chunk_size"] == 2048
    assert load_settings(home, "m", environ={}, use_working=True)["prefill.chunk_size"] == 8192
    assert save_working(home, "m", "tuned") == "tuned"
    settings = load_settings(home, "m", environ={})
    assert settings["prefill.chunk_size"] == 8192
    assert settings.resolved["prefill.chunk_size"].where.endswith("[tuned]")
    document = json.loads((home / "model-settings" / "m.json").read_text())
    assert document["profiles"]["default"] == {"prefill": {"chunk_size": 2048}}
    assert "working" not in document


def test_model_profiles_through_the_cli(home, tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    run_omlx(home, "settings", "set", "prefill.chunk_size", "1k", "--model", str(model), check=True)
    run_omlx(home, "settings", "set", "prefill.chunk_size", "2k", "--model", str(model), "--stage", check=True)
    get = run_omlx(home, "settings", "get", "prefill.chunk_size", "--model", str(model), check=True)
    assert get.stdout.strip() == "1024"
    run_omlx(home, "settings", "save", "--model", str(model), "--profile", "fast", check=True)
    get = run_omlx(home, "settings", "get", "prefill.chunk_size", "--model", str(model), check=True)
    assert get.stdout.strip() == "2048"
    run_omlx(home, "settings", "use", "default", "--model", str(model), check=True)
    get = run_omlx(home, "settings", "get", "prefill.chunk_size", "--model", str(model), check=True)
    assert get.stdout.strip() == "1024"


@pytest.mark.parametrize(
    "args, fragments",
    [
        (("set", "server.prot", "1"), ["unknown setting 'server.prot'", "server.port"]),
        (("set", "server.port", "abc"), ["server.port", "'abc'", "an integer in [1, 65535]"]),
        (("set", "server.port", "70000"), ["server.port", "70000"]),
        (("set", "logging.level", "loud"), ["logging.level", "one of debug, info, warning, error"]),
        (("set", "prefill.lanes", "gpu,tpu"), ["prefill.lanes", "gpu, cpu, ane"]),
        (("set", "memory.hard_watermark", "1.5"), ["memory.hard_watermark", "memory size"]),
        (("get", "prefil.chunk_size"), ["prefill.chunk_size"]),
        (("set", "server.port", "1", "--model", "no-such-model"), ["no-such-model", "not found"]),
        (("set", "server.port", "1", "--stage"), ["--model"]),
    ],
)
def test_bad_keys_and_values_exit_2_with_one_helpful_line(home, args, fragments):
    result = run_omlx(home, "settings", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("omlx: error:")
    for fragment in fragments:
        assert fragment in lines[0]
    assert not (home / "settings.json").exists()


def test_bad_environment_value_is_named(home):
    result = run_omlx(home, "settings", "get", "server.port", env=omlx_env(home, OMLX_SERVER_PORT="x"))
    assert result.returncode == 2 and "OMLX_SERVER_PORT" in result.stderr
    result = run_omlx(home, "settings", "validate", env=omlx_env(home, OMLX_SERVER_PORT="x"))
    assert result.returncode == 2 and "OMLX_SERVER_PORT" in result.stdout


def test_reset_keeps_a_copy_and_unset_falls_back(home):
    run_omlx(home, "settings", "set", "server.port", "9002", check=True)
    run_omlx(home, "settings", "set", "server.max_queue", "5", check=True)
    run_omlx(home, "settings", "unset", "server.port", check=True)
    assert run_omlx(home, "settings", "get", "server.port", check=True).stdout.strip() == "8000"
    run_omlx(home, "settings", "reset", check=True)
    assert json.loads((home / "settings.json").read_text()) == {}
    backups = list(home.glob("settings.json.reset-*"))
    assert len(backups) == 1 and json.loads(backups[0].read_text()) == {"server": {"max_queue": 5}}


def test_secret_is_masked_in_show_but_get_returns_it(home):
    run_omlx(home, "settings", "set", "server.api_key", "sk-123", check=True)
    shown = run_omlx(home, "settings", "show", "--json", check=True).stdout
    assert "sk-123" not in shown and "****" in shown
    assert run_omlx(home, "settings", "get", "server.api_key", check=True).stdout.strip() == "sk-123"


def test_units():
    assert parse_count("16k") == 16384 and parse_count("4096") == 4096 and parse_count("1m") == 1024**2
    assert parse_memory("8GB") == 8 * 10**9 and parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("0.9") == 0.9
    for bad in ("abc", "1.5k5", "-1"):
        with pytest.raises(InputError):
            parse_count(bad)
    with pytest.raises(InputError):
        parse_memory("lots")
