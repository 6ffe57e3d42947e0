"""Bad input to `loom bench` and `loom diagnose` is one line naming the flag, or the file,
line and field, with a non-zero exit: never a traceback, and never after the work it would
have thrown away (nothing here needs a server: each check comes before the first request)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench_helpers import bundled_synth, write_trace_file

from loom.bench.importers import Classifier, import_log
from loom.cli.main import main
from loom.workload.trace import load_trace

pytestmark = pytest.mark.unit

NO_SERVER = "http://127.0.0.1:9"  # nothing listens: reaching it would say "connection refused"


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line error of a command that must fail (exit 2, as argparse's own)."""
    try:
        status = main(argv)
    except SystemExit as e:  # argparse rejected a flag's value
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err and err.strip(), err
    return err.strip().splitlines()[-1]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_trace_file(tmp_path / "t.jsonl", ["a b c", "d e f"], 4, ["chat"])


# -- the trace file --------------------------------------------------------------------------

@pytest.mark.parametrize("line, where", [
    ("[1, 2, 3]", "expected a JSON object"),
    ('{"prompt": "a", "max_tokens": 4, "priority": "high"}', "priority"),
    ('{"prompt": "", "max_tokens": 4}', "prompt"),
    ('{"prompt": "a", "max_tokens": 4, "arrival_s": NaN}', "arrival_s"),
    ('{"prompt": "a", "prompt_len": -3, "max_tokens": 4}', "prompt_len"),
    ('{"prompt": "a", "max_tokens": true}', "max_tokens"),
    ('{"id": "x", "prompt": "a", "max_tokens": 4}', "id 'x' repeats line 1"),
])
def test_a_bad_trace_line_is_named_by_file_line_and_field(tmp_path: Path, line: str,
                                                          where: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "x", "prompt": "ok", "max_tokens": 4}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"t.jsonl:2: .*{where}"):
        load_trace(path)


def test_a_trace_that_is_not_utf8_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"prompt": "ok", "max_tokens": 4}\n{"prompt": "\xff", "max_tokens": 4}\n')
    with pytest.raises(ValueError, match="t.jsonl:2: not UTF-8"):
        load_trace(path)


# -- result files ----------------------------------------------------------------------------

@pytest.mark.parametrize("content", [
    "[]", "null", '{"kind": "run"}', '{"kind": "sweep", "runs": [{}]}', '{"kind": "sweep"}'])
@pytest.mark.parametrize("command", [["diagnose"], ["bench", "scorecard"]])
def test_a_file_that_is_no_result_is_one_error(tmp_path: Path, capsys, content: str,
                                               command: list[str]) -> None:
    path = tmp_path / "r.json"
    path.write_text(content)
    assert "r.json" in _error([*command, str(path)], capsys)


@pytest.mark.parametrize("command", [["diagnose"], ["bench", "scorecard"], ["bench", "report"]])
def test_a_folder_or_path_that_holds_no_result_says_what_to_give(tmp_path: Path, capsys,
                                                                 command: list[str]) -> None:
    folder = tmp_path / "sweeps"
    folder.mkdir()
    assert "a folder without compare.json" in _error([*command, str(folder)], capsys)
    assert "no such file" in _error([*command, str(tmp_path / "gone.json")], capsys)


# -- loom bench trace ------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--arrival-rate", "0"], "--arrival-rate must be > 0"),
    (["--arrival-rate", "-1"], "--arrival-rate must be > 0"),
    (["-n", "0"], "-n/--num-requests"),
    (["-n", "-3"], "-n/--num-requests"),
    (["--burst-prob", "2"], "--burst-prob"),
    (["--cancel-fraction", "1.5"], "--cancel-fraction"),
    (["--burst-window", "-1"], "--burst-window"),
    (["--cancel-after", "5-1"], "--cancel-after"),
    (["--burst-size", "12-4"], "--burst-size"),
])
def test_trace_refuses_values_it_cannot_generate(tmp_path: Path, capsys, flags: list[str],
                                                 message: str) -> None:
    out = tmp_path / "t.jsonl"
    assert message in _error(["bench", "trace", "-o", str(out), *flags], capsys)
    assert not out.exists()


