"""components/datasets.py: the real download code against an HTTP server on loopback that
serves a data root (the local copy of the corpora, or a tampered one), and `padir data
fetch` on a cache filled from it."""

import functools
import hashlib
import http.server
import os
import shutil
import socket
import threading

import pytest

from components import config as config_lib
from components import datasets
from components.datasets import FetchError
from flows import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_ROOT = os.environ.get("PADIR_DATA_ROOT") or os.path.join(REPO, "..", "shared", "data")
DEMO_FILES = [f"multi30k/{split}.{lang}.gz" for lang in ("de", "en")
              for split in ("test_2016_flickr", "train", "val")]
NAME = "multi30k/val.en.gz"  # 22 kB


@pytest.fixture
def local_copy():
    """The local data root that the pins were computed from."""
    if not os.path.isdir(os.path.join(DATA_ROOT, "multi30k")):
        message = f"{DATA_ROOT} does not hold multi30k"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}: CI runs every test", pytrace=False)
        pytest.skip(message)
    return DATA_ROOT


class Server:
    """A threaded HTTP server on loopback of the files under `root`, with the paths it was
    asked for."""

    def __init__(self, root: str, handler: type):
        self.requests: list[str] = []
        requests = self.requests

        class Recording(handler):
            def do_GET(self):
                requests.append(self.path)
                super().do_GET()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Recording, directory=root))
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class CutHandler(http.server.SimpleHTTPRequestHandler):
    """Announces a file's whole length, sends half of it, then closes the connection."""

    def do_GET(self):
        with open(self.translate_path(self.path), "rb") as f:
            body = f.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:len(body) // 2])
        self.wfile.flush()
        self.close_connection = True


@pytest.fixture
def serve():
    """`serve(root)`: a Server of the files under `root`; `cut=True`: a CutHandler one."""
    servers = []

    def start(root: str, cut: bool = False) -> Server:
        servers.append(Server(root, CutHandler if cut else http.server.SimpleHTTPRequestHandler))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, names in os.walk(root) for f in names)


def _tampered_root(tmp_path, content: bytes) -> str:
    root = tmp_path / "tampered"
    (root / "multi30k").mkdir(parents=True)
    (root / NAME).write_bytes(content)
    return str(root)


