"""A Dask client for a study's replays, started in bounded time, every failure one kvlab error.

``distributed.Client(address, timeout=...)`` bounds only the TCP connection. A port that accepts the
connection and then says nothing keeps the client in its handshake forever; a port that answers with
something other than Dask's protocol fails with whatever its bytes decode to (``MemoryError: Unable to
allocate 3.07 EiB``: eight bytes of text read as a frame length); ``tls://`` without TLS settings and
``ucx://`` without the distributed-ucxx package fail with ``TypeError``s about SSL contexts and abstract
classes. ``connect`` checks what can be checked without the network first, then bounds the whole start
(connection, handshake, the scheduler's identity, registration) and closes what a failed start opened.
"""

import asyncio
import contextlib

from kvlab.extras import require

require(("dask", "distributed"), "dask", "running a study on a Dask cluster (--dask-scheduler)")

import dask  # noqa: E402 (after the check, so a missing extra is one clear error)
from distributed import Client, Security  # noqa: E402
from distributed.comm import registry  # noqa: E402
from distributed.comm.addressing import get_address_host_port, parse_address  # noqa: E402

from kvlab.errors import InvalidArgumentError
from kvlab.studies.parallel_options import check_timeout

EXAMPLE = "'tcp://10.0.0.5:8786'"
#: The address that asks for a Dask cluster embedded in this process (``local_client``).
LOCAL = "local"
#: How to start the workers of a cluster that runs replays: pure-Python replays hold the GIL, so a worker's
#: threads run them one at a time; one single-threaded process per core runs them side by side (docs/studies.md).
WORKER_COMMAND = "dask worker ADDRESS --nworkers -1 --nthreads 1"
#: Why a protocol cannot be used here, where distributed's own error does not say it.
MISSING_PROTOCOL = {"ucx": "distributed needs the distributed-ucxx package for ucx:// (pip install "
                           "distributed-ucxx-cu12, or -cu13, for your CUDA version)"}


def connect(address, timeout_s: float = 10.0) -> Client:
    """A started client of the scheduler at ``address``, which has a worker: ``timeout_s`` seconds to get a
    connection, as many again for the scheduler's answer, and again for a worker. Raises
    InvalidArgumentError naming the address and what failed."""
    timeout_s = check_timeout(timeout_s)
    check_address(address)
    client = _start(address, timeout_s)
    try:
        # Without a worker joblib would wait its own 10 s and fail with advice about parallel_config.
        client.wait_for_workers(1, timeout=timeout_s)
    except (TimeoutError, asyncio.TimeoutError):
        client.close()
        raise InvalidArgumentError(f"the Dask scheduler at {address!r} has no worker (waited {timeout_s:g} s); "
                                   f"start some with `{WORKER_COMMAND}` (one single-threaded process per "
                                   "core)") from None
    return client


def local_client(workers: int) -> Client:
    """A client of a Dask cluster started in this process and closed with the client: ``workers`` worker
    processes of one thread each (see ``WORKER_COMMAND`` for why not threads)."""
    return Client(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)


def _start(address: str, timeout_s: float) -> Client:
    try:
        return _BoundedClient(address, timeout_s)
    except (TimeoutError, asyncio.TimeoutError):  # the bound on the whole start (before OSError: it is one)
        how = f"it accepted the connection but sent no Dask answer within {2 * timeout_s:g} s"
    except Exception as e:  # whatever the peer's bytes decoded to, or distributed's "Timed out trying to connect"
        if type(e) is OSError:  # that one exactly: its subclasses (a closed comm, a reset) come after connecting
            raise InvalidArgumentError(f"cannot use the Dask scheduler at {address!r}: no connection within "
                                       f"{timeout_s:g} s{_connect_failure(e)}") from None
        how = f"it accepted the connection but did not answer as a Dask scheduler ({type(e).__name__}: {e})"
    raise InvalidArgumentError(f"cannot use the Dask scheduler at {address!r}: {how}; is that a Dask scheduler's "
                               "port?")


def check_address(address) -> str:
    """``address`` if nothing that can be checked without the network refuses it: its type, the scheme, a
    protocol this Python cannot speak, TLS without settings, a missing or impossible port; ``LOCAL`` is one."""
    if address == LOCAL:
        return address
    if not isinstance(address, str):
        raise InvalidArgumentError(f"dask_scheduler must be an address such as {EXAMPLE}, got {address!r}")

    def refuse(why: str):
        raise InvalidArgumentError(f"cannot use the Dask scheduler at {address!r}: {why}")

    try:
        scheme = parse_address(address)[0]
        registry.get_backend(scheme).get_connector()
    except ValueError as e:  # an unknown scheme: the message lists the known ones
        refuse(f"{e}; expected an address such as {EXAMPLE}")
    except Exception as e:  # a registered protocol whose backend cannot be built here
        refuse(MISSING_PROTOCOL.get(scheme, f"the {scheme}:// protocol is not usable here ({type(e).__name__}: {e})"))
    # The client loads a security-loader's settings when one is configured; otherwise the plain settings,
    # which for TLS must name a certificate authority (and usually a client certificate).
    loader = dask.config.get("distributed.client.security-loader", None)
    if scheme in ("tls", "wss") and not loader and Security().get_connection_args("client")["ssl_context"] is None:
        refuse(f"{scheme}:// needs TLS settings and none are configured: set dask's distributed.comm.tls.ca-file, "
               "distributed.comm.tls.client.cert and .key (or DASK_DISTRIBUTED__COMM__TLS__CA_FILE and so on)")
    try:
        port = get_address_host_port(address)[1]
    except ValueError as e:
        refuse(f"{e}; expected HOST:PORT, such as {EXAMPLE}")
    if not 1 <= port <= 65535:
        refuse(f"port {port} is not in [1, 65535]")
    return address


def _connect_failure(error: BaseException) -> str:
    """What distributed's connection attempts last met, from the chain of causes of its "Timed out trying to
    connect": refused, a name that does not resolve... or nothing to add when the last attempt was the one
    the timeout cut short (refusals then hide behind it, so the same address can read either way)."""
    causes = []
    while error is not None:
        causes.append(error)
        error = error.__cause__
    if any(isinstance(e, ConnectionRefusedError) for e in causes):
        return " (connection refused: nothing listens on that port)"
    root = causes[-1]
    return "" if isinstance(root, (asyncio.CancelledError, TimeoutError, asyncio.TimeoutError)) or len(causes) == 1 \
        else f" ({type(root).__name__}: {root})"


class _BoundedClient(Client):
    """A Client whose start gives up after twice ``timeout_s`` (the connection's window, then the answer's),
    closing what it opened."""

    def __init__(self, address: str, timeout_s: float):
        self._start_limit_s = 2 * timeout_s
        super().__init__(address, timeout=timeout_s)

    def start(self, **kwargs):
        # Client.__init__ calls start(); callback_timeout makes distributed's own sync() wait for at most
        # the limit and cancel the start coroutine, wherever it waits.
        try:
            super().start(callback_timeout=self._start_limit_s, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # closing must not hide why the start failed
                self.close(timeout=self._start_limit_s)
            raise