def test_a_mooncake_block_size_of_zero_is_refused(tmp_path: Path, capsys) -> None:
    log = Path(__file__).parent / "data" / "mooncake_trace.jsonl"
    assert "--hash-block-size must be >= 1" in _error(
        ["bench", "trace", "--from-log", str(log), "--format", "mooncake",
         "--hash-block-size", "0", "-o", str(tmp_path / "t.jsonl")], capsys)


@pytest.mark.parametrize("target", ["/proc/x.json", "DIR"])
def test_trace_output_is_checked_before_generating(tmp_path: Path, capsys, target: str) -> None:
    path = str(tmp_path) if target == "DIR" else target
    assert f"-o {path}" in _error(["bench", "trace", "-o", path], capsys)


def test_a_logged_response_given_as_its_text(tmp_path: Path) -> None:
    synth = bundled_synth()
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"timestamp": 1.0, "request": {"prompt": "Hello there"},
                               "response": "General Kenobi, you are a bold one"}) + "\n"
                   + json.dumps({"timestamp": 2.0, "request": {"prompt": "Hi"},
                                 "response": 42}) + "\n")
    with pytest.raises(ValueError, match="log.jsonl:2: response must be its text"):
        import_log(log, "openai", synth, Classifier())
    log.write_text(log.read_text().splitlines()[0] + "\n")
    (request,) = import_log(log, "openai", synth, Classifier()).requests
    assert request.max_tokens == synth.count("General Kenobi, you are a bold one")


# -- loom bench run / sweep / compare / scorecard --------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--rate", "2", "--burstiness", "0"], "--burstiness must be > 0"),
    (["--rate", "inf", "--ramp-up", "linear:5s"], "--ramp-up need a finite --rate"),
    (["--rate", "2", "--duration", "-1"], "--duration must be > 0"),
    (["--rate", "2", "-n", "0"], "-n/--num-requests"),
    (["--rate", "2", "-n", "-1"], "-n/--num-requests"),
    (["--rate", "2", "--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--rate", "2", "--slo", "ttft_p95=-1"], "--slo: bad term"),
    (["--rate", "2", "--gpu-cost-per-hour", "-5"], "--gpu-cost-per-hour"),
    (["--rate", "2", "--out", "/proc/x.json"], "--out /proc/x.json: cannot write"),
    (["--rate", "abc"], "a rate is requests/s > 0"),
    (["--rate", "trace"], "--rate trace needs arrival_s"),
    (["--rate", "2", "--repeats", "0"], "--repeats must be >= 1"),
])
def test_run_checks_its_input_before_the_server(trace: Path, capsys, flags: list[str],
                                                message: str) -> None:
    err = _error(["bench", "run", "--base-url", NO_SERVER, "--trace", str(trace), *flags], capsys)
    assert message in err and "refused" not in err


def test_run_reads_the_trace_before_asking_the_server(tmp_path: Path, capsys) -> None:
    err = _error(["bench", "run", "--base-url", NO_SERVER, "--trace", str(tmp_path / "no.jsonl"),
                  "--rate", "1"], capsys)
    assert "no.jsonl" in err and "refused" not in err


def test_run_out_to_a_directory_is_refused(trace: Path, tmp_path: Path, capsys) -> None:
    assert "is a directory" in _error(["bench", "run", "--base-url", NO_SERVER, "--trace",
                                       str(trace), "--rate", "1", "--out", str(tmp_path)], capsys)


@pytest.mark.parametrize("url", ["127.0.0.1:8499", "ftp://127.0.0.1:8499"])
def test_a_url_without_http_is_named(trace: Path, capsys, url: str) -> None:
    err = _error(["bench", "run", "--base-url", url, "--trace", str(trace), "--rate", "1"], capsys)
    assert "--base-url needs http:// or https://" in err


@pytest.fixture
def mute_server() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_server_that_never_answers_is_reported_within_the_timeout(trace: Path, capsys,
                                                                    mute_server: str) -> None:
    start = time.monotonic()
    err = _error(["bench", "run", "--base-url", mute_server, "--trace", str(trace), "--rate", "1",
                  "--request-timeout", "1"], capsys)
    assert f"no answer from {mute_server} within 1 s" in err
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("flags, message", [
    (["--rates", "2,-1"], "--rates"),
    (["--rates", "0"], "--rates"),
    (["--rates", ""], "--rates"),
    (["--rates", "2,inf"], "--rates"),
    (["--auto", "--start-rate", "0"], "--start-rate must be > 0"),
    (["--auto", "--start-rate", "8", "--max-rate", "2"], "--max-rate (2) must be at least"),
    (["--rates", "1", "--max-p95-queue", "-1"], "--max-p95-queue must be >= 0"),
    (["--overlap", "1,2", "--max-concurrency", "4"], "drop --max-concurrency"),
    (["--overlap", "0"], "--overlap"),
])
def test_sweep_checks_every_point_before_running_any(trace: Path, capsys, flags: list[str],
                                                     message: str) -> None:
    err = _error(["bench", "sweep", "--base-url", NO_SERVER, "--trace", str(trace), *flags],
                 capsys)
    assert message in err and "refused" not in err


