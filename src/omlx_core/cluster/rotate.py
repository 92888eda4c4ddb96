"""Rotate the controller's key without ever losing access to a worker.

Only with explicit confirmation. The new pair is made off-path (a new generation beside
the current one); each worker gets it as a *pending* line, installed over SSH with the old
key, and a real login with the new key must then succeed on every worker. Only then does
the controller switch (one atomic pointer write) and each worker promote the pending
line over the old one. Any failure before the switch removes the pending lines and the
new pair: the working pair is untouched.
"""

from pathlib import Path

from omlx_core.cluster import inventory, ssh
from omlx_core.cluster.keys import controller_pair, discard, new_controller_generation, switch_controller_pair
from omlx_core.errors import InputError, OmlxError


def _authorize(home, worker, key, controller_id, *flags, stdin=None, timeout_s):
    command = ssh.remote_omlx(worker, "cluster", "authorize", "--controller-id", controller_id, *flags)
    return ssh.run(home, worker, key, command, timeout_s, stdin=stdin)


def rotate(home: Path, settings, confirm: bool) -> dict:
    if not confirm:
        raise InputError("rotate-key replaces the key every worker trusts: run it again with --confirm")
    timeout_s = float(settings["cluster.verify_timeout_s"])
    old = controller_pair(home)
    controller_id = inventory.controller_id(home)
    workers = inventory.workers(home)
    new = new_controller_generation(home)
    staged: list[inventory.Worker] = []
    try:
        for worker in workers:
            _authorize(home, worker, old, controller_id, "--pending", stdin=new.public_key() + "\n",
                       timeout_s=timeout_s)
            staged.append(worker)
            ssh.run(home, worker, new, ssh.remote_omlx(worker, "cluster", "probe", "--json"), timeout_s)
    except OmlxError as error:
        for worker in staged:
            try:
                _authorize(home, worker, old, controller_id, "--revoke", "--pending", timeout_s=timeout_s)
            except OmlxError:
                pass  # the pending line is inert until promoted; verify will still show the old key working
        discard(new)
        raise OmlxError(f"key rotation stopped, nothing was switched and the current key {old.fingerprint()} "
                        f"still works: {error}") from error
    switch_controller_pair(home, new)
    unpromoted = []
    for worker in workers:
        try:
            _authorize(home, worker, new, controller_id, "--promote", timeout_s=timeout_s)
        except OmlxError as error:
            unpromoted.append(f"{worker.name}: {error}")
    discard(old)
    return {"rotated": True, "old_key": old.private.parent.name, "new_key": new.fingerprint(),
            "workers": [w.name for w in workers], "unpromoted": unpromoted}
