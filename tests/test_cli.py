"""flows/cli.py: one line per bad input, `--debug`, and `padir translate`'s line contract."""

import dataclasses
import http.server
import io
import json
import os
import subprocess
import sys
import threading

import pytest

from components import logs
from flows import cli, stages

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class FakeTranslation:
    hypothesis: str
    truncated: bool = False
    source_tokens: int = 3


class FakeTranslator:
    """Upper-cases; 'LONG' sources come back truncated, 'NL' ones with line breaks."""

    def __init__(self):
        self.batches = []

    def translate(self, sources):
        self.batches.append(list(sources))
        return [FakeTranslation(s.upper().replace("NL", "a\nb\r\nc\u2028d"),
                                truncated="LONG" in s.upper(), source_tokens=64)
                for s in sources]


def _stream(data: bytes, batch_size=2):
    translator, out, err = FakeTranslator(), io.StringIO(), io.StringIO()
    counts = cli.translate_stream(translator, io.BytesIO(data), out, err, batch_size=batch_size)
    return counts, out.getvalue(), err.getvalue(), translator


def test_translate_writes_one_line_per_input_line_and_reports_on_stderr():
    data = b"a dog\n\xff\xfe broken\n  \nlong one\r\nnl here\nlast, no newline"
    counts, out, err, translator = _stream(data)
    assert out.splitlines() == ["A DOG", "", "", "LONG ONE", "a b c d HERE", "LAST, NO NEWLINE"]
    assert out.count("\n") == 6
    assert translator.batches == [["a dog"], ["long one"], ["nl here", "last, no newline"]]
    assert err.splitlines() == [
        "padir translate: line 2: not UTF-8 (invalid start byte at byte 0); its output line "
        "is left empty",
        "padir translate: line 4: the source was cut to 64 tokens (the widest length bucket)",
        "padir translate: 6 lines, 1 not UTF-8 (left empty), 1 cut to the widest bucket",
    ]
    assert (counts.lines, counts.not_utf8, counts.truncated, counts.exit_status) == (6, 1, 1, 1)


def test_translate_clean_input_is_silent_and_succeeds():
    counts, out, err, _ = _stream(b"one\ntwo\nthree\n")
    assert (out, err, counts.exit_status) == ("ONE\nTWO\nTHREE\n", "", 0)


def test_translate_empty_stdin_fails_with_one_line():
    counts, out, err, translator = _stream(b"")
    assert (out, counts.exit_status, translator.batches) == ("", 1, [])
    assert err == "padir translate: no input: stdin was empty\n"


def _artifact(directory, stage="student"):
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text(json.dumps({"stage": stage, "key": "k"}))


def test_translate_takes_a_relative_checkpoint(tmp_path, monkeypatch, capsys):
    _artifact(tmp_path / "work" / "student" / "k")
    monkeypatch.chdir(tmp_path)
    loaded = []

    def fake_translator(checkpoint, method, batch_size):
        loaded.append((checkpoint, method.kind, batch_size))
        return FakeTranslator()

    monkeypatch.setattr(cli, "_translator", fake_translator)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n")))
    assert cli.main(["translate", "--checkpoint", "work/student/k", "--batch-size", "4"]) == 0
    assert loaded == [(str(tmp_path / "work" / "student" / "k"), "refine", 4)]
    assert capsys.readouterr().out == "HELLO\n"


@pytest.mark.parametrize("argv, message", [
    (["translate", "--checkpoint", "nowhere"], "nowhere is not a complete artifact"),
    (["translate", "--checkpoint", "work/student/k", "--method", "ar_beam"],
     "--method ar_beam decodes with a 'teacher' artifact; work/student/k is a 'student' one"),
    (["translate", "--checkpoint", "work/student/k", "--beam-size", "3"],
     "'beam_size' does not apply to kind refine"),
    (["status", "missing.yaml"], "missing.yaml: no such config file"),
    (["status", "bad.yaml"], "bad.yaml:2:1: invalid YAML"),
    (["status", "ok.yaml", "--set", "seed=["], "--set seed: the value is not valid YAML"),
])
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, monkeypatch, capsys, argv, message):
    _artifact(tmp_path / "work" / "student" / "k")
    (tmp_path / "bad.yaml").write_text("seed: [\n")
    (tmp_path / "ok.yaml").write_text(
        "data: {source_lang: en, target_lang: de, train: {tsv: x.tsv}}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert err.startswith("padir: error: ") and message in err and err.count("\n") == 1


def test_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit) as exit:
            cli.main(["--debug", "status", "missing.yaml"])
    finally:
        logs.configure()  # INFO again for the tests after
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("Traceback (most recent call last):\n")
    assert err.endswith("components.config.ConfigError: missing.yaml: no such config file\n")