def test_compare_checks_its_output_dir_first(trace: Path, tmp_path: Path, capsys) -> None:
    file = tmp_path / "file"
    file.write_text("")
    assert "--output-dir" in _error(["bench", "compare", "--trace", str(trace), "--rates", "1",
                                     "--output-dir", str(file)], capsys)


def test_scorecard_markdown_goes_into_a_new_folder(tmp_path: Path, capsys) -> None:
    from test_bench_diagnose import make_run

    from loom.workload.results import save_json

    save_json(make_run(), tmp_path / "run.json")
    md = tmp_path / "new" / "folder" / "card.md"
    assert main(["bench", "scorecard", str(tmp_path / "run.json"), "--markdown", str(md)]) == 0
    assert "Offered req/s" in md.read_text()
    assert "--markdown /proc/x.md" in _error(
        ["bench", "scorecard", str(tmp_path / "run.json"), "--markdown", "/proc/x.md"], capsys)


def test_compare_simulates_a_gpu_named_by_model_and_gpus(tmp_path: Path) -> None:
    """`simulate:--model M --gpus G` writes its sweep under the GPU's name (h100-sxm-tp1);
    compare finds it and files it, and its runs, under the configuration's own name."""
    from loom.workload.results import load_result

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "prompt_len": 100 + i, "max_tokens": 16,
                                        "arrival_s": 0.5 * i}) + "\n" for i in range(8)))
    out = tmp_path / "cmp"
    assert main(["bench", "compare", "--trace", str(path), "--rates", "1", "--output-dir",
                 str(out), "--config", "a=simulate:--model llama-3.1-8b --gpus h100-sxm"]) == 0
    (sweep,) = load_result(out)["sweeps"]
    assert sweep["label"] == "a" and sweep["simulated"]
    assert sweep["config"]["flags"] == "simulate:--model llama-3.1-8b --gpus h100-sxm"
    assert [run["label"] for run in sweep["runs"]] == ["simulated a @1/s"]


def test_sharegpt_records_of_another_shape_are_skipped_and_bad_json_named(tmp_path: Path,
                                                                          capsys) -> None:
    """A list, a string or a turn that is not an object is no conversation (skipped); a
    line that is not JSON is an error naming it."""
    bundled_synth()
    path = tmp_path / "c.jsonl"
    turns = [{"from": "human", "value": "Tell me a story about a cat please"},
             {"from": "gpt", "value": "Once upon a time there was a cat who sat."}]
    path.write_text("\n".join([json.dumps("x"), json.dumps({"conversations": [3, *turns]}),
                               json.dumps([1, 2])]) + "\n")
    out = tmp_path / "t.jsonl"
    assert main(["bench", "trace", "--from-sharegpt", str(path), "-o", str(out)]) == 0
    assert len(load_trace(out).requests) == 1
    path.write_text(path.read_text() + "{oops\n")
    assert "c.jsonl:4: not JSON" in _error(["bench", "trace", "--from-sharegpt", str(path),
                                            "-o", str(out)], capsys)


def test_compare_refuses_a_simulated_config_it_cannot_run_before_any_server(
        trace: Path, tmp_path: Path, capsys) -> None:
    """The server configuration comes first, but nothing starts: --auto is refused for the
    simulated one up front (its server command would fail if run)."""
    err = _error(["bench", "compare", "--trace", str(trace), "--auto", "--output-dir",
                  str(tmp_path / "cmp"), "--server-cmd", "false {port}", "--config", "real=",
                  "--config", "sim=simulate:--profile p.json"], capsys)
    assert "--config sim=simulate:...: the simulator takes --rates" in err
    assert not list((tmp_path / "cmp").glob("*.server.log"))
