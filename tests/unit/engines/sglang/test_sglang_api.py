"""Every SGLang call the adapter makes, checked against the installed sglang package (skipped when absent).

The adapter is run through a full cycle on a recording stand-in; each recorded call is then bound to the real
`sglang.Engine` method's signature, and the constructor's keywords to ServerArgs' fields. Where `sglang.Engine`
cannot be imported (on CPU its import chain needs torchvision and CUDA packages) the method signatures are read
from the installed engine.py source instead, which is still the installed package's code.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
from pathlib import Path

import pytest
import torch

from hybridrl.data.images import ImageInputs, ImageSource
from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.engines.config import EngineConfig, SglangOptions
from hybridrl.engines.sglang.engine import ALL_TAGS, SglangEngine
from hybridrl.engines.sglang.requests import request_params
from tests.unit.engines.sglang._fake_sglang import FakeSglangEngine

NO_SGLANG = (
    "sglang is not importable here (CUDA-only install); scripts/setup_sglang_test_venv.sh makes a venv where it is"
)
pytest.importorskip(
    "sglang.srt", reason=NO_SGLANG
)  # not "sglang": tests/unit/engines/sglang itself imports as a namespace package


def sglang_source(rel: str) -> Path:
    return Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / rel


def _signature_from_ast(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature:
    """Names, kinds and which parameters have defaults; enough for `Signature.bind`."""
    a, P, params = fn.args, inspect.Parameter, []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults, strict=True)):
        kind = P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=P.empty if d is None else ast.unparse(d)))
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else ast.unparse(d)))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def engine_signatures(names: set[str]) -> tuple[dict[str, inspect.Signature], str]:
    try:
        from sglang.srt.entrypoints.engine import Engine
    except Exception:  # noqa: BLE001 -- CPU installs fail anywhere in its import chain
        tree = ast.parse(sglang_source("srt/entrypoints/engine.py").read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
        methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        missing = names - set(methods)
        assert not missing, f"sglang.Engine (source) has no {sorted(missing)}"
        return {n: _signature_from_ast(methods[n]) for n in names}, "source"
    return {n: inspect.signature(getattr(Engine, n)) for n in names}, "import"


class Recorder:
    """Records each call exactly as the adapter makes it, then lets the stand-in answer."""

    log: list[tuple[str, tuple, dict]] = []

    def __init__(self, *args, **kwargs) -> None:
        Recorder.log.append(("__init__", args, kwargs))
        self._fake = FakeSglangEngine(**kwargs)

    def __getattr__(self, name: str):
        target = getattr(self._fake, name)
        if not callable(target):  # the engine's event loop
            return target

        def call(*args, **kwargs):
            Recorder.log.append((name, args, kwargs))
            return target(*args, **kwargs)

        return call


@pytest.fixture(scope="module")
def adapter_calls(tmp_path_factory) -> list[tuple[str, tuple, dict]]:
    model = tmp_path_factory.mktemp("model")
    vl = {"eos_token_id": 2, "image_token_id": 9, "vision_config": {"spatial_merge_size": 2}}
    (model / "config.json").write_text(json.dumps(vl))
    Recorder.log = []
    opts = SglangOptions(enable_weights_cpu_backup=True, enable_deterministic_inference=True)
    eng = SglangEngine(str(model), EngineConfig(name="sglang", sglang=opts), device="cpu", engine_factory=Recorder)
    eng.generate([[1, 2]], SamplingParams(n=2, seed=1, top_k=5, top_p=0.9, temperature=0.5))
    picture = ImageInputs(torch.zeros(4, 12), torch.tensor([[1, 2, 2]]), [ImageSource("a.png", digest="0" * 40)])
    eng.generate([[1, 9], [1, 2]], SamplingParams(seed=1), [picture, None])  # image_data, and [] for the text one
    request = GenerationRequest([1, 9], 4, 3, images=picture)
    stream_ = eng.async_engine()
    stream_.event_loop.run_until_complete(stream_.generate(request, SamplingParams(seed=1)))
    eng.generate_requests([GenerationRequest([1, 2, 3], 4, 1)], SamplingParams(seed=1))
    stream = eng.async_engine()  # an agent turn through the request API, on the engine's loop
    stream.event_loop.run_until_complete(stream.generate(GenerationRequest([1, 2, 3], 4, 2), SamplingParams(seed=1)))
    # A partial rollout: requests by id through async_generate, the long one aborted once the short one's group is done.
    partial = [GenerationRequest([1, 2], 5, 0, max_new_tokens=1), GenerationRequest([1, 3], 6, 0, max_new_tokens=9)]
    eng.generate_partial(partial, SamplingParams(seed=1), groups=[0, 1], need=1)
    eng.sleep(1)
    eng.wake_up(["weights"])
    eng.load_weights([("model.norm.weight", torch.ones(3))])
    eng.finish_weight_update()
    eng.wake_up(["kv_cache"])
    eng.shutdown()
    return list(Recorder.log)


def test_engine_methods_accept_our_calls(adapter_calls):
    called = {name for name, _, _ in adapter_calls} - {"__init__"}
    assert called == {
        "generate",
        "async_generate",
        "release_memory_occupation",
        "resume_memory_occupation",
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
        "flush_cache",
        "shutdown",
    }
    sigs, how = engine_signatures(called)
    for name, args, kwargs in adapter_calls:
        if name != "__init__":
            try:
                sigs[name].bind(None, *args, **kwargs)  # None stands for self
            except TypeError as exc:
                pytest.fail(f"sglang.Engine.{name}{sigs[name]} (from {how}) rejects {args} {kwargs}: {exc}")
    assert list(sigs["update_weights_from_tensor"].parameters)[1:4] == ["named_tensors", "load_format", "flush_cache"]
    assert sum("image_data" in kw for name, _, kw in adapter_calls if name in ("generate", "async_generate")) == 2


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def test_processor_output_is_taken_as_it_is():
    """The `image_data` form the adapter sends (`hybridrl.engines.sglang.multimodal`), in the installed source: a
    ``{"format": "processor_output"}`` dict is preprocessed input; with input ids and only preprocessed data the
    ids are kept as they are (no decode and re-tokenize, which needs the tokenizer skip_tokenizer_init drops); one
    such dict per request; its pixel_values and image_grid_thw are image fields; a list of lists is kept per
    request."""
    from hybridrl.engines.sglang.multimodal import PROCESSOR_OUTPUT

    base = ast.parse(sglang_source("srt/multimodal/processors/base_processor.py").read_text())
    fmt = ast.unparse(_function(base, "_get_preprocessed_input_format"))
    assert f'"{PROCESSOR_OUTPUT}"' in fmt or f"'{PROCESSOR_OUTPUT}'" in fmt
    load = ast.unparse(_function(base, "load_mm_data"))
    assert "input_ids is not None and self._all_mm_data_is_preprocessed(" in load
    assert "exactly one item" in ast.unparse(_function(base, "_validate_one_modality"))
    init = _function(base, "__init__")
    [modality] = [
        n.value
        for n in ast.walk(init)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "self.ATTR_NAME_TO_MODALITY"
    ]
    keys = {k.value for k in modality.keys if isinstance(k, ast.Constant)}
    assert {"pixel_values", "image_grid_thw"} <= keys
    io = ast.parse(sglang_source("srt/managers/io_struct.py").read_text())
    norm = ast.unparse(_function(io, "_normalize_image_data"))
    assert "isinstance(self.image_data[0], list)" in norm


@pytest.mark.parametrize(
    ("module", "cls"),
    [("qwen2_vl", "Qwen2VLForConditionalGeneration"), ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration")],
)
def test_qwen2_vl_loader_takes_checkpoint_names(module, cls):
    """SGLang's Qwen2-VL models hold the decoder as `self.model`, the tower as `self.visual` and the head as
    `self.lm_head`, and their load_weights renames the tower's fused ``attn.qkv`` itself: the names the resharder
    sends (`hybridrl.models.vision.checkpoint_name`: ``model.*``, ``visual.*``, ``lm_head.*``, unfused) are theirs."""
    tree = ast.parse(sglang_source(f"srt/models/{module}.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    assigned = {
        ast.unparse(t) for n in ast.walk(_function(node, "__init__")) if isinstance(n, ast.Assign) for t in n.targets
    }
    assert {"self.model", "self.visual", "self.lm_head"} <= assigned
    load = ast.unparse(_function(node, "load_weights"))
    assert "'attn.qkv.', 'attn.qkv_proj.'" in load or '"attn.qkv.", "attn.qkv_proj."' in load


def test_constructor_keywords_are_server_args_fields(adapter_calls):
    import msgspec
    from sglang.srt.server_args import ServerArgs

    fields = {f.name for f in msgspec.structs.fields(ServerArgs)}
    [(_, args, kwargs)] = [c for c in adapter_calls if c[0] == "__init__"]
    assert not args
    unknown = set(kwargs) - fields
    assert not unknown, f"ServerArgs has no fields {sorted(unknown)}"


def test_control_calls_return_success_and_message():
    """Our `(success, message)` checks: begin/end/update return Tuple[bool, str], flush_cache an object with
    .success/.message (read from the installed tokenizer manager and io_struct source)."""
    tree = ast.parse(sglang_source("srt/managers/tokenizer_control_mixin.py").read_text())
    returns = {
        n.name: ast.unparse(n.returns) for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.returns
    }
    for name in ("begin_weight_update", "end_weight_update", "update_weights_from_tensor"):
        assert returns[name] == "Tuple[bool, str]", name
    assert returns["flush_cache"] == "FlushCacheReqOutput"
    io = ast.parse(sglang_source("srt/managers/io_struct.py").read_text())
    cls = next(n for n in io.body if isinstance(n, ast.ClassDef) and n.name == "FlushCacheReqOutput")
    assert {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)} >= {"success", "message"}


def test_sampling_dicts_are_valid_sglang_sampling_params():
    from sglang.srt.sampling.sampling_params import TOP_K_ALL
    from sglang.srt.sampling.sampling_params import SamplingParams as SglSP

    sampled = SglSP(**request_params(SamplingParams(temperature=0.7, top_p=0.9, seed=3), 0, 1, [2]))
    sampled.verify(vocab_size=1000)
    assert sampled.top_k == TOP_K_ALL and sampled.temperature == 0.7 and 0 <= sampled.sampling_seed < 2**63
    greedy = SglSP(**request_params(SamplingParams(temperature=0.0), 0, 0, [2]))
    greedy.verify(vocab_size=1000)
    # SGLang turns temperature 0 into top-k 1 at temperature 1: its greedy log-probs are log_softmax(logits).
    assert greedy.top_k == 1 and greedy.temperature == 1.0 and greedy.stop_token_ids == {2}


def test_wire_format_names_and_allow_list():
    from sglang.srt import constants
    from sglang.srt.utils.common import SafeUnpickler
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    from hybridrl.engines.sglang.payload import _FIELDS

    assert set(ALL_TAGS) == set(constants.GPU_MEMORY_ALL_TYPES)
    assert tuple(FlattenedTensorMetadata.__dataclass_fields__) == _FIELDS
    allowed = SafeUnpickler.ALLOWED_GLOBALS
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in allowed
    assert ("types", "SimpleNamespace") in allowed  # our metadata fallback


def test_abort_conventions_in_source():
    """What partial rollouts rely on (`hybridrl.engines.sglang.partial`), in the installed source: abort by request id
    through the tokenizer manager; a running request aborted without a status code finishes normally (its tokens and
    log-probs so far) instead of raising; a waiting one is answered with its log-probs (none)."""
    tree = ast.parse(sglang_source("srt/managers/tokenizer_manager.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TokenizerManager")
    methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    _signature_from_ast(methods["abort_request"]).bind(None, rid="hybridrl-partial-0-1")
    assert "status_code is None" in ast.unparse(methods["_handle_abort_finish_reason"])
    assert "self.add_logprob_to_meta_info(" in ast.unparse(methods["_handle_abort_req"])
    scheduler = sglang_source("srt/managers/scheduler.py").read_text()
    assert "req.to_finish = FINISH_ABORT()" in scheduler
    engine = ast.parse(sglang_source("srt/entrypoints/engine.py").read_text())
    init = next(
        m
        for c in engine.body
        if isinstance(c, ast.ClassDef) and c.name == "Engine"
        for m in c.body
        if isinstance(m, ast.FunctionDef) and m.name == "__init__"
    )
    assert "self.tokenizer_manager =" in ast.unparse(init)


def test_log_prob_and_seed_conventions_in_source():
    """The conventions our docstrings state, still in the installed source: temperature-scaled log-probs unless
    SGLANG_RETURN_ORIGINAL_LOGPROB, and per-request seeds only under deterministic inference."""
    sampler = sglang_source("srt/layers/sampler.py").read_text()
    assert "logprob_logits / sampling_info.temperatures" in sampler and "SGLANG_RETURN_ORIGINAL_LOGPROB" in sampler
    batch_info = sglang_source("srt/sampling/sampling_batch_info.py").read_text()
    assert "if enable_deterministic" in batch_info and "r.sampling_params.sampling_seed" in batch_info
