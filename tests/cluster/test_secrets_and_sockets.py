"""Secrets and local sockets of the cluster pagefleet starts: private files, no key in ps."""

from __future__ import annotations

import os
import stat

import pytest

from pagefleet.cluster import cli
from pagefleet.cluster.config import ServeArgs
from pagefleet.cluster.launch import private_ray_token
from pagefleet.cluster.serve_env import haproxy_files_env


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_ray_token_is_made_private_before_ray_would_write_it_world_readable(tmp_path):
    made = private_ray_token(tmp_path / "ray" / "auth_token")
    assert (_mode(made), _mode(made.parent)) == (0o600, 0o700) and len(made.read_text()) == 64
    token = made.read_text()
    made.chmod(0o644)  # as Ray writes it
    made.parent.chmod(0o755)
    assert private_ray_token(made).read_text() == token  # an existing token is kept
    assert (_mode(made), _mode(made.parent)) == (0o600, 0o700)


def test_haproxys_files_and_admin_socket_live_in_a_private_folder(tmp_path):
    private = tmp_path / "hp"
    private.mkdir(mode=0o700)
    env = haproxy_files_env(str(private))
    assert {os.path.dirname(v) if not k.endswith("STATE_BASE") else v for k, v in env.items()} == {str(private)}
    assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"] == str(private / "admin.sock")


def test_the_api_key_comes_from_a_file(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\nignored\n")
    assert ServeArgs(api_key_file=str(key_file)).key() == "s3cret-key"
    assert ServeArgs(api_key="direct").key() == "direct"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        ServeArgs(api_key_file=str(tmp_path / "empty")).key()
    with pytest.raises(ValueError, match="cannot read the API key file"):
        ServeArgs(api_key_file=str(tmp_path / "missing")).key()


def test_a_key_on_the_command_line_is_warned_about_and_a_key_file_is_not(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("pagefleet.cluster.launch.run_server", lambda opts, **kw: 0)
    key_file = tmp_path / "key"
    key_file.write_text("k\n")
    assert cli.main(["serve", "--api-key", "visible-key"]) == 0
    assert "--api-key on the command line is visible" in capsys.readouterr().err
    assert cli.main(["serve", "--api-key-file", str(key_file)]) == 0
    assert "visible" not in capsys.readouterr().err
    assert cli.main(["serve", "--api-key", "k", "--api-key-file", str(key_file)]) == 2
    assert "not both" in capsys.readouterr().err


def test_a_key_file_wins_over_the_environments_key(tmp_path, monkeypatch):
    """$PAGEFLEET_API_KEY is only the default of --api-key: a key file given beside it is no conflict."""
    monkeypatch.setenv("PAGEFLEET_API_KEY", "from-env")
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    built = []
    monkeypatch.setattr("pagefleet.cluster.launch.run_server", lambda opts, **kw: built.append(opts.serve.key()) or 0)
    assert cli.main(["serve", "--api-key-file", str(key_file)]) == 0
    assert cli.main(["serve"]) == 0
    assert built == ["from-file", "from-env"]
