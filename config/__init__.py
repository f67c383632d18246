"""Settings: the lowest layer; every other package imports from here."""

from config.settings import Settings, SettingsError, load_settings, masked_url

__all__ = ["Settings", "SettingsError", "load_settings", "masked_url"]
