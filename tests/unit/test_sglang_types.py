"""Every request body SGLangEngine sends, checked against SGLang's own request types, and our
parser against the response shapes SGLang's source builds, for the version pinned here.

SGLang cannot run on this machine (its CPU kernels are not on PyPI), and importing its request
module pulls most of its runtime; so ``scripts/test.sh`` installs the package alone (``pip install
--no-deps --target .cache/sglang-types sglang==SGLANG_VERSION``) and this test reads its source:
the fields of ``GenerateReqInput``, ``SamplingParams``, ``UpdateWeightFromDiskReqInput``,
``LoadLoRAAdapterReqInput``, ``PauseGenerationReqInput``, ``ContinueGenerationReqInput`` and
``AbortReq`` (with their base classes), the routes of its HTTP server, and the command-line flags
of its ``ServerArgs`` (for ``launch_args``, the server the GPU check starts). A field or flag we
send that SGLang no longer has (or deprecates) fails here, naming it.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import typing
from pathlib import Path

import pytest

from miles_core.config import SGLangEngineConfig
from miles_core.engines.base import GenerateRequest, SamplingParams
from miles_core.engines.sglang import SGLANG_VERSION, SGLangEngine, parse_result

SOURCE = Path(__file__).resolve().parents[2] / ".cache" / "sglang-types" / "sglang"
SRT = SOURCE / "srt"

if not SRT.is_dir():
    if os.environ.get("CI"):
        pytest.fail(f"SGLang's source is missing ({SOURCE}): scripts/test.sh installs it", pytrace=False)
    pytest.skip(f"SGLang's source is not installed ({SOURCE}): run scripts/test.sh", allow_module_level=True)


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


IO = _classes(SRT / "managers" / "io_struct.py")


def fields(name: str, classes: dict[str, ast.ClassDef] = IO) -> dict[str, ast.AnnAssign]:
    """A class's annotated fields, its bases' (in the same module) included."""
    cls = classes[name]
    out: dict[str, ast.AnnAssign] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(fields(base.id, classes))
    out.update({n.target.id: n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)})
    return out


class Recorder:
    """A transport that answers like SGLang and keeps every (path, body) sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    async def request(self, method, url, body, timeout):
        path = url.split(":30000", 1)[1]
        if body is not None:
            self.sent.append((path, body))
        if path == "/generate" and body.get("logprob_start_len") == 0:  # one prompt's logprobs
            triples = [[None if k == 0 else -0.25, t, None] for k, t in enumerate(body["input_ids"])]
            return 200, json.dumps({"text": "x", "meta_info": {"input_token_logprobs": triples,
                                    "output_token_logprobs": [[-0.5, 7, None]],
                                    "finish_reason": {"type": "length", "length": 1}, "weight_version": "0"}}).encode()
        if path == "/generate":
            n = len(body["input_ids"])
            return 200, json.dumps([{"text": "x", "meta_info": {"output_token_logprobs": [[-0.5, 7, None]],
                                    "finish_reason": {"type": "length", "length": 1}, "weight_version": "0"}}] * n).encode()
        return 200, b'{"success": true}'

    async def close(self):
        pass


@pytest.fixture(scope="module")
def sent() -> list[tuple[str, dict]]:
    """Every kind of call the client makes, as it sends it."""
    recorder = Recorder()
    eng = SGLangEngine("http://sglang.test:30000", SGLangEngineConfig(url="http://sglang.test:30000", coalesce_window_s=0),
                       transport=recorder)

    async def calls():
        full = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5, stop=("\n",),
                              stop_token_ids=(2,), seed=3)
        await eng.generate([GenerateRequest([1, 2], full, rid="a", adapter="math"), GenerateRequest([3], rid="b")])
        await eng.update_weights("/w/v1", 1)
        await eng.load_adapter("math", "/w/math-v1", 1)
        assert await eng.prompt_logprobs([1, 2, 3], "math") == pytest.approx([float("nan"), -0.25, -0.25], nan_ok=True)
        assert await eng.unload_adapter("math") is True
        await eng.pause()
        await eng.resume()
        await eng.abort()
        await eng.close()

    asyncio.run(calls())
    return recorder.sent


