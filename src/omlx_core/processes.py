"""Whether a process still runs: how crash leftovers (temp files, temp dirs) are told apart."""

import os


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True
