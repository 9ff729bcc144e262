"""The broker's allow-list is keyed by public key, and a certificate's name is its file's
(issue 30, finding 9): a certificate named `server` (or after a live node) dropped into the
allow-list folder under another file name, or a second file with a key already listed, is
refused with one line naming both files; the genuine entry stays, and its node keeps its
place (it stays connected, and reconnects). At the broker's start such a folder is an error
(exit 2, one line). `fedbus keygen --list` shows the names inside and flags both cases.

Real `fedbus keygen` files, a real broker process, Peers with their keys.
"""
from __future__ import annotations

import shutil

import pytest
from conftest import wait_for
from helpers import fedbus, free_port

from fedbus.broker import auth
from fedbus.broker.peer import Peer, PeerError

HB = {"heartbeat_s": 0.3, "liveness": 4}


@pytest.fixture
def keys(tmp_path):
    """broker, server and node-a (c0-2) from `fedbus keygen` in keys/."""
    d = tmp_path / "keys"
    fedbus("keygen", "broker", "--dir", str(d))
    fedbus("keygen", "server", "--dir", str(d))
    fedbus("keygen", "node-a", "--clients", "0-2", "--dir", str(d))
    return d


@pytest.fixture
def intruder(tmp_path):
    """The intruder's own keypair, named `server` (`fedbus keygen server` elsewhere)."""
    d = tmp_path / "intruder"
    fedbus("keygen", "server", "--dir", str(d))
    shutil.copy(tmp_path / "keys" / "broker.key", d / "broker.key")
    return d


def renamed_certificate(src, dst, *, name: str | None = None, role: str | None = None):
    """Copy a certificate file, optionally with another name/role inside (as an attacker
    would edit one)."""
    text = src.read_text()
    cert = auth.read_certificate(src)
    if name is not None:
        text = text.replace(f'name = "{cert.name}"', f'name = "{name}"')
    if role is not None:
        text = text.replace(f'role = "{cert.role}"', f'role = "{role}"')
    dst.write_text(text)
    return dst


def _peer(endpoint, name, keys_dir, key=None, **kw) -> Peer:
    return Peer(endpoint, name, curve=auth.load_peer_curve(keys_dir, key or name), **HB, **kw)


def _curve_broker(broker_proc, keys):
    b = broker_proc(f"tcp://127.0.0.1:{free_port()}", start=False, **HB)
    b.args += ["--curve", "--keys-dir", str(keys)]
    return b.start()


# --------------------------------------------------------------------------- the allow-list
def test_a_colliding_folder_is_an_error_at_load_naming_both_files(keys, intruder):
    renamed_certificate(intruder / "server.key", keys / "intruder.key")
    with pytest.raises(auth.AllowListConflict) as err:
        auth.AllowList.load(keys)
    msg = str(err.value)
    assert "intruder.key" in msg and "server.key" in msg and "'server'" in msg, msg
    (keys / "intruder.key").unlink()
    # the same public key in two files, each named after its file
    renamed_certificate(keys / "node-a.key", keys / "node-b.key", name="node-b")
    with pytest.raises(auth.AllowListConflict) as err:
        auth.AllowList.load(keys)
    msg = str(err.value)
    assert "node-a.key" in msg and "node-b.key" in msg and "same public key" in msg, msg
    (keys / "node-b.key").unlink()
    assert set(auth.AllowList.load(keys).by_name) == {"server", "node-a"}