def test_the_pinned_sglang_is_the_one_installed():
    (dist,) = SOURCE.parent.glob("sglang-*.dist-info")
    assert dist.name == f"sglang-{SGLANG_VERSION}.dist-info", (
        f"{dist.name} installed, SGLANG_VERSION = {SGLANG_VERSION}: change both together (scripts/test.sh)")


ROUTES = {
    "/generate": "GenerateReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
}


def test_every_body_we_send_has_only_fields_of_sglangs_request_type(sent):
    assert {path for path, _ in sent} == set(ROUTES)
    for path, body in sent:
        known = fields(ROUTES[path])
        unknown = sorted(set(body) - set(known))
        assert not unknown, f"{path}: SGLang {SGLANG_VERSION}'s {ROUTES[path]} has no field {unknown}"
    required = {"UpdateWeightFromDiskReqInput": {"model_path"}, "LoadLoRAAdapterReqInput": {"lora_name", "lora_path"},
                "UnloadLoRAAdapterReqInput": {"lora_name"}}
    for path, body in sent:
        missing = {f for f in required.get(ROUTES[path], ()) if f not in body}
        assert not missing, f"{path}: we leave out {missing}, which SGLang requires"


def test_every_sampling_param_we_send_is_one_of_sglangs(sent):
    sampling = fields("SamplingParams", _classes(SRT / "sampling" / "sampling_params.py"))
    generate, prompt_logprobs = [body for path, body in sent if path == "/generate"]
    assert generate["logprob_start_len"] == -1 and prompt_logprobs["logprob_start_len"] == 0
    sent_keys = {k for params in generate["sampling_params"] for k in params}
    assert {"sampling_seed", "no_stop_trim", "stop_token_ids", "max_new_tokens"} <= sent_keys
    assert not sent_keys - set(sampling), f"SGLang {SGLANG_VERSION}'s SamplingParams has no {sent_keys - set(sampling)}"


def test_our_pause_mode_is_one_sglang_takes(sent):
    mode = fields("PauseGenerationReqInput")["mode"].annotation
    allowed = {elt.value for elt in mode.slice.elts} if isinstance(mode.slice, ast.Tuple) else {mode.slice.value}
    (pause,) = [body for path, body in sent if path == "/pause_generation"]
    assert pause["mode"] in allowed, (pause["mode"], allowed)


def test_the_routes_we_call_exist():
    server = (SRT / "entrypoints" / "http_server.py").read_text()
    for path in [*ROUTES, "/health"]:
        assert f'"{path}"' in server, f"SGLang {SGLANG_VERSION}'s HTTP server has no route {path}"


def test_our_parser_reads_the_response_shapes_sglang_builds():
    """``meta_info`` as SGLang's tokenizer manager fills it: ``output_token_logprobs`` triples
    ``(logprob, token_id, text or None)``, ``finish_reason`` one of its finish classes' ``to_json``,
    ``weight_version`` a string."""
    manager = (SRT / "managers" / "tokenizer_manager.py").read_text()
    assert "(logprob, token_id, None)" in manager and '"weight_version"' in manager
    assert 'meta_info["output_token_logprobs"]' in manager and 'meta_info["input_token_logprobs"]' in manager
    batch = (SRT / "managers" / "schedule_batch.py").read_text()
    for kind in ("stop", "length", "abort"):
        assert f'"type": "{kind}"' in batch, kind
    shapes = [({"type": "stop", "matched": 2}, "stop"), ({"type": "length", "length": 3}, "length"),
              ({"type": "abort", "message": "x", "status_code": 400, "err_type": None}, "abort")]
    for finish, expected in shapes:
        item = {"text": "ab", "meta_info": {"output_token_logprobs": [(-0.1, 5, None), (-0.2, 6, None)],
                                            "finish_reason": finish, "weight_version": "7"}}
        r = parse_result(json.loads(json.dumps(item)), "q", "/generate")
        assert (r.output_ids, r.logprobs, r.finish_reason, r.weight_version) == ([5, 6], [-0.1, -0.2], expected, 7)


