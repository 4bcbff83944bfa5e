"""``--dask-scheduler`` against ports that are not Dask schedulers: every failure is one ``kvlab study: error:``
line naming the address, within a bounded time. The servers listen on 127.0.0.1 only and stop with the test."""

import os
import re
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvlab.errors import InvalidArgumentError
from kvlab.studies import cache_hit_study
from kvlab.studies.cli import main

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--trace", "synthetic_parallel", "--limit", "4", "--capacity", "inf", "--policy", "lru", "--quiet"]
HTTP_ANSWER = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"  # read as a frame count of 3 EiB


@contextmanager
def serving(answer: bytes | None):
    """A port on 127.0.0.1 that accepts every connection, sends ``answer`` (None: nothing) and keeps it open."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop, accepted = threading.Event(), []

    def accept():
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except (TimeoutError, socket.timeout):
                continue
            accepted.append(connection)
            if answer:
                connection.sendall(answer)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        server.close()


def one_error_line(err: str, address: str, how: str) -> None:
    assert re.fullmatch(rf"kvlab study: error: cannot use the Dask scheduler at '{re.escape(address)}': {how}\n",
                        err), err


def test_a_port_that_accepts_and_never_answers_fails_in_bounded_time(tmp_path):
    with serving(answer=None) as address:
        # Before the fix the client waited in its handshake forever: the subprocess's timeout bounds that.
        done = subprocess.run([sys.executable, "-m", "kvlab", "study", *SMALL, "--out", str(tmp_path),
                               "--dask-scheduler", address, "--dask-timeout", "1"],
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                              text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    one_error_line(done.stderr, address, r"it accepted the connection but sent no Dask answer within 2 s; "
                                         r"is that a Dask scheduler's port\?")


def test_a_port_that_answers_something_else_is_one_line(tmp_path, capsys):
    with serving(HTTP_ANSWER) as address:
        assert main([*SMALL, "--out", str(tmp_path), "--dask-scheduler", address, "--dask-timeout", "5"]) == 2
    one_error_line(capsys.readouterr().err, address,
                   r"it accepted the connection but did not answer as a Dask scheduler \(MemoryError: .*\); "
                   r"is that a Dask scheduler's port\?")


def test_an_address_nobody_listens_on_is_one_line(tmp_path, capsys):
    with socket.socket() as reserved:  # bound, never listening: connections are refused, the port stays ours
        reserved.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{reserved.getsockname()[1]}"
        assert main([*SMALL, "--out", str(tmp_path), "--dask-scheduler", address, "--dask-timeout", "0.5"]) == 2
    one_error_line(capsys.readouterr().err, address, r"no connection within 0\.5 s( \(connection refused: .*\))?")


@pytest.mark.parametrize("address, how", [
    ("tls://127.0.0.1:1", "tls:// needs TLS settings and none are configured: set dask's distributed.comm.tls.ca-file"
                          ".*"),
    ("ucx://127.0.0.1:8786", "distributed needs the distributed-ucxx package for ucx:// .*"),
    ("foo://127.0.0.1:1", r"unknown address scheme 'foo' \(known schemes: .*\); expected an address such as "
                          "'tcp://10.0.0.5:8786'"),
    ("127.0.0.1", "missing port number in address '127.0.0.1'; expected HOST:PORT, such as 'tcp://10.0.0.5:8786'"),
    ("tcp://127.0.0.1:99999", r"port 99999 is not in \[1, 65535\]"),
])
def test_addresses_refused_without_the_network_are_one_line(address, how, tmp_path, capsys):
    assert main([*SMALL, "--out", str(tmp_path), "--dask-scheduler", address]) == 2
    one_error_line(capsys.readouterr().err, address, how)


def test_a_scheduler_without_workers_is_one_line(tmp_path, capsys):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=0, dashboard_address=None) as cluster:
        address = cluster.scheduler_address
        assert main([*SMALL, "--out", str(tmp_path), "--dask-scheduler", address, "--dask-timeout", "3"]) == 2
    assert capsys.readouterr().err == (f"kvlab study: error: the Dask scheduler at '{address}' has no worker (waited "
                                       "3 s); start some with `dask worker ADDRESS --nworkers -1 --nthreads 1` (one "
                                       "single-threaded process per core)\n")


def test_a_bad_address_fails_before_the_traces_are_read():
    with pytest.raises(InvalidArgumentError, match="Dask scheduler at 'foo://x'"):
        cache_hit_study("no_such_trace", dask_scheduler="foo://x", progress=False)


def test_the_scheduler_is_reached_before_the_traces_are_prepared(monkeypatch):
    def no_preparing(*args, **kwargs):
        raise AssertionError("prepared a trace before reaching the scheduler")
    monkeypatch.setattr("kvlab.studies.study.block_keys", no_preparing)
    with serving(HTTP_ANSWER) as address, pytest.raises(InvalidArgumentError, match="not answer as a Dask"):
        cache_hit_study("synthetic_parallel", dask_scheduler=address, progress=False)
