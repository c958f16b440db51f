"""`sandbox_fusion`: run code in an external sandbox service over HTTP, instead of a local child process.

The request is SandboxFusion's `run_code` API (https://github.com/bytedance/SandboxFusion), which verl's sandbox
tools also use: POST JSON ``{"code", "language", "run_timeout", "memory_limit_MB", ...}``, answer
``{"status": "Success"|"Failed"|"SandboxError", "run_result": {"stdout", "stderr", "return_code", ...}}``::

    python -m hybridrl rollout=agent 'agent.tools=[sandbox_fusion]' \\
        +agent.tool_options.sandbox_fusion.url=http://sandbox-host:8080/run_code

Another service: subclass `RemoteCodeTool` and override `payload` and `read_response`, then name your class in
`agent.tools=[my_pkg.my_module:MySandbox]`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from hybridrl.agent.tools.base import Tool, ToolError


class RemoteCodeTool(Tool):
    """Posts the model's code to `url` as JSON and returns the service's output (a thread per call)."""

    name = "python"
    description = (
        "Run Python 3 code and return what it prints (stdout and stderr). Each call starts fresh. "
        "Use print() to see results."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python program to run."}},
        "required": ["code"],
    }

    def __init__(
        self,
        url: str,
        run_timeout_s: float = 10.0,
        memory_mb: int = 1024,
        language: str = "python",
        request_timeout_s: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        """`url`: the service endpoint; limits sent with every request; `headers`: e.g. an Authorization header."""
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(f"agent.tool_options.<tool>.url must be an http(s) URL, got {url!r}")
        self.url, self.run_timeout_s, self.memory_mb, self.language = url, run_timeout_s, memory_mb, language
        self.request_timeout_s, self.headers = request_timeout_s, dict(headers or {})

    def payload(self, code: str) -> dict[str, Any]:
        """The JSON body of one request."""
        return {
            "code": code,
            "language": self.language,
            "run_timeout": self.run_timeout_s,
            "memory_limit_MB": self.memory_mb,
        }

    def read_response(self, body: dict[str, Any]) -> str:
        """The text for the model from the service's JSON answer; raise ToolError when the code failed."""
        return json.dumps(body)

    def call(self, arguments: dict[str, Any]) -> str:
        data = json.dumps(self.payload(str(arguments["code"]))).encode()
        request = urllib.request.Request(
            self.url,
            data=data,
            method="POST",
            headers={"Content-Type": "application/json", "Accept": "application/json", **self.headers},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
                body = json.loads(response.read().decode("utf-8", errors="replace"))
        except urllib.error.HTTPError as e:
            raise ToolError(f"sandbox service answered HTTP {e.code}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise ToolError(f"sandbox service unreachable ({e})") from None
        except json.JSONDecodeError:
            raise ToolError("sandbox service answered something that is not JSON") from None
        return self.read_response(body)


class SandboxFusionTool(RemoteCodeTool):
    """Python through a SandboxFusion `run_code` endpoint (`agent.tools=[sandbox_fusion]`)."""

    name = "python"

    def read_response(self, body: dict[str, Any]) -> str:
        run = body.get("run_result") or {}
        out = (run.get("stdout") or "") + (run.get("stderr") or "")
        status = body.get("status")
        if status == "Success":
            return out if out.strip() else "(no output; print() the values you want to see)"
        if status == "SandboxError":
            raise ToolError(f"sandbox error: {body.get('message') or 'unknown'}")
        why = run.get("status") or status or "failed"
        code = run.get("return_code")
        raise ToolError(f"{why} (exit code {code})\n{out}".rstrip())