def test_the_checked_types_are_what_the_engine_module_documents():
    import miles_core.engines.sglang as module

    assert f"SGLang {SGLANG_VERSION}" in typing.cast(str, module.__doc__)


# ------------------------------------------------------------------------------ launch flags


def _constants(tree: ast.Module, env: dict[str, set | None]) -> None:
    """Add the module's constants, and its classes' (as ``Class.NAME``), to ``env``, evaluated."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef):  # its body sees its own names first
            inner = dict(env)
            _constants(ast.Module(body=node.body, type_ignores=[]), inner)
            own = {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
            env.update({f"{node.name}.{k}": inner[k] for k in own})
        elif isinstance(node, ast.Assign):
            env.update({t.id: _values(node.value, env) for t in node.targets if isinstance(t, ast.Name)})


def _values(node: ast.expr | None, env: dict[str, set | None]) -> set | None:
    """The literal values of a ``choices`` expression (lists, ``+``, constants of ``env``), or None
    where it is computed in a way this reader does not follow (then values are not checked)."""
    if isinstance(node, ast.Constant):
        return {node.value}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        parts = [_values(e, env) for e in node.elts]
        return None if None in parts else set().union(*parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _values(node.left, env), _values(node.right, env)
        return None if left is None or right is None else left | right
    if isinstance(node, (ast.Name, ast.Attribute)):
        return env.get(ast.unparse(node))
    return None


CONSTANTS: dict[str, set | None] = {}
for _module in ("utils/common.py", "arg_groups/choices.py", "model_executor/cuda_graph_config.py"):
    _constants(ast.parse((SRT / _module).read_text()), CONSTANTS)


def _unwrap(node: ast.expr, name: str) -> ast.expr:
    return node.slice if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
        and node.value.id == name else node


NO_VALUE = {"store_true", "store_false", "store_const", "count", "BooleanOptionalAction", "DeprecatedAction",
            "DeprecatedStoreTrueAction", "DeprecatedStoreConstAction"}
"""argparse actions (and SGLang's, ``arg_groups/argparse_actions.py``) whose flag takes no value."""


def _action(node: ast.expr | None) -> dict | None:
    """What an ``action=`` makes of a flag (None: no action): whether it takes a value, has a
    ``--no-`` form (``BooleanOptionalAction``), is deprecated (SGLang's ``Deprecated*`` actions)."""
    if node is None:
        return None
    name = node.value if isinstance(node, ast.Constant) else ast.unparse(node).rsplit(".", 1)[-1]
    return {"value": name not in NO_VALUE, "negatable": name == "BooleanOptionalAction",
            "deprecated": name.startswith("Deprecated")}


def sglang_flags() -> dict[str, dict]:
    """SGLang's command-line flags, read from its source: each ``A[type, help or Arg(...)]`` field of
    ``srt/arg_groups/fields/*.py`` (as ``add_cli_args_from_dataclass`` registers them: ``--`` and the
    name with dashes, or ``cli_name``, plus ``aliases``; ``no_cli`` ones left out; a ``bool`` one, or
    one whose ``action`` takes none, takes no value; choices from ``choices=`` or a ``Literal``), and
    those ``server_args.py`` adds by hand (deprecated spellings among them). Flag -> {"value": takes
    one, "choices": set or None, "deprecated": bool}."""
    flags: dict[str, dict] = {}
    for path in sorted((SRT / "arg_groups" / "fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(node.annotation, ast.Subscript) and isinstance(node.annotation.value, ast.Name)
                    and node.annotation.value.id == "A" and isinstance(node.annotation.slice, ast.Tuple)):
                continue
            kind, meta = node.annotation.slice.elts[:2]
            args = {k.arg: k.value for k in meta.keywords} if isinstance(meta, ast.Call) else {}
            if isinstance(args.get("no_cli"), ast.Constant) and args["no_cli"].value:
                continue
            kind = _unwrap(kind, "Optional")
            literal = _unwrap(kind, "Literal")
            choices = _values(args.get("choices"), CONSTANTS) if "choices" in args else (
                _values(literal, CONSTANTS) if literal is not kind else None)
            name = args["cli_name"].value if "cli_name" in args else "--" + node.target.id.replace("_", "-")
            action = _action(args.get("action")) or {
                "value": not (isinstance(kind, ast.Name) and kind.id == "bool"), "negatable": False, "deprecated": False}
            _add(flags, [name, *(_values(args.get("aliases"), {}) or ())], action, choices)
    for node in ast.walk(ast.parse((SRT / "server_args.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                and all(isinstance(a, ast.Constant) for a in node.args):
            keywords = {k.arg: k.value for k in node.keywords}
            action = _action(keywords.get("action")) or {"value": True, "negatable": False, "deprecated": False}
            _add(flags, [a.value for a in node.args], action, _values(keywords.get("choices"), CONSTANTS))
    return flags


def _add(flags: dict[str, dict], names: list[str], action: dict, choices: set | None) -> None:
    spec = {"value": action["value"], "choices": choices, "deprecated": action["deprecated"]}
    for name in names:
        flags[name] = spec
        if action["negatable"]:
            flags["--no-" + name.removeprefix("--")] = spec


def test_the_launch_flags_we_document_are_sglangs():
    """Each flag of ``launch_args`` (the GPU check's SGLang server, and the guide's) is a current
    flag of the pinned SGLang, given a value exactly when it takes one, from its choices."""
    from miles_core.engines.sglang import launch_args

    flags = sglang_flags()
    assert len(flags) > 200 and flags["--model-path"]["value"] and not flags["--enable-lora"]["value"]
    assert flags["--disable-cuda-graph"]["deprecated"]  # the reader sees the hand-added deprecated ones
    given: list[tuple[str, list[str]]] = []
    for token in launch_args("/m", port=31000, seed=3):
        if token.startswith("--"):
            given.append((token, []))
        else:
            given[-1][1].append(token)
    for flag, values in given:
        spec = flags.get(flag)
        assert spec is not None, f"SGLang {SGLANG_VERSION} has no flag {flag}"
        assert not spec["deprecated"], f"SGLang {SGLANG_VERSION} deprecates {flag}"
        assert bool(values) == spec["value"], f"{flag} {values}: SGLang's {'takes' if spec['value'] else 'takes no'} value"
        if spec["choices"] is not None:
            assert set(values) <= spec["choices"], f"{flag} {values}: not among {sorted(map(str, spec['choices']))}"
    checked = {f for f, _ in given if flags[f]["choices"] is not None}
    assert {"--dtype", "--lora-target-modules", "--cuda-graph-backend-decode"} <= checked


def test_idle_connections_close_before_sglang_and_uvicorn_close_them():
    """SGLang (and the stand-in server, on uvicorn's default) closes a connection idle for its
    keep-alive; a client that keeps it longer may send on one being closed ("Server disconnected")."""
    import inspect

    import uvicorn

    from miles_core.engines.http import IDLE_CONNECTION_S

    environ = (SRT / "environ.py").read_text()
    (line,) = [ln for ln in environ.splitlines() if "SGLANG_TIMEOUT_KEEP_ALIVE =" in ln]
    sglang = float(line.split("EnvInt(", 1)[1].split(")", 1)[0])
    stand_in = float(inspect.signature(uvicorn.Config).parameters["timeout_keep_alive"].default)
    assert IDLE_CONNECTION_S < min(sglang, stand_in) - 1, (IDLE_CONNECTION_S, sglang, stand_in)
