"""Errors that carry their exit code, so every caller reports them the same way."""


class OmlxError(Exception):
    """The work failed (exit code 1). The message is one line a user can act on."""

    exit_code = 1


class InputError(OmlxError):
    """Bad usage or bad input: unknown key, bad value, missing file (exit code 2)."""

    exit_code = 2
