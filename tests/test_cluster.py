"""`omlx cluster` against a real sshd on loopback, a real controller (`omlx serve`) and real
`mlx.launch` ranks: enrollment, refusals, hardening, rotation, verification, distributed serving."""

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from conftest import free_port, omlx_env, run_omlx
from sshd import Sshd, available

# CI sets OMLX_TEST_REQUIRE_SSHD=1 so that a missing sshd fails there instead of skipping.
pytestmark = pytest.mark.skipif(not available() and os.environ.get("OMLX_TEST_REQUIRE_SSHD") != "1",
                                reason="needs Debian's openssh-server (./scripts/test installs it as root)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_server):
    from omlx_core.models.testing import build_tiny_model

    root = tmp_path_factory.mktemp("cluster")
    model = build_tiny_model("llama", root / "tiny-llama", dtype="float32")  # sharded sums reorder: keep greedy stable
    controller = root / "controller"
    controller.mkdir()
    ring_port = free_port()
    env = omlx_env(controller, OMLX_CLUSTER_VERIFY_TIMEOUT_S="8", OMLX_CLUSTER_RING_PORT=str(ring_port))
    server = start_server(controller, "--model", str(model), env=env)
    sshd = Sshd(root / "sshd")
    worker = root / "worker"
    worker.mkdir()
    yield SimpleNamespace(root=root, model=model, controller=controller, env=env, server=server, sshd=sshd,
                          worker=worker, worker_env=omlx_env(worker, **sshd.worker_env()))
    sshd.stop()


def invite(c, ttl="10m") -> str:
    result = run_omlx(c.controller, "cluster", "invite", "--ttl", ttl, "--json", env=c.env, check=True)
    return json.loads(result.stdout)["code"]


def join(c, code, *extra, env=None):
    return run_omlx(c.worker, "cluster", "join", c.server.url, "--code", code, "--name", "w1", "--json", *extra,
                    env=env or c.worker_env)


def controller_key(c) -> Path:
    from omlx_core.cluster.keys import controller_pair

    return controller_pair(c.controller, create=False).private


def authorized(c) -> Path:
    return c.sshd.ssh_dir / "authorized_keys"


@pytest.fixture(scope="module")
def joined(cluster):
    """The worker enrolled once, with an unrelated key line in authorized_keys before it."""
    other = cluster.root / "someone"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "someone@laptop", "-f", str(other)],
                   check=True)
    authorized(cluster).write_text(Path(str(other) + ".pub").read_text())
    result = join(cluster, invite(cluster))
    assert result.returncode == 0, result.stderr
    cluster.first_join = json.loads(result.stdout)
    cluster.other_line = Path(str(other) + ".pub").read_text()
    return cluster


def test_join_end_to_end_installs_a_restricted_key_and_the_controller_logs_in(joined):
    c = joined
    assert c.first_join["login"]["ok"], c.first_join
    lines = authorized(c).read_text().splitlines(keepends=True)
    assert lines[0] == c.other_line  # the user's own line, byte for byte
    assert len(lines) == 2 and lines[1].startswith('from="127.0.0.1",restrict,pty ssh-ed25519 ')
    assert oct(authorized(c).stat().st_mode & 0o777) == "0o600"
    assert oct(c.sshd.ssh_dir.stat().st_mode & 0o777) == "0o700"
    assert c.sshd.login(controller_key(c)).returncode == 0

    listed = json.loads(run_omlx(c.controller, "cluster", "list", "--json", env=c.env, check=True).stdout)
    (worker,) = listed["workers"]
    assert worker["name"] == "w1" and worker["ssh_port"] == c.sshd.port and worker["host_keys"]
    inventory = c.controller / "cluster" / "inventory.json"
    assert oct(inventory.stat().st_mode & 0o777) == "0o600"
    assert oct((c.controller / "cluster").stat().st_mode & 0o777) == "0o700"
    status = json.loads(run_omlx(c.controller, "status", "--json", env=c.env, check=True).stdout)["cluster"]
    assert status == {**status, "enabled": False, "workers": ["w1"]}
    exported = run_omlx(c.controller, "cluster", "export", env=c.env, check=True).stdout
    import tomllib

    assert tomllib.loads(exported)["workers"][0]["name"] == "w1"


def test_rejoin_updates_the_line_in_place(joined):
    c = joined
    before = authorized(c).read_text().splitlines()
    result = join(c, invite(c))
    assert result.returncode == 0, result.stderr
    after = authorized(c).read_text().splitlines()
    assert len(after) == len(before) == 2 and after[0] == before[0]
    workers = json.loads(run_omlx(c.controller, "cluster", "list", "--json", env=c.env, check=True).stdout)["workers"]
    assert [w["name"] for w in workers] == ["w1"]