def test_the_broker_cli_refuses_such_a_folder_with_one_line(keys, intruder):
    renamed_certificate(intruder / "server.key", keys / "backup.key")
    r = fedbus("broker", "--bind", f"tcp://127.0.0.1:{free_port()}", "--curve", "--keys-dir",
               str(keys), check=False, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, lines
    assert "backup.key" in lines[0] and "server.key" in lines[0], lines[0]


def test_a_reload_keeps_the_genuine_entries_and_refuses_the_newcomers(keys, intruder):
    allow = auth.AllowList.load(keys)
    genuine = {n: e.public for n, e in allow.by_name.items()}
    # the intruder's `server` under another name; node-a's key under a second, valid name
    renamed_certificate(intruder / "server.key", keys / "intruder.key")
    renamed_certificate(keys / "node-a.key", keys / "node-a2.key", name="node-a2")
    assert allow.refresh()
    assert {n: e.public for n, e in allow.by_name.items()} == genuine
    assert auth.read_certificate(intruder / "server.key").public not in {
        e.public for e in allow.by_key.values()}
    assert len(allow.problems) == 2, allow.problems
    by_file = {("intruder.key" in p): p for p in allow.problems}
    assert "server.key" in by_file[True] and "'server'" in by_file[True]
    assert "node-a.key" in by_file[False] and "node-a2.key" in by_file[False]
    assert "node-a.key stays" in by_file[False]
    # a rotated key (keygen --force on the same file) is taken
    fedbus("keygen", "server", "--force", "--dir", str(keys))
    assert allow.refresh()
    assert allow.by_name["server"].public == auth.read_certificate(keys / "server.key").public
    assert allow.by_name["server"].public != genuine["server"]


def test_keygen_list_shows_the_names_inside_and_flags_what_the_broker_refuses(keys, intruder):
    renamed_certificate(intruder / "server.key", keys / "intruder.key")
    renamed_certificate(keys / "node-a.key", keys / "node-a2.key", name="node-a2")
    out = fedbus("keygen", "--list", "--dir", str(keys)).stdout
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["intruder.key"].split()[1:3] == ["server", "server"]
    assert "is not the file's but server.key's" in rows["intruder.key"]
    assert rows["node-a.key"].split()[1:4] == ["node-a", "client", "c0-2"]
    # the flag reads "!! name ..."; a Z85 public key may hold "!!" itself but no space
    assert "!! name" not in rows["node-a.key"] and "!! name" not in rows["server.key"]
    assert "!! name" in rows["intruder.key"]
    dup = [line for line in out.splitlines() if line.startswith("!! ")]
    assert len(dup) == 1 and "node-a.key" in dup[0] and "node-a2.key" in dup[0], out


# --------------------------------------------------------------------------- the attack, live
@pytest.mark.parametrize("how", ["another-file-name", "a-second-file-with-a-listed-key"])
def test_a_certificate_named_server_cannot_take_the_servers_place(broker_proc, keys, intruder,
                                                                  how):
    b = _curve_broker(broker_proc, keys)
    ep = b.endpoint
    server = _peer(ep, "server", keys, role="server")
    server.start(30)
    node = _peer(ep, "node-a", keys, role="client", addresses=["c0"])
    node.start(30)
    peers = [server, node]
    try:
        join = server.recv(10)
        assert (join.kind, join.body["node"]) == ("join", "node-a")
        if how == "another-file-name":
            # the intruder's own key, as `server`, added as intruder.key
            dropped = renamed_certificate(intruder / "server.key", keys / "intruder.key")
        else:
            # the one valid key the intruder holds (node-a's), as `server`, in a second file
            dropped = renamed_certificate(keys / "node-a.key", keys / "server-2.key",
                                          name="server", role="server")
        # the intruder connects as `server` with its key: a new key makes the broker reload
        evil = _peer(ep, "server", intruder, role="server")
        with pytest.raises(PeerError, match="no answer from the broker"):
            evil.start(3)
        refused = wait_for(lambda: b.events("allow-list certificate refused"), 60,
                           message="the refusal in the broker log")
        assert len(refused) == 1, refused
        assert dropped.name in refused[0]["reason"] and "server.key" in refused[0]["reason"]
        assert b.events("allow-list loaded")[-1]["nodes"] == 2
        if how != "another-file-name":
            # node-a's key (which the intruder holds) is still node-a's only: not the server's
            hijack = _peer(ep, "server", keys, key="node-a", role="server")
            with pytest.raises(PeerError, match="registration refused"):
                hijack.start(30)
        # the genuine server is still the server ...
        node.send("update", "server", {"n": 1}, src="c0")
        m = server.recv(10)
        assert (m.kind, m.body) == ("update", {"n": 1})
        # ... and takes its place again after a restart (a new connection, its own key)
        server.close()
        server = _peer(ep, "server", keys, role="server")
        peers.append(server)
        server.start(30)
        node.send("update", "server", {"n": 2}, src="c0")
        got = []
        while not got or got[-1].kind != "update":
            m = server.recv(10)
            assert m is not None, got
            got.append(m)
        assert got[-1].body == {"n": 2}
        assert all(m.kind == "join" and m.body["node"] == "node-a" for m in got[:-1])
        assert not b.events("node replaced by a new connection with its key", node="server")
    finally:
        for p in peers:
            p.close()
