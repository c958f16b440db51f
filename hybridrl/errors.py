"""User-facing errors: the app prints these as one short line (no traceback) and exits non-zero."""


class HybridRLError(Exception):
    """An error caused by the user's input (config, files, data); its message says what to change."""


class ConfigError(HybridRLError):
    """A config value is invalid; the message names the full key (e.g. `trainer.lr`)."""