def test_replayed_and_expired_codes_are_refused_before_anything_changes(joined):
    c = joined
    code = invite(c)
    claim = {"code": code, "name": "w1"}
    assert httpx.post(c.server.url + "/api/cluster/claim", json=claim, timeout=30).status_code == 200
    replay = httpx.post(c.server.url + "/api/cluster/claim", json=claim, timeout=30)
    assert replay.status_code == 403 and "already used" in replay.json()["error"]["message"]

    before = authorized(c).read_bytes()
    result = join(c, code)
    assert result.returncode == 1 and "already used" in result.stderr and "\n" not in result.stderr.strip()
    expired = invite(c, ttl="1s")
    time.sleep(1.5)
    result = join(c, expired)
    assert result.returncode == 1 and "expired" in result.stderr
    result = join(c, "omlx-not-a-real-code")
    assert result.returncode == 1 and "not recognised" in result.stderr
    assert authorized(c).read_bytes() == before
    stored = (c.controller / "cluster" / "invites.json").read_text()
    assert code not in stored and expired not in stored  # only salted hashes are kept


def test_symlinked_authorized_keys_or_ssh_dir_is_refused(joined, tmp_path):
    c = joined
    target = tmp_path / "elsewhere"
    target.write_text("precious\n")
    ssh_dir = tmp_path / "dot-ssh"
    ssh_dir.mkdir()
    (ssh_dir / "authorized_keys").symlink_to(target)
    env = {**c.worker_env, "OMLX_CLUSTER_SSH_DIR": str(ssh_dir)}
    result = join(c, invite(c), env=env)
    assert result.returncode == 1 and "symlink" in result.stderr, result.stderr
    assert target.read_text() == "precious\n"

    linked_dir = tmp_path / "linked-ssh"
    linked_dir.symlink_to(ssh_dir)
    result = join(c, invite(c), env={**c.worker_env, "OMLX_CLUSTER_SSH_DIR": str(linked_dir)})
    assert result.returncode == 1 and "symlink" in result.stderr


def test_verify_runs_ssh_versions_and_a_two_process_ring_all_sum(joined):
    c = joined
    result = run_omlx(c.controller, "cluster", "verify", "--json", env=c.env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert [s["name"] for s in report["workers"][0]["steps"]] == ["ssh", "versions"]
    assert report["collective"]["ok"] and "across 2 ranks: 3" in report["collective"]["detail"]


def test_distributed_serving_is_refused_unless_enabled(joined):
    c = joined
    result = run_omlx(c.controller, "serve", "--distributed", "--model", str(c.model), env=c.env)
    assert result.returncode == 2 and "cluster.enabled" in result.stderr


def test_distributed_serving_generates_the_same_greedy_tokens_as_one_machine(joined, start_server):
    c = joined
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    import mlx.core as mx
    import psutil

    model, tokenizer = load(str(c.model))
    prompt = [1, 5, 9, 14, 3, 7]
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12,
                                                 sampler=lambda x: mx.argmax(x, axis=-1))]
    server = start_server(c.controller, "--distributed", "--model", str(c.model),
                          env={**c.env, "OMLX_CLUSTER_ENABLED": "true"})
    try:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        eos = set(tokenizer.eos_token_ids)
        stop = next((i for i, t in enumerate(expected) if t in eos), len(expected))
        assert response.json()["choices"][0]["text"] == tokenizer.decode(expected[:stop])
        assert response.json()["usage"]["completion_tokens"] == min(len(expected), stop + 1)
        assert "rank 0 of 2" in server.log()
    finally:
        server.stop()  # SIGTERM, as a service manager stops it: the ranks must go with it

    def ranks_left():
        return [p.pid for p in psutil.process_iter(["cmdline"])
                if "omlx_core.cluster.rank" in " ".join(p.info["cmdline"] or [])]
    deadline = time.monotonic() + 15
    while ranks_left() and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not ranks_left()


