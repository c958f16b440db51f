"""Named rewards, and loading a user's reward function from `pkg.module:func`.

Built-in rewards ("math", "format", "math_with_format") register when `hybridrl.rewards` is imported; other
modules (e.g. `hybridrl.data.synthetic` registers "synthetic") register when they are imported, so the app
imports them before resolving. A name that is not registered is an error listing the registered ones.

A custom function given as `reward.fn=pkg.module:func` may be batched, `(items: list[RewardInput]) -> list`,
or per-sample, `(item: RewardInput) -> float | dict`. The form is decided, in this order, by:
  1. the marker set by `@per_sample` / `@batched` (from `hybridrl.rewards`): batched;
  2. the annotation of the first parameter: `list[...]`/`Sequence[...]`/... means batched,
     anything else (e.g. `RewardInput`) per-sample;
  3. otherwise per-sample — the simplest function a user writes, `def f(item): ...`.
`register_reward` applies the same rules, so a registered function may be written in either form.
"""

from __future__ import annotations

import collections.abc
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

from hybridrl.errors import ConfigError
from hybridrl.import_path import import_module
from hybridrl.rewards.base import BATCHED_ATTR, RewardFn, per_sample

_REGISTRY: dict[str, RewardFn] = {}
# Names of the original functions, so re-registering the same function (a module reload) is not an error.
_ORIGINS: dict[str, str] = {}

_SPEC_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# First-parameter annotations that mean "a batch of items" (origins, and the same as unresolved strings).
_BATCH_ORIGINS = (list, tuple, collections.abc.Sequence, collections.abc.Iterable, collections.abc.Collection)
_BATCH_ANN_RE = re.compile(r"^\s*(typing\.|collections\.abc\.)?(list|List|tuple|Tuple|Sequence|Iterable|Collection)\b")


def register_reward(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register a reward function (batched or per-sample, see the module doc) under `name`.

    Returns the function unchanged, so a per-sample reward stays callable on one item.
    """

    def deco(f: Callable) -> Callable:
        origin = f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
        if name in _REGISTRY and _ORIGINS[name] != origin:
            raise ValueError(f"reward name {name!r} is already registered by {_ORIGINS[name]}")
        _REGISTRY[name] = as_batched(f)
        _ORIGINS[name] = origin
        return f

    return deco


def registered_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(_REGISTRY)


def resolve_reward(spec: str) -> RewardFn:
    """Return the batched reward function for `spec`: a registered name, or `pkg.module:func`.

    Raises ConfigError naming `reward.name` (unknown name) or `reward.fn` (cannot import, no such
    attribute, not callable), with what to do.
    """
    spec = spec.strip()
    if ":" not in spec:
        if spec not in _REGISTRY:
            raise ConfigError(
                f"reward.name={spec!r} is not a registered reward; registered: {registered_rewards()}. "
                "Pick one of these, or set reward.fn=pkg.module:func to use your own function "
                "(a reward registered by another module is known only once that module is imported)"
            )
        return _REGISTRY[spec]
    return as_batched(_load_callable(spec))


def as_batched(f: Callable) -> RewardFn:
    """Return `f` in the batched form, deciding its form by the rules in the module doc."""
    if getattr(f, BATCHED_ATTR, False):
        return f
    if _first_param_is_batch(f):
        return f
    return per_sample(f)


def _first_param_is_batch(f: Callable) -> bool:
    """True when the first parameter is annotated as a list/sequence (strings from `__future__` too)."""
    try:
        sig = inspect.signature(f, eval_str=True)
    except Exception:  # unresolvable string annotations, builtins: fall back to the raw text
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):
            return False
    params = list(sig.parameters.values())
    if not params or params[0].annotation is inspect.Parameter.empty:
        return False
    ann = params[0].annotation
    if isinstance(ann, str):
        return _BATCH_ANN_RE.match(ann) is not None
    return (typing.get_origin(ann) or ann) in _BATCH_ORIGINS


def _load_callable(spec: str) -> Callable:
    """Import `pkg.module:attr.path` and return the callable it names."""
    if not _SPEC_RE.match(spec):
        raise ConfigError(
            f"reward.fn={spec!r} is not of the form 'pkg.module:func' (a dotted module path, one colon, "
            "a function name), e.g. reward.fn=my_rewards:exact_match"
        )
    module_name, attr_path = spec.split(":")
    module = import_module(module_name, spec, "reward.fn")
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ConfigError(
                f"reward.fn={spec!r}: module {module_name!r} has no attribute {attr_path!r}; "
                f"callables defined there: {names}"
            )
        obj = getattr(obj, part)
    if inspect.isclass(obj) or not callable(obj):
        what = "a class" if inspect.isclass(obj) else f"a {type(obj).__name__}, not callable"
        raise ConfigError(
            f"reward.fn={spec!r} names {what}; point it at a function (items -> scores, or item -> score) "
            "or at an instance with __call__"
        )
    return obj
