"""Typed settings with atomic cross-process storage and clear precedence."""

from omlx_core.settings.edit import (
    activate_profile,
    discard_working,
    reset_settings,
    save_working,
    set_setting,
    unset_setting,
)
from omlx_core.settings.effective import EffectiveSettings, Resolved, load_settings
from omlx_core.settings.schema import BY_KEY, SETTINGS, Setting, lookup

__all__ = [
    "BY_KEY", "SETTINGS", "EffectiveSettings", "Resolved", "Setting", "activate_profile",
    "discard_working", "load_settings", "lookup", "reset_settings", "save_working",
    "set_setting", "unset_setting",
]