def test_key_rotation_needs_confirmation_and_replaces_the_key_everywhere(joined):
    c = joined
    refused = run_omlx(c.controller, "cluster", "rotate-key", env=c.env)
    assert refused.returncode == 2 and "--confirm" in refused.stderr
    api = httpx.post(c.server.url + "/api/cluster/rotate-key", json={}, timeout=30)
    assert api.status_code == 400 and "confirm" in api.json()["error"]["message"]

    old_key = c.root / "old-key"
    old_key.write_bytes(controller_key(c).read_bytes())
    old_key.chmod(0o600)
    result = run_omlx(c.controller, "cluster", "rotate-key", "--confirm", "--json", env=c.env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["unpromoted"] == []
    assert c.sshd.login(controller_key(c)).returncode == 0
    denied = c.sshd.login(old_key)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    lines = authorized(c).read_text().splitlines()
    assert len(lines) == 2 and ":next" not in lines[1]


def test_failed_rotation_leaves_the_working_key_intact(joined):
    """Injected failure: a second enrolled worker whose sshd is down."""
    from omlx_core.cluster import inventory

    c = joined
    live = inventory.get(c.controller, "w1")
    dead = inventory.Worker(**{**live.__dict__, "name": "dead", "ssh_port": free_port(), "ssh_host": "127.0.0.2",
                               "worker_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDeadDeadDeadDeadDeadDeadDeadDeadDeadDeadDead",
                               "host_keys": []})
    inventory.enroll(c.controller, dead)
    try:
        key_before = controller_key(c).read_bytes()
        result = run_omlx(c.controller, "cluster", "rotate-key", "--confirm", env=c.env, timeout=120)
        assert result.returncode == 1 and "nothing was switched" in result.stderr and "dead" in result.stderr
        assert controller_key(c).read_bytes() == key_before
        assert c.sshd.login(controller_key(c)).returncode == 0
        assert ":next" not in authorized(c).read_text()
    finally:
        inventory.remove(c.controller, "dead")


def test_verify_fails_within_its_timeout_against_a_dead_or_hung_worker(joined):
    from omlx_core.cluster import inventory

    c = joined
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)  # accepts connections and never says a word
    live = inventory.get(c.controller, "w1")
    inventory.enroll(c.controller, inventory.Worker(**{**live.__dict__, "name": "hung", "ssh_host": "127.0.0.1",
                                                       "ssh_port": hung.getsockname()[1], "host_keys": [],
                                                       "worker_key": live.worker_key[:-8] + "AAAAhung"}))
    env = {**c.env, "OMLX_CLUSTER_VERIFY_TIMEOUT_S": "2"}
    try:
        start = time.monotonic()
        result = run_omlx(c.controller, "cluster", "verify", "hung", "--json", env=env, timeout=60)
        elapsed = time.monotonic() - start
        assert result.returncode == 1
        step = json.loads(result.stdout)["workers"][0]["steps"][0]
        assert not step["ok"] and ("did not answer within 2 s" in step["detail"] or "unreachable" in step["detail"])
        assert step["seconds"] < 4 and elapsed < 20
    finally:
        hung.close()
        inventory.remove(c.controller, "hung")

    c.sshd.stop()
    try:
        result = run_omlx(c.controller, "cluster", "verify", "--json", env=env, timeout=60)
        detail = json.loads(result.stdout)["workers"][0]["steps"][0]["detail"]
        assert result.returncode == 1 and "connection refused" in detail and "start sshd" in detail
    finally:
        c.sshd.start()


def test_an_unpaired_key_gets_pairing_guidance_not_a_trace(joined):
    c = joined
    saved = authorized(c).read_text()
    authorized(c).write_text(c.other_line)  # someone removed omlx's line
    try:
        result = run_omlx(c.controller, "cluster", "verify", env=c.env, timeout=60)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert "refused the controller key" in result.stderr and "omlx cluster invite" in result.stderr
        assert "omlx cluster join" in result.stderr
    finally:
        authorized(c).write_text(saved)


def test_nccl_transport_lines_tell_a_direct_link_from_sockets():
    from omlx_core.cluster.verify import nccl_links

    p2p = "host:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
    sockets = "host:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0\n"
    assert nccl_links(p2p) == (True, {"P2P/CUMEM/read"})
    assert nccl_links(p2p + sockets)[0] is False
    assert nccl_links("") == (True, set())


def test_names_of_this_machine_are_one_host_and_are_not_enrolled_twice(joined):
    from omlx_core.cluster import inventory
    from omlx_core.cluster.hosts import is_local_host, local_addresses
    from omlx_core.errors import OmlxError

    short = socket.gethostname().split(".")[0]
    for name in (short + ".local", socket.getfqdn(), "127.0.0.1", "localhost",
                 *sorted(a for a in local_addresses() if ":" not in a)):
        assert is_local_host(name), name
    assert not is_local_host("192.0.2.1")
    live = inventory.get(joined.controller, "w1")
    for alias in (short + ".local", "localhost"):
        twin = inventory.Worker(**{**live.__dict__, "name": "twin", "ssh_host": alias,
                                   "worker_key": live.worker_key[:-8] + "AAAAtwin"})
        with pytest.raises(OmlxError, match="already enrolled as 'w1'"):
            inventory.enroll(joined.controller, twin)