def test_any_other_error_is_its_traceback_redacted_and_exit_status_1(monkeypatch, capsys):
    def fails(*args, **kwargs):
        try:
            raise OSError("GET https://u:hunter2@h/x?token=s3cr3t: reset")
        except OSError as e:
            raise RuntimeError("reading https://h/y?sig=s3cr3t failed") from e

    monkeypatch.setattr(cli.datasets, "load_config", fails)
    with pytest.raises(SystemExit) as exit:
        cli.main(["status", "any.yaml"])
    err = capsys.readouterr().err
    assert exit.value.code == 1 and err.startswith("Traceback (most recent call last):\n")
    assert "OSError: GET https://***@h/x?token=***: reset\n" in err
    assert err.endswith("RuntimeError: reading https://h/y?sig=*** failed\n")
    assert "s3cr3t" not in err and "hunter2" not in err


@pytest.mark.slow  # a `padir` interpreter
def test_debug_output_of_a_refused_corpus_url_holds_no_secret(tmp_path):
    """`padir --debug stage prepare` on a corpus URL with a password and a `${TOKEN}` query
    whose GET the server refuses (403): its DEBUG logs and the traceback, aiohttp's message
    in it too, name the URL with its secrets redacted."""
    from test_corpus import _Refusing

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"127.0.0.1:{server.server_address[1]}/headok/403/train"
    config = tmp_path / "refused.yaml"
    config.write_text(
        f"workdir: {tmp_path / 'work'}\n"
        "data: {source_lang: en, target_lang: de, train: {source: "
        f"'http://user:hunter2@{url}.en?token=${{PADIR_TEST_TOKEN}}', "
        f"target: 'http://{url}.de'}}}}\n")
    try:
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "--debug", "stage", "prepare",
                               str(config)], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO,
                                       PADIR_TEST_TOKEN="s3cr3t-t0ken"), timeout=300)
    finally:
        server.shutdown()
    assert proc.returncode == 2
    assert f"ClientResponseError: 403, message='Forbidden', url='http://{url}.en?token=***'" \
        in proc.stderr  # aiohttp's own message names the URL it requested
    assert proc.stderr.endswith(f"CorpusError: data.train.source: cannot read "
                                f"http://***@{url}.en?token=***: HTTP 403 Forbidden\n")
    assert "DEBUG" in proc.stderr
    assert "s3cr3t" not in proc.stderr + proc.stdout and "hunter2" not in proc.stderr


def test_padir_keeps_compiled_programs_in_the_users_cache(tmp_path):
    """Without JAX_COMPILATION_CACHE_DIR, `padir` sets JAX's persistent cache to
    $XDG_CACHE_HOME/padir/jax before JAX is imported: what a process compiles lands there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(XDG_CACHE_HOME=str(tmp_path), JAX_PLATFORMS="cpu",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    code = ("from flows import cli; cli.use_compilation_cache(); import jax; "
            "jax.jit(lambda x: x * 2 + 1)(3).block_until_ready()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.listdir(tmp_path / "padir" / "jax")


def test_an_explicit_compilation_cache_is_kept():
    environ = {"JAX_COMPILATION_CACHE_DIR": "/elsewhere", "JAX_COMPILATION_CACHE_MAX_SIZE": "-1",
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}
    kept = dict(environ)
    assert cli.use_compilation_cache(environ) == "/elsewhere" and environ == kept
    fresh = {"XDG_CACHE_HOME": "/c"}
    assert cli.use_compilation_cache(fresh) == "/c/padir/jax"
    assert fresh["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0.1"