def test_the_pins_are_the_local_copys_bytes_at_a_fixed_commit(local_copy):
    assert set(datasets.FILES) == {f"multi30k/{name}" for name in os.listdir(
        os.path.join(local_copy, "multi30k"))}
    for name, pinned in datasets.FILES.items():
        with open(os.path.join(local_copy, name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == pinned.sha256, name
        assert pinned.url == ("https://github.com/multi30k/dataset/raw/a3d2e0d26b56f3846f66a952"
                              f"536ffed4e401d05a/data/task1/raw/{os.path.basename(name)}")


def test_fetch_downloads_checks_and_caches(local_copy, serve, tmp_path):
    server = serve(local_copy)
    cache = str(tmp_path / "cache")
    path = datasets.fetch(NAME, cache, base_url=server.url)
    assert path == os.path.join(cache, NAME)
    with open(path, "rb") as got, open(os.path.join(local_copy, NAME), "rb") as want:
        assert got.read() == want.read()
    assert _files(cache) == [NAME]  # no temporary file left beside it
    assert datasets.fetch(NAME, cache, base_url=server.url) == path
    assert server.requests == [f"/{NAME}"]  # the second call read the cache


def test_a_checksum_mismatch_leaves_nothing_and_names_the_url(serve, tmp_path):
    server = serve(_tampered_root(tmp_path, b"not the captions\n"))
    cache = tmp_path / "cache"
    with pytest.raises(FetchError) as error:
        datasets.fetch(NAME, str(cache), base_url=server.url)
    message = str(error.value)
    assert message.startswith(f"{server.url}/{NAME}: sha256 ")
    assert datasets.FILES[NAME].sha256 in message and "PADIR_DATA_ROOT" in message
    assert "\n" not in message and _files(cache) == []


def test_a_connection_cut_mid_file_leaves_nothing_and_a_rerun_fetches_it(
        local_copy, serve, tmp_path):
    cut = serve(local_copy, cut=True)
    cache = str(tmp_path / "cache")
    size = os.path.getsize(os.path.join(local_copy, NAME))
    with pytest.raises(FetchError, match=f"cannot download {cut.url}/{NAME}: the connection "
                                         f"closed after {size // 2} of {size} bytes"):
        datasets.fetch(NAME, cache, base_url=cut.url)
    assert _files(cache) == []
    datasets.fetch(NAME, cache, base_url=serve(local_copy).url)
    assert _files(cache) == [NAME]


def test_an_http_error_names_the_url_and_the_status(serve, tmp_path):
    server = serve(str(tmp_path / "empty"))
    with pytest.raises(FetchError, match=f"cannot download {server.url}/{NAME}: HTTP 404 .*"
                                         "set PADIR_DATA_ROOT to a local copy"):
        datasets.fetch(NAME, str(tmp_path / "cache"), base_url=server.url)
    assert _files(tmp_path / "cache") == []


def test_no_server_names_the_url(tmp_path):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(FetchError, match=f"cannot download {url}/{NAME}: .*check the network"):
        datasets.fetch(NAME, str(tmp_path / "cache"), base_url=url)


def test_required_names_the_files_a_config_reads_under_the_data_root(monkeypatch):
    monkeypatch.setenv("PADIR_DATA_ROOT", "/data")
    assert datasets.required(config_lib.load("configs/demo.yaml").data) == sorted(DEMO_FILES)
    assert datasets.required(config_lib.load("configs/multi30k_en_fr.yaml").data) == sorted(
        f"multi30k/{split}.{lang}.gz" for lang in ("en", "fr")
        for split in ("test_2016_flickr", "train", "val"))
    assert datasets.required(config_lib.load("configs/overlays/wmt14.yaml").data) == []  # gs://
    with pytest.raises(FetchError, match=r"\$\{PADIR_DATA_ROOT\}/tatoeba/deu-eng.zip: no public "
                                         "source is pinned .* set PADIR_DATA_ROOT"):
        datasets.required(config_lib.load("configs/tatoeba_de_en.yaml").data)


def test_the_cache_is_the_data_root_only_when_none_is_set():
    environ = {"XDG_CACHE_HOME": "/c"}
    assert datasets.use_cache(environ) == "/c/padir/data"
    assert environ["PADIR_DATA_ROOT"] == "/c/padir/data"
    environ = {"XDG_CACHE_HOME": "/c", "PADIR_DATA_ROOT": "/mine"}
    assert datasets.use_cache(environ) is None and environ["PADIR_DATA_ROOT"] == "/mine"


def test_padir_data_fetch_without_a_data_root_fills_the_cache(local_copy, serve, tmp_path,
                                                               monkeypatch, capsys):
    """`padir data fetch` reads the cache that a fetch from loopback filled (no request to
    the public URLs: every file is there), and points PADIR_DATA_ROOT at it."""
    cache = datasets.cache_dir({"XDG_CACHE_HOME": str(tmp_path)})
    datasets.fetch_all(DEMO_FILES, cache, base_url=serve(local_copy).url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PADIR_DATA_ROOT", "")  # restored to the session's value afterwards
    monkeypatch.delenv("PADIR_DATA_ROOT")
    monkeypatch.chdir(REPO)
    assert cli.main(["data", "fetch", "configs/demo.yaml"]) == 0
    assert capsys.readouterr().out.split() == [os.path.join(cache, n) for n in sorted(DEMO_FILES)]
    assert os.environ["PADIR_DATA_ROOT"] == cache
    root = tmp_path / "root"
    shutil.copytree(cache, root)
    assert cli.main(["data", "fetch", "configs/demo.yaml", "--root", str(root)]) == 0
    assert capsys.readouterr().out.split()[0] == str(root / sorted(DEMO_FILES)[0])


def test_a_pipeline_job_alone_falls_back_to_the_cache_as_padir_does(tmp_path, monkeypatch,
                                                                    capsys):
    """`python -m pipelines.NAME` without PADIR_DATA_ROOT reads the cache, as `padir` does
    (`datasets.load_config`, which both call): prepare fetches what the config names there
    first, a job that does not read the raw corpora fetches nothing."""
    from pipelines import prepare, vocab

    fetched, ran = [], []
    monkeypatch.setattr(datasets, "fetch_all", lambda names, root: fetched.append((names, root)))

    def run(config, pipeline_args):  # the job's graph is not what this test is about
        ran.append(config)
        return type("Artifact", (), {"stage": "prepare", "uri": "u"})

    run.__module__ = prepare.__name__  # options.main names the job by its module
    monkeypatch.setattr(prepare, "run", run)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PADIR_DATA_ROOT", "")  # restored to the session's value afterwards
    monkeypatch.delenv("PADIR_DATA_ROOT")
    monkeypatch.chdir(REPO)
    cache = datasets.cache_dir({"XDG_CACHE_HOME": str(tmp_path)})
    workdir = f"workdir={tmp_path / 'work'}"
    assert prepare.main(["--config", "configs/demo.yaml", "--set", workdir]) == 0
    assert fetched == [(sorted(DEMO_FILES), cache)] and len(ran) == 1
    assert os.environ["PADIR_DATA_ROOT"] == cache
    fetched.clear()
    monkeypatch.delenv("PADIR_DATA_ROOT")
    assert vocab.main(["--config", "configs/demo.yaml", "--set", workdir]) == 2
    assert "run `padir stage prepare` first" in capsys.readouterr().err  # not a missing variable
    assert fetched == []
