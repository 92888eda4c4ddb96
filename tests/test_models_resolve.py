"""Naming models: clear errors for what is not a loadable checkpoint."""

import json

import pytest

from omlx_core.errors import InputError
from omlx_core.models.resolve import locate, resolve

from conftest import run_omlx


def test_missing_path(home, tmp_path):
    with pytest.raises(InputError, match="not found"):
        resolve(str(tmp_path / "nope"), home)


def test_directory_without_config(home, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json"):
        resolve(str(tmp_path / "empty"), home)


def test_unsupported_model_type(home, tmp_path):
    model = tmp_path / "odd"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    with pytest.raises(InputError, match="'no_such_arch' is not supported"):
        resolve(str(model), home)


def test_gguf_file_gets_an_import_hint(home, tmp_path):
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF")
    with pytest.raises(InputError, match="import-gguf"):
        resolve(str(file), home)


def test_external_paths_get_distinct_settings_keys(home, tmp_path):
    (tmp_path / "a" / "model").mkdir(parents=True)
    (tmp_path / "b" / "model").mkdir(parents=True)
    first, second = locate(str(tmp_path / "a" / "model"), home), locate(str(tmp_path / "b" / "model"), home)
    assert first.name == second.name == "model" and first.key != second.key


def test_cli_info_on_a_bad_model_exits_2(home, tmp_path):
    result = run_omlx(home, "models", "info", str(tmp_path / "missing"))
    assert result.returncode == 2 and "not found" in result.stderr


def test_default_imports_the_embedded_model_once(home):
    first = resolve("default", home)
    assert first.embedded and (first.path / "config.json").is_file()
    stamp = (first.path / "config.json").stat().st_mtime_ns
    again = resolve("default", home)
    assert again.path == first.path and (again.path / "config.json").stat().st_mtime_ns == stamp
    listed = json.loads(run_omlx(home, "models", "list", "--json", check=True).stdout)["models"]
    assert [m["name"] for m in listed] == ["SmolLM2-135M-Instruct"] and listed[0]["model_type"] == "llama"
