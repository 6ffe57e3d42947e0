"""The `loom` command as a newcomer meets it: help without torch, every default shown, and each
error message (with its exit status) before any model loads."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
from bench_helpers import write_trace_file

import loom
from loom.bench.server import free_port
from loom.cli.main import COMMANDS, build_parser, main, parse_args

pytestmark = pytest.mark.unit


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_loom_help_imports_no_torch() -> None:
    result = _run_python(
        "import sys\n"
        "from loom.cli.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert 'torch' not in sys.modules, 'loom --help imported torch'\n")
    assert result.returncode == 0, result.stderr
    for command in ("generate", "serve", "bench", "diagnose"):
        assert command in result.stdout


def test_loom_bench_imports_no_torch() -> None:
    """`loom bench` only talks HTTP: a machine without torch can benchmark a remote server."""
    result = _run_python(
        "import importlib, pkgutil, sys\n"
        "import loom.bench\n"
        "for m in pkgutil.iter_modules(loom.bench.__path__):\n"
        "    importlib.import_module('loom.bench.' + m.name)\n"
        "from loom.workload.tokens import load_tokenizer\n"
        "load_tokenizer(None)\n"
        "from loom.cli.main import build_parser\n"
        "build_parser(['bench']); build_parser(['diagnose'])\n"
        "assert 'torch' not in sys.modules, 'loom.bench imported torch'\n")
    assert result.returncode == 0, result.stderr


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"loom {loom.__version__}"


def test_log_level_after_the_sub_command_too() -> None:
    assert parse_args(["diagnose", "r.json"]).log_level == "INFO"
    assert parse_args(["--log-level", "DEBUG", "diagnose", "r.json"]).log_level == "DEBUG"
    assert parse_args(["diagnose", "r.json", "--log-level", "DEBUG"]).log_level == "DEBUG"
    args = parse_args(["bench", "trace", "-o", "t.jsonl", "--log-level", "WARNING"])
    assert args.log_level == "WARNING"
    assert parse_args(["--log-level", "debug", "diagnose", "r.json"]).log_level == "DEBUG"


def test_an_unknown_log_level_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "LOUD", "plan"])
    assert exit_info.value.code == 2
    assert "argument --log-level: invalid choice: 'LOUD'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, usage", [
    (["generate", "hi", "--bogus"], "usage: loom generate"),
    (["bench", "run", "--base-url", "u", "--trace", "t", "--bogus"], "usage: loom bench run"),
    (["diagnose", "r.json", "--bogus"], "usage: loom diagnose"),
])
def test_unknown_flag_shows_the_sub_commands_usage(argv, usage, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert usage in err and "unrecognized arguments: --bogus" in err


def _parsers(parser: argparse.ArgumentParser, name: str = "loom"):
    """(name, parser) of `parser` and every sub-command below it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child_name, child in action.choices.items():
                yield from _parsers(child, f"{name} {child_name}")


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "diagnose", "plan",
                                     "simulate"])
def test_every_flag_states_its_default(command: str) -> None:
    """Each option's help says its default (or, "none = ...", what happens without it), on/off
    switches included, and never the meaningless "(default: None)"."""
    for name, parser in _parsers(build_parser([command])):
        if f"loom {command}" not in name:
            continue
        required = {a for g in parser._mutually_exclusive_groups if g.required
                    for a in g._group_actions}  # one of them must be given: no default
        for action in parser._actions:
            if not action.option_strings or action.required or action in required \
                    or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            text = parser._get_formatter()._expand_help(action)
            assert "default" in text or "none = " in text, \
                f"{name} {action.option_strings[0]}: {text!r}"
            assert "(default: None)" not in text, f"{name} {action.option_strings[0]}"


def test_generate_help_is_grouped_by_what_a_user_tunes() -> None:
    parser = build_parser(["generate"])
    generate = parser._subparsers._group_actions[0].choices["generate"]
    titles = [group.title for group in generate._action_groups]
    assert {"Sampling", "Model", "KV cache", "Scheduling"} <= set(titles)
    help_text = generate.format_help()
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in help_text
    assert "(default: on)" in help_text and "(default: off)" in help_text
    assert "ModelConfig" not in help_text


def test_serve_help_has_server_and_admission_sections() -> None:
    parser = build_parser(["serve"])
    serve = parser._subparsers._group_actions[0].choices["serve"]
    titles = {group.title for group in serve._action_groups}
    assert {"Server", "Admission", "Model", "KV cache", "Scheduling"} <= titles
    # each field under the heading of the class that declares it: ServerConfig is built on
    # HttpLimits, built on AdmissionConfig, and names no group on any field
    flags = {group.title: {a.option_strings[-1] for a in group._group_actions}
             for group in serve._action_groups}
    assert {"--max-num-queued-reqs", "--queue-timeout", "--max-connections",
            "--max-concurrent-per-client", "--max-tokens-default"} <= flags["Admission"]
    assert {"--host", "--api-key", "--read-timeout"} <= flags["Server"]
    assert not flags["Server"] & flags["Admission"]


def test_bench_run_help_says_rate_or_concurrency_is_required(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "one is required" in out and "(default: 0)" in out  # --seed's 0 is a default


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.name in ("plan", "simulate")],
                         ids=lambda c: c.name)
