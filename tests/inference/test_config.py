"""Engine settings are validated: a value of the wrong type or out of range stops a node at start with a
line naming the setting, before anything loads."""

import os
import subprocess
import sys

import pytest

from inference.config import BadEngineSetting, EngineConfig, engine_config
from tests.conftest import ROOT


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"N_CTX": "abc"}, "N_CTX='abc': Input should be a valid integer"),
        ({"MAX_CONCURRENT": "0"}, "MAX_CONCURRENT='0': Input should be greater than or equal to 1"),
        ({"TOP_P": "1.5"}, "TOP_P='1.5': Input should be less than or equal to 1"),
        ({"KV_UNIFIED": "maybe"}, "KV_UNIFIED='maybe': Input should be a valid boolean"),
        ({"FLASH_ATTN": "yes"}, "FLASH_ATTN='yes': Input should be 'auto', 'on' or 'off'"),
        ({"FLASH_ATTN": "on"}, "FLASH_ATTN='on': Value error, flash attention makes a session's output depend"),
    ],
)
def test_a_bad_setting_is_named(monkeypatch, env, says):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(BadEngineSetting, match="Bad engine setting: ") as refused:
        engine_config()
    assert says in str(refused.value)


def test_settings_come_from_the_environment_and_keywords_win(monkeypatch):
    monkeypatch.setenv("N_CTX", "2048")
    monkeypatch.setenv("KV_UNIFIED", "on")
    config = EngineConfig(MAX_CONCURRENT=3)
    assert (config.N_CTX, config.KV_UNIFIED, config.MAX_CONCURRENT) == (2048, True, 3)
    smaller = config.replace(N_CTX=512)
    assert (smaller.N_CTX, smaller.KV_UNIFIED, config.N_CTX) == (512, True, 2048)
    with pytest.raises(ValueError, match="N_CTX"):
        config.replace(N_CTX=0)


def test_a_node_with_a_bad_setting_stops_at_start_with_one_line():
    env = os.environ | {"N_CTX": "abc", "MAX_CONCURRENT": "0", "DEBUG": "on", "SECRET_KEY": "test-only"}
    node = subprocess.run(
        [sys.executable, "manage.py", "run_node", "--name", "bad"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert node.returncode != 0
    assert "Bad engine setting: N_CTX='abc'" in node.stderr and "MAX_CONCURRENT='0'" in node.stderr
    assert "Traceback" not in node.stderr


@pytest.mark.parametrize(
    ("settings", "flash_attn"),
    [
        ({}, "off"),  # BATCH_INVARIANT by default
        ({"BATCH_INVARIANT": False}, "auto"),  # llama.cpp's choice
        ({"BATCH_INVARIANT": False, "FLASH_ATTN": "on"}, "on"),
        ({"FLASH_ATTN": "off"}, "off"),
    ],
)
def test_flash_attention_is_off_while_batches_are_invariant(settings, flash_attn):
    assert EngineConfig(**settings).flash_attn == flash_attn
