"""Settings are typed: a bad value is refused with the setting, the value and its source."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.settings import Settings, SettingsError, load_settings


@pytest.mark.parametrize(("line", "message"), [
    ('lease_s = "30"', "lease_s: '30' is not a number"),
    ("short_concurrency = 1.5", "short_concurrency: 1.5 is not an integer"),
    ('trust_remote_code = "yes"', "trust_remote_code: 'yes' is not true or false"),
    ('context_length = "8192"', "context_length: '8192' is not an integer or unset"),
    ('budgets = {B1 = "5"}', "budgets: {'B1': '5'} is not a table of integers"),
    ('aux_layer_ids = [1, "x"]', "aux_layer_ids: [1, 'x'] is not a list of integers"),
    ("tokenizer_path = 7", "tokenizer_path: 7 is not a string"),
])
def test_a_toml_value_of_the_wrong_type_names_the_file_and_the_setting(
        tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(line + "\n")
    with pytest.raises(SettingsError) as err:
        load_settings(path, env={})
    assert str(err.value).startswith(f"config file {path}: {message}")


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("DATAGEN_TRUST_REMOTE_CODE", "maybe", "'maybe' is not true or false"),
    ("DATAGEN_SHORT_CONCURRENCY", "lots", "'lots' is not an integer"),
    ("DATAGEN_LEASE_S", "soon", "'soon' is not a number"),
])
def test_an_environment_value_of_the_wrong_type_names_the_variable(
        name: str, raw: str, message: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(env={name: raw})
    assert str(err.value) == f"environment {name}: {message}"


def test_values_of_the_right_type_load_from_toml_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("lease_s = 12\nbudgets = {B1 = 5000}\naux_layer_ids = [1, 2, 3]\n")
    settings = load_settings(path, env={"DATAGEN_CONTEXT_LENGTH": "8192",
                                        "DATAGEN_TRUST_REMOTE_CODE": "true",
                                        "DATAGEN_API_KEY": ""})
    assert settings.lease_s == 12.0 and isinstance(settings.lease_s, float)
    assert settings.budgets == {"B1": 5000} and settings.aux_layer_ids == [1, 2, 3]
    assert settings.context_length == 8192 and settings.trust_remote_code is True
    assert settings.api_key is None
    assert load_settings(env={"DATAGEN_AUX_LAYER_IDS": "1,15,28"}).aux_layer_ids == [1, 15, 28]
    assert Settings() == load_settings(env={})


def test_server_dtype_is_one_of_the_dtypes_or_auto_and_reaches_the_extraction() -> None:
    from datagen.extraction.runner import extraction_config

    with pytest.raises(SettingsError, match="server_dtype: 'bf16' is not one of"):
        load_settings(env={"DATAGEN_SERVER_DTYPE": "bf16"})
    settings = load_settings(env={"DATAGEN_SERVER_DTYPE": "bfloat16"})
    assert extraction_config(settings).server_dtype == "bfloat16"


def test_recapture_share_is_a_share_and_reaches_the_extraction() -> None:
    from datagen.extraction.runner import extraction_config

    with pytest.raises(SettingsError, match="recapture_share: 1.5 must be between 0 and 1"):
        load_settings(env={"DATAGEN_RECAPTURE_SHARE": "1.5"})
    cfg = extraction_config(load_settings(env={"DATAGEN_RECAPTURE_SHARE": "0.2"}))
    assert (cfg.recapture_share, cfg.server_url) == (0.2, Settings().server_url)


def test_check_prompt_states_needs_check_states() -> None:
    with pytest.raises(SettingsError, match="check_prompt_states: true needs check_states"):
        load_settings(env={"DATAGEN_CHECK_PROMPT_STATES": "1", "DATAGEN_CHECK_STATES": "0"})
    assert load_settings(env={"DATAGEN_CHECK_PROMPT_STATES": "1"}).check_prompt_states


def test_the_stream_settings_are_checked_and_reach_the_extraction() -> None:
    from datagen.extraction.runner import extraction_config

    with pytest.raises(SettingsError, match="states_to: 'disk' is not one of"):
        load_settings(env={"DATAGEN_STATES_TO": "disk"})
    with pytest.raises(SettingsError, match="stream_resident_bytes: 0 must be"):
        load_settings(env={"DATAGEN_STREAM_RESIDENT_BYTES": "0"})
    with pytest.raises(SettingsError, match="stream_epoch: 2 needs states_to = 'stream'"):
        load_settings(env={"DATAGEN_STREAM_EPOCH": "2"})
    with pytest.raises(SettingsError, match="stream_epoch: 2 with extract_backend = 'captured'"):
        load_settings(env={"DATAGEN_STREAM_EPOCH": "2", "DATAGEN_STATES_TO": "stream",
                           "DATAGEN_EXTRACT_BACKEND": "captured"})
    settings = load_settings(env={"DATAGEN_STATES_TO": "stream", "DATAGEN_STREAM_EPOCH": "2",
                                  "DATAGEN_STREAM_RESIDENT_BYTES": "1000",
                                  "DATAGEN_OUTPUT_DIR": "/tmp/run"})
    cfg = extraction_config(settings)
    assert (cfg.states_to, cfg.epoch, cfg.stream_resident_bytes, cfg.stream_dir) == (
        "stream", 2, 1000, "/tmp/run/stream")
    assert cfg.redis_url == settings.redis_url