def test_plan_and_simulate_are_registered(command, capsys) -> None:
    if not command.available():
        pytest.skip(f"{command.adder} is not written yet")
    with pytest.raises(SystemExit) as exit_info:
        main([command.name, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: loom {command.name}" in capsys.readouterr().out


# -- errors, each with its message and exit status -------------------------------------------

def test_generate_rejects_max_tokens_0_before_loading_the_model(monkeypatch, capsys) -> None:
    from loom.entrypoints.llm import LLM

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(LLM, "from_config", no_load)
    assert main(["generate", "hi", "--max-tokens", "0"]) == 2
    assert re.search(r"loom: error: max_tokens must be .*>= 1, got 0", capsys.readouterr().err)
    assert main(["generate", "hi", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs must be >= 1" in capsys.readouterr().err


def test_generate_on_cuda_without_it_says_so_before_loading(monkeypatch, capsys) -> None:
    import torch

    from loom.entrypoints.llm import LLM

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the device was checked")

    monkeypatch.setattr(LLM, "from_config", no_load)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    assert main(["generate", "hi", "--device", "cuda"]) == 2
    assert "--device cuda: CUDA is not available in this torch build" in \
        capsys.readouterr().err


@pytest.mark.parametrize("extra", [[], ["--model", "x"]], ids=["no-model", "model"])
def test_bench_run_against_a_dead_port(tmp_path, capsys, extra) -> None:
    trace = write_trace_file(tmp_path / "t.jsonl", ["hi"], 2, ["chat"])
    url = f"http://127.0.0.1:{free_port()}"
    status = main(["bench", "run", "--base-url", url, "--trace", str(trace),
                   "--max-concurrency", "1", *extra])
    assert status == 2
    assert f"loom: error: connection refused at {url}" in capsys.readouterr().err


def test_bench_run_needs_a_rate_or_a_concurrency(tmp_path, capsys) -> None:
    trace = write_trace_file(tmp_path / "t.jsonl", ["hi"], 2, ["chat"])
    assert main(["bench", "run", "--base-url", "http://127.0.0.1:1", "--trace",
                 str(trace)]) == 2
    assert "give --rate (open loop) or --max-concurrency" in capsys.readouterr().err


def test_diagnose_a_trace_file_says_what_it_is(tmp_path, capsys) -> None:
    trace = write_trace_file(tmp_path / "t.jsonl", ["hi", "ho"], 2, ["chat"])
    assert main(["diagnose", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "is a trace (JSONL), not a bench result" in err and "loom bench run" in err


def test_diagnose_other_json_says_it_is_no_result(tmp_path, capsys) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"kind": "something"}))
    assert main(["diagnose", str(path)]) == 2
    assert "not a loom bench result" in capsys.readouterr().err


def test_diagnose_a_missing_file(tmp_path, capsys) -> None:
    assert main(["diagnose", str(tmp_path / "none.json")]) == 2
    assert "none.json: no such file" in capsys.readouterr().err


def test_serve_refuses_a_port_out_of_range_before_binding(capsys) -> None:
    assert main(["serve", "--port", "99999"]) == 2
    assert "loom: error: port must be in 0-65535, got 99999" in capsys.readouterr().err


def test_serve_api_key_help_names_every_open_route(capsys) -> None:
    """Every route but /health needs the key (guards.ApiKeyGuard); /metrics has its own
    flags: the help says so."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "every route but /health" in out
    for flag in ("--metrics-api-key", "--public-metrics", "--enable-admin-routes"):
        assert flag in out


# -- flags generated from dataclasses (cli/flags.py) ------------------------------------------

def test_flags_from_a_dataclass_with_a_short_option_a_positional_and_a_second_spelling(
        capsys) -> None:
    from dataclasses import dataclass

    from loom.cli.dataclass_flags import from_cli_args
    from loom.cli.flags import add_flags, opt, required
    from loom.workload.load import parse_count

    def split(text: str) -> tuple[str, ...]:
        return tuple(text.split(","))

    @dataclass(frozen=True)
    class Options:
        out: str = required("where to write")
        path: str = opt("", "a file", positional=True)
        count: int | None = opt(None, "how many; default: all", short="-c", parse=parse_count)
        names: tuple[str, ...] | None = opt(None, "names; default: none", flag="--name",
                                           aliases=("--names",), parse=split)
        loud: bool = opt(False, "say more")

    parser = argparse.ArgumentParser(prog="t")
    add_flags(parser, Options)
    args = parser.parse_args(["f.txt", "-c", "3", "--names", "a,b", "--loud", "--out", "o"])
    assert from_cli_args(Options, args) == Options("o", "f.txt", 3, ("a", "b"), True)
    assert from_cli_args(Options, parser.parse_args(["g", "--out", "o", "--no-loud"])) == \
        Options("o", "g", None, None, False)
    with pytest.raises(SystemExit):
        parser.parse_args(["f", "--out", "o", "-c", "0"])  # the parse function's ValueError
    assert "argument -c/--count: expected an integer >= 1, got '0'" in capsys.readouterr().err
    help_text = parser.format_help()
    assert "-c COUNT, --count COUNT" in help_text and "--name NAME, --names NAME" in help_text
    assert "(default: off)" in help_text


def test_python_m_loom_cli_is_the_loom_command() -> None:
    out = subprocess.run([sys.executable, "-m", "loom.cli", "--version"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == f"loom {loom.__version__}"
