"""The scheduler's settings (``SchedulerConfig``): the exact refusal of each bad setting, the lowest good
ones, the keep-free watermark with its action's headroom, and a round trip through ``to_dict``."""

from __future__ import annotations

import pytest

from kvledger.errors import ConfigError
from kvledger.scheduler import (
    SchedulerConfig,
)
from kvledger.scheduler.config import SCHEDULER_KEYS


@pytest.mark.parametrize(("changes", "message"), [
    ({"max_running": 0}, "max_running must be an integer >= 1, got 0"),
    ({"writeback_blocks": -1}, "writeback_blocks must be an integer >= 0, got -1"),
    ({"headroom_blocks": True}, "headroom_blocks must be an integer >= 0, got True"),
    ({"offload_prefixes": 1}, "offload_prefixes must be True or False, got 1"),
    ({"restore_ahead": "yes"}, "restore_ahead must be True or False, got 'yes'"),
    ({"watermark": 1}, "watermark must be in [0, 1), got 1"),
    ({"watermark": -0.1}, "watermark must be in [0, 1), got -0.1"),
    ({"predicted_quantile": 0}, "predicted_quantile must be in (0, 1], got 0"),
    ({"predicted_quantile": 1.5}, "predicted_quantile must be in (0, 1], got 1.5"),
    ({"predicted_quantile": True}, "predicted_quantile must be in (0, 1], got True"),
    ({"predicted_quantile": "0.5"}, "predicted_quantile must be in (0, 1], got '0.5'"),
    ({"predicted_quantile": float("nan")}, "predicted_quantile must be in (0, 1], got nan"),
])
def test_a_bad_scheduler_setting_is_refused_with_its_exact_message(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**changes)
    assert str(err.value) == message


def test_the_lowest_good_settings_are_accepted() -> None:
    cfg = SchedulerConfig(writeback_blocks=0, headroom_blocks=0, watermark=0, predicted_quantile=1,
                          offload_prefixes=True, restore_ahead=True, max_running=1)
    assert (cfg.writeback_blocks, cfg.watermark, cfg.predicted_quantile) == (0, 0, 1)


def test_keep_free_is_the_watermark_share_plus_the_headroom_of_its_action() -> None:
    assert SchedulerConfig(policy="incremental", watermark=0.1).keep_free(100) == 10
    assert SchedulerConfig(policy="incremental", watermark=0.25).keep_free(10) == 2  # rounded down
    assert SchedulerConfig(policy="full", watermark=0.25).keep_free(100) == 0  # exact: nothing to protect
    assert SchedulerConfig(policy="incremental", watermark=0, headroom_blocks=5).keep_free(100) == 0
    assert SchedulerConfig(policy="incremental", watermark=0.1, headroom_blocks=5,
                           on_growth_failure="headroom").keep_free(100) == 15


def test_to_dict_round_trips_every_setting() -> None:
    cfg = SchedulerConfig(policy="predicted", victim="priority", max_running=7, watermark=0.05,
                          offload_prefixes=True, writeback_blocks=3)
    d = cfg.to_dict()
    assert d["policy"] == "predicted" and d["victim"] == "priority" and d["max_running"] == 7
    assert d["watermark"] == 0.05 and d["offload_prefixes"] is True and d["writeback_blocks"] == 3
    assert list(d) == list(SCHEDULER_KEYS)
    assert SchedulerConfig(**d) == cfg
