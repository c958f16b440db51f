"""The tool interface: a name, a JSON schema of its arguments, and a call that returns text for the model.

A tool is a class; the agent loop builds one instance per worker (keyword arguments from `agent.tool_options`)::

    class WordCount(Tool):
        name = "word_count"
        description = "Count the words of a text."
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

        def call(self, arguments: dict) -> str:            # synchronous: runs in the loop's thread pool
            return str(len(arguments["text"].split()))

Override `async def acall(self, arguments)` instead for a tool that awaits I/O (HTTP, a subprocess). Raise
`ToolError(message)` for a failure the model should read; any other exception, a timeout or a result that is not
text is turned into an error message by the runner too. None of them stops the run.
"""

from __future__ import annotations

from typing import Any, ClassVar

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class ToolError(Exception):
    """A failed call; the message is what the model reads (after "Error: ")."""


class Tool:
    """Base class of tools. Subclasses set `name`, `description`, `parameters` and implement `call` or `acall`."""

    name: ClassVar[str] = ""
    """The name the model calls the tool by (unique among the tools of a run)."""
    description: ClassVar[str] = ""
    """One or two sentences the model reads in the tools section of its prompt."""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}
    """JSON schema of the arguments object."""

    def schema(self) -> dict[str, Any]:
        """The form `tokenizer.apply_chat_template(messages, tools=[...])` takes (OpenAI function format)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def call(self, arguments: dict[str, Any]) -> str:
        """Run the tool on validated arguments and return its output (synchronous tools override this)."""
        raise NotImplementedError(f"tool {self.name!r} implements neither call nor acall")

    async def acall(self, arguments: dict[str, Any]) -> str:
        """Asynchronous form; tools that await I/O override this instead of `call`."""
        raise NotImplementedError

    @property
    def is_async(self) -> bool:
        """True when the subclass overrides `acall` (the runner awaits it instead of using a thread)."""
        return type(self).acall is not Tool.acall

    def close(self) -> None:
        """Release what the tool holds (sessions, pools); called once when the loop shuts down."""


def check_arguments(schema: dict[str, Any], arguments: dict[str, Any], tool: str) -> None:
    """Check the arguments object against the top level of a JSON schema (required keys, declared types,
    no unknown keys when `additionalProperties` is false); raises ToolError saying what to fix."""
    props: dict[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        raise ToolError(f"tool {tool!r} needs argument(s) {missing}; got {sorted(arguments)}")
    if schema.get("additionalProperties") is False:
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            raise ToolError(f"tool {tool!r} takes no argument(s) {unknown}; it takes {sorted(props)}")
    for key, value in arguments.items():
        want = props.get(key, {}).get("type")
        if want is None:
            continue
        types = _JSON_TYPES.get(want, (object,))
        bad_bool = isinstance(value, bool) and want in ("integer", "number")
        if not isinstance(value, types) or bad_bool:
            raise ToolError(f"argument {key!r} of tool {tool!r} must be a JSON {want}, got {type(value).__name__}")
