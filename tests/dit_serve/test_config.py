"""TOML config loading: defaults, sections, and errors that name the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from dit_serve.server.config import Config, ConfigError, load_config


def test_defaults_need_no_file():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.store.database_url() == f"sqlite:///{Path('dit-serve-data') / 'jobs.db'}"
    assert cfg.workers.models == ("digits", "digits-text") and cfg.workers.resource == "auto" and cfg.ray.address == ""


def test_a_file_sets_sections(tmp_path):
    path = tmp_path / "dit-serve.toml"
    path.write_text('[server]\nport = 9000\n[store]\nurl = "postgresql://u@db/jobs"\nlease_seconds = 10\n'
                    '[workers]\nmodels = ["digits", "dit-xl-2-256"]\nresource = "dit_gpu"\nmax_batch = 32\n')
    cfg = load_config(path)
    assert cfg.server.port == 9000 and cfg.store.database_url() == "postgresql://u@db/jobs"
    assert cfg.workers.models == ("digits", "dit-xl-2-256") and cfg.workers.inflight() == 32
    assert cfg.with_overrides(server={"port": None, "host": "0.0.0.0"}).server.port == 9000


@pytest.mark.parametrize("text, words", [
    ("[server]\nprot = 1\n", "server.prot: Extra inputs are not permitted"),
    ("[server]\nport = -1\n", "server.port"),
    ("[workers]\nbackend = 'fast'\n", "workers.backend"),
    ("[server\n", "not valid TOML"),
])
def test_bad_files(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[")) as e:
        load_config(path)
    assert str(path) in str(e.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(Path("/no/such/file.toml"))
