"""`omlx status` offline: what a user needs to know about this machine, as text and JSON."""

import json
import platform

from conftest import omlx_env, run_omlx


def test_status_json_is_one_document_with_the_machine_facts(home):
    result = run_omlx(home, "status", "--json", check=True)
    report = json.loads(result.stdout)  # nothing else on stdout
    import mlx.core as mx

    assert report["mlx_version"] == mx.__version__
    assert report["backend"] in ("metal", "cuda", "cpu")
    assert report["home"] == str(home)
    assert report["hardware_fingerprint"].startswith("hw-")
    assert report["memory"]["total_bytes"] > report["memory"]["available_bytes"] > 0
    assert report["settings_files"][0] == {"path": str(home / "settings.json"), "exists": False,
                                           "valid": True, "problem": None}
    lanes = {lane["name"]: lane for lane in report["lanes"]}
    assert set(lanes) == {"gpu", "cpu", "ane"}
    assert lanes["gpu"]["eligible"] and lanes["gpu"]["enabled"]
    assert lanes["cpu"]["enabled"] is False  # experimental: off until asked for
    if not (platform.system() == "Darwin" and platform.machine() == "arm64"):
        assert lanes["ane"] == {"name": "ane", "eligible": False, "enabled": False,
                                "reason": "requires macOS on Apple Silicon"}


def test_status_text_names_lanes_and_reasons(home):
    result = run_omlx(home, "status", check=True, env=omlx_env(home, COLUMNS="200"))
    assert "prefill lanes" in result.stdout and "ane" in result.stdout
    assert str(home) in result.stdout


def test_status_follows_settings_to_enable_the_cpu_lane(home):
    run_omlx(home, "settings", "set", "prefill.lanes", "gpu,cpu", check=True)
    run_omlx(home, "settings", "set", "prefill.cpu_sharing.enabled", "on", check=True)
    report = json.loads(run_omlx(home, "status", "--json", check=True).stdout)
    cpu = next(lane for lane in report["lanes"] if lane["name"] == "cpu")
    assert cpu["enabled"] is True


def test_home_option_beats_environment(home, tmp_path):
    other = tmp_path / "other"
    report = json.loads(run_omlx(home, "--home", str(other), "status", "--json", check=True).stdout)
    assert report["home"] == str(other)
