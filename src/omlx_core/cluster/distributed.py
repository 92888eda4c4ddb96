"""`omlx serve --distributed`: verify the group afresh, then launch the sharded model on it.

Refused unless `cluster.enabled`. The model must be one mlx-lm can shard (tensor parallel
or pipeline) and must sit at the same path on every machine, as `mlx.launch` runs one
command line everywhere. Verification is never skipped and never taken from a record.
"""

import signal
import subprocess
import sys
from pathlib import Path

from omlx_core.cluster import inventory, launch
from omlx_core.cluster.keys import controller_pair
from omlx_core.cluster.verify import verify
from omlx_core.errors import InputError, OmlxError


def check_shardable(path: Path) -> str:
    """`tensor` or `pipeline`, or an error naming the model type."""
    from mlx_lm.utils import load_model

    model, config = load_model(Path(path), lazy=True, strict=False)
    if hasattr(model, "shard"):
        return "tensor"
    if hasattr(model, "model") and hasattr(model.model, "pipeline"):
        return "pipeline"
    raise OmlxError(f"{path}: mlx-lm cannot shard model type {config.get('model_type')!r} (neither tensor nor "
                    "pipeline parallel); serve it on one machine without --distributed")


def serve_distributed(home: Path, settings, model_path: Path, host: str, port: int, name: str) -> int:
    if not settings["cluster.enabled"]:
        raise InputError("serve --distributed is experimental and off: enable it with "
                         "`omlx settings set cluster.enabled true`")
    sharding = check_shardable(model_path)
    report = verify(home, settings)
    if not report.ok:
        raise OmlxError(f"not starting distributed serving, verification failed: {report.failure()}")
    workers = inventory.workers(home)
    group = launch.ranks(home, launch.controller_ip(settings, workers), workers)
    print(f"omlx: verified {len(group)} ranks ({report.backend}); launching {name} ({sharding} parallel)",
          file=sys.stderr, flush=True)
    process = launch.start(home, group, workers, controller_pair(home), report.backend,
                           int(settings["cluster.ring_port"]), "omlx_core.cluster.rank",
                           ["--model", str(model_path), "--name", name, "--backend", report.backend,
                            "--host", host, "--port", str(port)], float(settings["cluster.verify_timeout_s"]),
                           stdin=subprocess.DEVNULL)
    def interrupted(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)  # a service manager's stop must stop the ranks too
    try:
        return process.wait()
    except KeyboardInterrupt:
        launch.stop(process)
        return 130
