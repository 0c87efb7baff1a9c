"""Pure logic: the configuration object and its one environment rule."""

import pytest

from gradsync.config import Config, load_config
from gradsync.errors import ConfigError


def test_precedence_keyword_over_environment_over_default():
    cfg = load_config({"timeout": 5.0}, {"GRADSYNC_TIMEOUT": "9", "GRADSYNC_CHUNK_BYTES": "0x1000"})
    assert cfg.timeout == 5.0
    assert cfg.chunk_bytes == 4096
    assert cfg.transport == Config().transport


@pytest.mark.parametrize("variable, value", [
    ("GRADSYNC_TIMEOUT", "soon"), ("GRADSYNC_TRANSPORT", "carrier-pigeon"),
    ("GRADSYNC_CHUNK_BYTES", "100"), ("GRADSYNC_CHECK_COLLECTIVES", "maybe"),
])
def test_bad_values_name_the_variable(variable, value):
    with pytest.raises(ConfigError, match=variable.removeprefix("GRADSYNC_").lower() + "|" + variable):
        load_config(environ={variable: value})


def test_unknown_variable_and_keyword_fail_loudly():
    with pytest.raises(ConfigError, match="GRADSYNC_TIMEOUTS"):
        load_config(environ={"GRADSYNC_TIMEOUTS": "3"})
    with pytest.raises(ConfigError, match="timeouts"):
        load_config({"timeouts": 3})


def test_identity_variables_are_not_settings():
    cfg = load_config(environ={"GRADSYNC_RANK": "3", "GRADSYNC_HOSTNAME": "h1"})
    assert cfg == Config()


def test_booleans():
    assert load_config(environ={"GRADSYNC_CHECK_COLLECTIVES": "off"}).check_collectives is False
    assert load_config(environ={"GRADSYNC_CHECK_COLLECTIVES": "1"}).check_collectives is True


def test_config_is_frozen():
    with pytest.raises(Exception):
        Config().timeout = 1


@pytest.mark.parametrize("text, value", [("4M", 4 << 20), ("64K", 64 << 10), ("2MiB", 2 << 20),
                                         ("1GB", 1 << 30), ("4096", 4096), ("0x400", 1024)])
def test_byte_sizes_take_binary_units(text, value):
    assert load_config(environ={"GRADSYNC_SHM_SLOT_BYTES": text}).shm_slot_bytes == value


def test_a_bad_size_names_the_variable():
    with pytest.raises(ConfigError, match="GRADSYNC_CHUNK_BYTES='4X'"):
        load_config(environ={"GRADSYNC_CHUNK_BYTES": "4X"})


def test_timeline_settings():
    assert (Config().timeline, Config().timeline_mark_cycles) == ("", False)
    cfg = load_config(environ={"GRADSYNC_TIMELINE": "/tmp/t.json",
                               "GRADSYNC_TIMELINE_MARK_CYCLES": "yes"})
    assert (cfg.timeline, cfg.timeline_mark_cycles) == ("/tmp/t.json", True)
    with pytest.raises(ConfigError, match="GRADSYNC_TIMELINE_MARK_CYCLES"):
        load_config(environ={"GRADSYNC_TIMELINE_MARK_CYCLES": "often"})


def test_a_worker_keeps_one_take_in_flight_per_data_server_by_default():
    # Pipelined takes (2 in flight) were measured no faster than one between emulated hosts
    # (docs/data.md, "Between hosts, pipelined"): one is the default, more an option.
    assert Config().data_takes == 1
    assert load_config(environ={"GRADSYNC_DATA_TAKES": "2"}).data_takes == 2
    with pytest.raises(ConfigError, match="data_takes"):
        Config(data_takes=0)
