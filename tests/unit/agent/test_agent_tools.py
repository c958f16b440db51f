"""Tools: the calculator's whitelist and bounds, the python tool's limits and scrubbed environment, the runner's
error handling, loading user tools by import path, and the SandboxFusion client against a local stub server."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from hybridrl.agent.parsers import ToolCall
from hybridrl.agent.runner import TRUNCATION_MARK, ToolRunner, clip
from hybridrl.agent.tools import Tool, ToolError, build_tools
from hybridrl.agent.tools.calculator import Calculator, evaluate
from hybridrl.agent.tools.python import PythonTool
from hybridrl.agent.tools.remote import SandboxFusionTool
from hybridrl.errors import ConfigError


def run_call(tools: dict[str, Tool], name: str, args: dict, timeout: float = 10.0, max_chars: int = 2000):
    runner = ToolRunner(tools, lambda _: timeout, max_chars, 8)
    try:
        return asyncio.run(runner.run(ToolCall(name, args)))
    finally:
        runner.close()


# -- calculator -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "expr, want",
    [
        ("48213*9127", 440040051),  # 48213*9000 + 48213*127 = 433917000 + 6123051
        ("(3+4)**2/7", 7.0),
        ("-2**2", -4),
        ("7//2 + 7%3", 4),
        ("2**-1", 0.5),
        ("1_000 * 3", 3000),
        ("99999999999999999999 + 1", 10**20),
    ],
)
def test_calculator_values(expr, want):
    assert evaluate(expr) == want


def test_calculator_formats_integral_floats_as_integers():
    assert Calculator().call({"expression": "6/3"}) == "2"
    assert Calculator().call({"expression": "1/4"}) == "0.25"


@pytest.mark.parametrize(
    "expr, words",
    [
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("__import__", "the name '__import__' is not allowed"),
        ("(1).__class__", "attribute access"),
        ("x + 1", "name 'x'"),
        ("abs(-1)", "function calls are not allowed"),
        ("'a' * 3", "only numbers"),
        ("[1] * 10", "List is not allowed"),
        ("True + 1", "only numbers"),
        ("2 ** 100000", "exponent 100000 is too large"),
        ("10 ** 5000", "result too large"),
        ("9 ** 9 ** 9", "too large"),
        ("(2 ** 4000) * (2 ** 4000)", "result too large"),
        ("2.0 ** 5000", "too large for a float"),
        ("1 / 0", "division by zero"),
        ("2 ^ 10", "write a**b"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("1 +", "not an arithmetic expression"),
        ("1+" * 300 + "1", "longer than 500"),
        ("-" * 300 + "1", "more than 200 parts"),
        ("+".join(["1"] * 120), "more than 200 parts"),
        ("(-8) ** 0.5", "not a real number"),
    ],
)
def test_calculator_rejects(expr, words):
    with pytest.raises(ToolError) as e:
        evaluate(expr)
    assert words in str(e.value)


def test_calculator_bounds_are_fast():
    t0 = time.perf_counter()
    for expr in ("10 ** 5000", "9 ** 9 ** 9", "(10 ** 1200) ** 3", "2 ** 10000 * 2 ** 10000"):
        with pytest.raises(ToolError):
            evaluate(expr)
    assert time.perf_counter() - t0 < 0.5


# -- python -----------------------------------------------------------------------------------------------------
def test_python_runs_code_and_returns_output():
    out = run_call(
        {"python": PythonTool()}, "python", {"code": "print(6 * 7)\nimport sys; print('e', file=sys.stderr)"}
    )
    assert not out.error and out.content.split() == ["42", "e"]
    out = run_call({"python": PythonTool()}, "python", {"code": "x = 1"})
    assert not out.error and "no output" in out.content


def test_python_environment_is_scrubbed_and_cwd_empty(monkeypatch):
    monkeypatch.setenv("HYBRIDRL_TEST_SECRET", "s3cret-token")
    code = "import os, json; print(json.dumps({'env': dict(os.environ), 'files': os.listdir('.'), 'cwd': os.getcwd()}))"
    out = run_call({"python": PythonTool()}, "python", {"code": code})
    assert not out.error, out.content
    got = json.loads(out.content)
    assert "s3cret-token" not in out.content
    assert "HOME" not in got["env"] and "HYBRIDRL_TEST_SECRET" not in got["env"]
    assert got["files"] == [] and got["cwd"] != os.getcwd()
    assert not os.path.exists(got["cwd"])  # the temporary directory is removed afterwards


def test_python_wall_clock_timeout_kills_the_child():
    from tests.unit.agent.test_python_sandbox import processes_with

    marker = f"{60 + os.getpid() % 1000 / 1000 + time.time() % 1 / 1e6:.9f}"  # a sleep no one else runs
    code = f"import os\nos.execvp('sleep', ['sleep', {marker!r}])"
    t0 = time.perf_counter()
    out = run_call({"python": PythonTool()}, "python", {"code": code}, timeout=1.0)
    assert out.error and "timed out after 1 s" in out.content
    assert time.perf_counter() - t0 < 5
    assert processes_with(marker) == []


def test_python_cpu_limit_stops_an_infinite_loop():
    t0 = time.perf_counter()
    out = run_call({"python": PythonTool(cpu_seconds=1)}, "python", {"code": "while True:\n    pass"}, timeout=30)
    assert out.error and "SIGXCPU (CPU time limit)" in out.content, out.content
    assert time.perf_counter() - t0 < 15


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(4 * 1024 ** 3)", "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))"],
    ids=["one-allocation", "growing"],
)
def test_python_memory_limit_stops_a_memory_bomb(code):
    out = run_call({"python": PythonTool(memory_mb=256)}, "python", {"code": code}, timeout=30)
    assert out.error and "MemoryError" in out.content, out.content


def test_python_output_flood_is_cut():
    out = run_call(
        {"python": PythonTool(max_output_bytes=10_000)},
        "python",
        {"code": "while True:\n    print('x' * 1000)"},
        timeout=30,
    )
    assert out.error and "output longer than 10000 bytes" in out.content
    assert len(out.content) <= 2000 and out.content.endswith(TRUNCATION_MARK)


def test_python_nonzero_exit_is_an_error_with_the_traceback():
    out = run_call({"python": PythonTool()}, "python", {"code": "print('before')\n1/0"})
    assert out.error and "exit code 1" in out.content and "ZeroDivisionError" in out.content and "before" in out.content


# -- the runner's error paths -----------------------------------------------------------------------------------
class Echo(Tool):
    name = "echo"
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["text"],
        "additionalProperties": False,
    }

    def call(self, arguments):
        return arguments["text"] * arguments.get("n", 1)


class AsyncSlow(Tool):
    name = "aslow"

    async def acall(self, arguments):
        await asyncio.sleep(5)
        return "late"


class ReturnsDict(Tool):
    name = "dict"

    def call(self, arguments):
        return {"a": [1, 2]}


class ReturnsNone(Tool):
    name = "none"

    def call(self, arguments):
        return None


class Raises(Tool):
    name = "raises"

    def call(self, arguments):
        raise KeyError("missing")


@pytest.mark.parametrize(
    "name, args, error, words",
    [
        ("echo", {"text": "hi", "n": 2}, False, "hihi"),
        ("echo", {}, True, "needs argument(s) ['text']"),
        ("echo", {"text": 3}, True, "must be a JSON string"),
        ("echo", {"text": "a", "n": True}, True, "must be a JSON integer"),
        ("echo", {"text": "a", "extra": 1}, True, "takes no argument(s) ['extra']"),
        ("dict", {}, False, '{"a": [1, 2]}'),
        ("none", {}, True, "returned NoneType, not text"),
        ("raises", {}, True, "raised KeyError"),
        ("aslow", {}, True, "timed out after 0.1 s"),
        ("missing", {}, True, "unknown tool 'missing'; available tools: aslow, dict, echo, none, raises"),
    ],
)
def test_runner_outcomes(name, args, error, words):
    tools = {t.name: t for t in (Echo(), AsyncSlow(), ReturnsDict(), ReturnsNone(), Raises())}
    out = run_call(tools, name, args, timeout=0.1)
    assert out.error is error and words in out.content, out.content
    assert out.content.startswith("Error: ") is error


def test_runner_clips_long_output():
    out = run_call({"echo": Echo()}, "echo", {"text": "y" * 5000}, max_chars=100)
    assert len(out.content) == 100 and out.content.endswith(TRUNCATION_MARK)
    assert clip("short", 100) == "short"


# -- building tools -----------------------------------------------------------------------------------------------
def test_build_tools_by_name_and_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_tools_mod.py").write_text(
        textwrap.dedent("""
        from hybridrl.agent.tools import Tool

        class Upper(Tool):
            name = "upper"
            description = "Upper-case a text."
            parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

            def __init__(self, suffix: str = ""):
                self.suffix = suffix

            def call(self, arguments):
                return arguments["text"].upper() + self.suffix

        class NotATool:
            pass
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = build_tools(["calculator", "my_tools_mod:Upper"], {"Upper": {"suffix": "!"}})
    assert sorted(tools) == ["calculator", "upper"]
    assert run_call(tools, "upper", {"text": "abc"}).content == "ABC!"
    assert tools["upper"].schema() == {
        "type": "function",
        "function": {
            "name": "upper",
            "description": "Upper-case a text.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
    }
    with pytest.raises(ConfigError, match="not a subclass of hybridrl.agent.tools.Tool"):
        build_tools(["my_tools_mod:NotATool"])
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        build_tools(["no_such_module_xyz:Tool"])
    with pytest.raises(ConfigError, match="not a built-in tool"):
        build_tools(["abacus"])
    with pytest.raises(ConfigError, match=r"agent.tool_options.Upper: building tool 'my_tools_mod:Upper' failed"):
        build_tools(["my_tools_mod:Upper"], {"Upper": {"colour": "red"}})
    with pytest.raises(ConfigError, match="two tools are named 'python'"):
        build_tools(["python", "sandbox_fusion"], {"sandbox_fusion": {"url": "http://localhost:1/run_code"}})


# -- the SandboxFusion client -----------------------------------------------------------------------------------
class _Stub(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Stub.received.append(body)
        if "fail" in body["code"]:
            answer = {
                "status": "Failed",
                "run_result": {"status": "Finished", "stdout": "", "stderr": "Traceback: boom", "return_code": 1},
            }
        else:
            answer = {
                "status": "Success",
                "run_result": {"status": "Finished", "stdout": "42\n", "stderr": "", "return_code": 0},
            }
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def stub_url():
    server = HTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    server.shutdown()
    server.server_close()


def test_sandbox_fusion_client(stub_url):
    tool = SandboxFusionTool(url=stub_url, run_timeout_s=3, memory_mb=128)
    ok = run_call({"python": tool}, "python", {"code": "print(42)"})
    assert not ok.error and ok.content == "42\n"
    assert _Stub.received[-1] == {"code": "print(42)", "language": "python", "run_timeout": 3, "memory_limit_MB": 128}
    bad = run_call({"python": tool}, "python", {"code": "fail()"})
    assert bad.error and "exit code 1" in bad.content and "boom" in bad.content


def test_sandbox_fusion_unreachable_is_an_error_not_a_crash():
    tool = SandboxFusionTool(url="http://127.0.0.1:9/run_code", request_timeout_s=2)
    out = run_call({"python": tool}, "python", {"code": "print(1)"})
    assert out.error and "unreachable" in out.content
    with pytest.raises(ValueError, match="http"):
        SandboxFusionTool(url="file:///etc/passwd")
