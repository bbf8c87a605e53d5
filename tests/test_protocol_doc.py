"""The reference docs against the code: docs/protocol.md's tables of client messages,
server frames, error codes and close codes match what service/ reads, sends, raises
and closes with; both SDKs handle every documented frame and map every documented error
code to the documented exception; docs/http.md's endpoints and HTTP-only error codes
are the app's; docs/deployment.md lists the metrics the server exports; no doc links
outside the repository.

A table is found by the heading above it; its first column holds one name (or several)
in backticks. Nothing here starts a server or loads a model."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams
from service.protocol import (AUTH_PREFIX, ERROR_CODES, RETRYABLE, SUBPROTOCOL_JSON,
                              SUBPROTOCOL_MSGPACK)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SERVICE = ROOT / "service"
PY_SDK = ROOT / "clients" / "python" / "tidewire_client"
JS_SDK = ROOT / "clients" / "js" / "src" / "index.js"
TICKED = re.compile(r"`([^`]+)`")


# -- reading the docs ----------------------------------------------------------------------

def doc(name: str) -> str:
    return (DOCS / name).read_text()


def table(text: str, heading: str) -> list[list[str]]:
    """The body rows (cells, stripped) of the first table under the line `heading`."""
    lines = text.splitlines()
    assert heading in lines, f"no heading {heading!r}"
    rows: list[list[str]] = []
    for line in lines[lines.index(heading) + 1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
        elif rows:
            break
        elif line.startswith("#"):
            break
    assert len(rows) > 2, f"no table under {heading!r}"
    return rows[2:]  # header and separator off


def names(cell: str) -> list[str]:
    found = TICKED.findall(cell)
    assert found, f"no name in backticks in {cell!r}"
    return found


def keyed(text: str, heading: str) -> dict[str, list[str]]:
    """First-column name -> its row; one row may name several."""
    out = {}
    for row in table(text, heading):
        for name in names(row[0]):
            assert name not in out, f"{name} twice under {heading!r}"
            out[name] = row
    return out


# -- reading the code ----------------------------------------------------------------------

def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def service_trees() -> dict[Path, ast.Module]:
    return {p: tree(p) for p in sorted(SERVICE.glob("*.py"))}


def function(module: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    node: ast.AST = module
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.name == part)
    return node  # type: ignore[return-value]


def strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def dict_keys(node: ast.Dict) -> set[str | None]:
    """Constant keys; None stands for a `**spread`."""
    return {k.value if isinstance(k, ast.Constant) else None for k in node.keys}


def returned_dict_keys(fn: ast.AST) -> set[str]:
    keys: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict):
            keys |= {k for k in dict_keys(n.value) if k is not None}
    return keys


def frames_built(module: ast.Module) -> dict[str, set[str | None]]:
    """Frame type -> the keys the code gives it: the dict literal with a constant
    "type", plus `var["key"] = ...` in the same function when the dict is assigned to
    `var` (as ProtocolError.frame and Session._delta do)."""
    out: dict[str, set[str | None]] = {}
    for fn in ast.walk(module):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for d in ast.walk(fn):
            if not isinstance(d, ast.Dict):
                continue
            kinds = [v.value for k, v in zip(d.keys, d.values)
                     if isinstance(k, ast.Constant) and k.value == "type"
                     and isinstance(v, ast.Constant)]
            if not kinds or kinds[0].startswith("websocket."):  # ASGI messages
                continue
            keys = dict_keys(d)
            var = next((a.target.id if isinstance(a, ast.AnnAssign) else a.targets[0].id
                        for a in ast.walk(fn) if isinstance(a, (ast.Assign, ast.AnnAssign))
                        and a.value is d and isinstance(
                            a.target if isinstance(a, ast.AnnAssign) else a.targets[0],
                            ast.Name)), None)
            if var is not None:
                for a in ast.walk(fn):
                    if isinstance(a, ast.Assign):
                        for t in a.targets:
                            if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                                    and t.value.id == var and isinstance(t.slice, ast.Constant)):
                                keys.add(t.slice.value)
            out.setdefault(kinds[0], set()).update(keys)
    return out


def protocol_error_codes() -> set[str]:
    """Every code a `ProtocolError(...)` is raised or built with in service/."""
    codes = set()
    for module in service_trees().values():
        for n in ast.walk(module):
            if (isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None))
                    == "ProtocolError" and n.args and isinstance(n.args[0], ast.Constant)):
                codes.add(n.args[0].value)
    return codes


def close_codes_used() -> dict[int, set[str]]:
    """Close codes the server sends, with their reasons: `close(code=N, reason=...)`
    calls and websockets' `CloseCode.NAME` (the message size cap)."""
    from websockets.frames import CloseCode

    used: dict[int, set[str]] = {}
    for module in service_trees().values():
        for n in ast.walk(module):
            if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "close":
                kw = {k.arg: k.value for k in n.keywords}
                if isinstance(kw.get("code"), ast.Constant):
                    reason = kw.get("reason")
                    used.setdefault(kw["code"].value, set()).update(
                        [reason.value] if isinstance(reason, ast.Constant) else [])
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id == "CloseCode"):
                used.setdefault(int(CloseCode[n.attr]), set())
    return used


def handled_kinds() -> dict[str, list[ast.stmt]]:
    """Session._handle's branches: message type -> its body."""
    fn = function(tree(SERVICE / "session.py"), "Session._handle")
    node = next(n for n in fn.body if isinstance(n, ast.If))
    branches = {}
    while isinstance(node, ast.If):
        test = node.test
        assert isinstance(test, ast.Compare) and getattr(test.left, "id", None) == "kind"
        branches[test.comparators[0].value] = node.body  # type: ignore[attr-defined]
        node = node.orelse[0] if node.orelse else None
    return branches


def accepted_fields(parser: str) -> set[str]:
    """The `set(msg) - {...}` literal of a protocol.py parser: the fields it accepts."""
    fn = function(tree(SERVICE / "protocol.py"), parser)
    sets = [n.right for n in ast.walk(fn) if isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Sub) and isinstance(n.right, ast.Set)]
    assert len(sets) == 1, parser
    return {e.value for e in sets[0].elts} - {"type"}  # type: ignore[attr-defined]


def js_block(source: str, head: str) -> str:
    """The text of the JS block that starts at `head` (a method's signature)."""
    start = source.index(head)
    depth, i = 0, source.index("{", start)
    for j in range(i, len(source)):
        depth += {"{": 1, "}": -1}.get(source[j], 0)
        if depth == 0:
            return source[start:j + 1]
    raise AssertionError(f"unbalanced block at {head!r}")


def js_error_map() -> dict[str, str]:
    body = re.search(r"const BY_CODE = \{(.*?)\};", JS_SDK.read_text(), re.S)
    assert body, "BY_CODE not found in the JS SDK"
    return dict(re.findall(r"(\w+): (\w+)", body.group(1)))


PROTOCOL = "protocol.md"
ERRORS = "## Error codes"
CLIENT = "## Client messages"
SERVER = "## Server frames"
CLOSES = "## Close codes"


# -- protocol.md: the server side ----------------------------------------------------------

def test_documented_error_codes_are_exactly_the_servers() -> None:
    documented = keyed(doc(PROTOCOL), ERRORS)
    raised = protocol_error_codes()
    assert raised <= ERROR_CODES  # ProtocolError asserts it too
    assert set(documented) == ERROR_CODES | raised
    for code, row in documented.items():
        assert row[1] == ("yes" if code in RETRYABLE else "no"), (code, row[1])


def test_documented_http_statuses_are_the_ones_the_api_answers_with() -> None:
    from service.openai_api import HTTP_STATUS

    for code, row in keyed(doc(PROTOCOL), ERRORS).items():
        if row[2] == "—":
            assert code not in HTTP_STATUS, f"{code} has an HTTP status: {HTTP_STATUS[code]}"
        else:
            assert int(row[2]) == HTTP_STATUS[code], code


def test_documented_client_messages_are_the_ones_the_server_reads() -> None:
    documented = keyed(doc(PROTOCOL), CLIENT)
    branches = handled_kinds()
    assert set(documented) == set(branches)
    parsers = {"generate": "parse_generate", "warm": "parse_warm", "resume": "parse_resume"}
    for kind, row in documented.items():
        if kind in parsers:
            read = accepted_fields(parsers[kind])
        else:  # read in the branch itself: request_id(msg) is `id`, msg.get("t") is `t`
            body = ast.Module(body=branches[kind], type_ignores=[])
            calls = [n for n in ast.walk(body) if isinstance(n, ast.Call)]
            read = {"id" for c in calls if getattr(c.func, "id", None) == "request_id"}
            read |= {c.args[0].value for c in calls if getattr(c.func, "attr", None) == "get"
                     and c.args and isinstance(c.args[0], ast.Constant)}
        assert set(TICKED.findall(row[1])) == read, kind


# Modules whose dicts with a "type" are OpenAI's and JSON Schema's objects, not frames.
NOT_FRAMES = {"tools.py", "tool_formats.py", "openapi.py", "responses_api.py",
              "anthropic_api.py", "chat_turn.py"}


def test_documented_server_frames_are_the_ones_the_server_sends() -> None:
    built: dict[str, set[str | None]] = {}
    for path, module in service_trees().items():
        if path.name in NOT_FRAMES:
            continue
        for kind, keys in frames_built(module).items():
            built.setdefault(kind, set()).update(keys)
    documented = keyed(doc(PROTOCOL), SERVER)
    assert set(documented) == set(built)
    # what a `**spread` adds: `warmed` spreads Gateway.warm's answer
    spread = returned_dict_keys(function(tree(SERVICE / "gateway.py"), "Gateway.warm"))
    for kind, row in documented.items():
        fields_doc = set(TICKED.findall(row[1]))
        code = {k for k in built[kind] if k not in (None, "type")}
        assert code <= fields_doc, (kind, code - fields_doc)
        allowed = code | (spread if None in built[kind] else set())
        assert fields_doc <= allowed, (kind, fields_doc - allowed)


def test_ready_limits_and_done_timings_are_documented_field_by_field() -> None:
    text = doc(PROTOCOL)
    ws = tree(SERVICE / "session.py")
    ready = keyed(text, "### `ready`")
    assert {n.split(".", 1)[1] for n in ready if n.startswith("limits.")} == \
        returned_dict_keys(function(ws, "Session._limits"))
    top = {n.split(".")[0] for n in ready}
    assert top == set(TICKED.findall(keyed(text, SERVER)["ready"][1]))
    timings = keyed(text, "### `start`, `delta`, `done`")
    delivery = tree(SERVICE / "delivery.py")
    assert {n.split(".", 1)[1] for n in timings} == \
        returned_dict_keys(function(delivery, "Timings.summary")) | \
        returned_dict_keys(function(delivery, "spec_timings"))
    # the features a ready frame can list (the row may also name a field it depends on)
    features = strings(function(ws, "Session._features"))
    listed = set(TICKED.findall(ready["features"][1]))
    assert features <= listed and listed - features <= {n.split(".")[-1] for n in ready}


def test_documented_sampling_parameters_are_the_engines() -> None:
    documented = keyed(doc(PROTOCOL), "Sampling parameters (`params`):")
    assert set(documented) == {f.name for f in fields(SamplingParams)}
    for name, row in documented.items():
        default = getattr(SamplingParams(), name)
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            assert float(re.match(r"[-\d.]+", row[2]).group()) == default, name


def test_documented_close_codes_are_the_ones_the_server_uses() -> None:
    documented = keyed(doc(PROTOCOL), CLOSES)
    used = close_codes_used()
    assert {int(c) for c in documented} == set(used)
    for code, row in documented.items():
        assert set(TICKED.findall(row[1])) == used[int(code)], code


def test_subprotocols_and_the_message_cap_are_the_servers() -> None:
    from service.server import HARD_CAP_FACTOR

    text = doc(PROTOCOL)
    assert set(keyed(text, "## Connecting")) == {SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK,
                                                 AUTH_PREFIX + "<key>"}
    assert f"{HARD_CAP_FACTOR} × `max_message_bytes`" in text


def test_example_frames_use_documented_types_and_fields() -> None:
    text = doc(PROTOCOL)
    client, server = keyed(text, CLIENT), keyed(text, SERVER)
    parsed = 0
    for line in text.splitlines():
        m = re.match(r"([→←]) (\{.*\})$", line)
        if not m:
            continue
        try:
            frame = json.loads(m.group(2))
        except json.JSONDecodeError:
            continue  # an abridged example ("..."), or the bad JSON example itself
        table_ = client if m.group(1) == "→" else server
        assert frame["type"] in table_, line
        extra = set(frame) - {"type"} - set(TICKED.findall(table_[frame["type"]][1]))
        assert not extra, (line, extra)
        parsed += 1
    assert parsed >= 15


# -- protocol.md against the SDKs ----------------------------------------------------------

def test_both_sdks_handle_every_documented_server_frame() -> None:
    documented = set(keyed(doc(PROTOCOL), SERVER))
    py = tree(PY_SDK / "_async.py")
    py_seen = strings(function(py, "AsyncClient._route")) | strings(
        function(py, "AsyncClient._open"))
    js = JS_SDK.read_text()
    js_seen = set(re.findall(r'"(\w+)"', js_block(js, "_route(frame) {")
                             + js_block(js, "async _open() {")))
    assert documented - py_seen == set(), "frames the Python SDK never looks at"
    assert documented - js_seen == set(), "frames the JS SDK never looks at"


def test_both_sdks_send_only_documented_client_messages() -> None:
    documented = set(keyed(doc(PROTOCOL), CLIENT))
    py = set(re.findall(r'"type": "(\w+)"', (PY_SDK / "_async.py").read_text()))
    js = set(re.findall(r'type: "(\w+)"', JS_SDK.read_text()))
    assert py == documented and js == documented


def test_documented_exceptions_are_what_both_sdks_raise() -> None:
    import tidewire_client
    from tidewire_client._errors import _BY_CODE

    documented = {code: row[3].strip("`") for code, row in keyed(doc(PROTOCOL), ERRORS).items()
                  if row[3] != "—"}
    js_map = js_error_map()
    js_source = JS_SDK.read_text()
    for code, cls in documented.items():
        assert _BY_CODE.get(code) is getattr(tidewire_client, cls), f"Python: {code}"
        assert js_map.get(code) == cls, f"JS: {code}"
        assert f"export class {cls} " in js_source
    assert set(_BY_CODE) <= set(documented) and set(js_map) <= set(documented)


def test_the_js_sdk_maps_error_frames_as_documented_when_run() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (the source check above still ran)")
    documented = {code: row[3].strip("`") for code, row in keyed(doc(PROTOCOL), ERRORS).items()
                  if row[3] != "—"}
    script = ("import { errorFromFrame } from './src/index.js';"
              f"const codes = {json.dumps(sorted(documented))};"
              "console.log(JSON.stringify(Object.fromEntries(codes.map("
              "(c) => [c, errorFromFrame({ code: c }).constructor.name]))));")
    out = subprocess.run([node, "--input-type=module", "-e", script], cwd=JS_SDK.parents[1],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == documented


# -- http.md -------------------------------------------------------------------------------

def test_documented_endpoints_are_the_apps_routes() -> None:
    from starlette.routing import Mount, Route, WebSocketRoute

    from service.app import create_app
    from service.config import ServiceConfig

    app = create_app(ServiceConfig()).app  # RawSend -> Starlette
    routes = {"GET /"}  # the chat page: the router's default, not a route
    for r in app.router.routes:
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path)
        if isinstance(r, WebSocketRoute):
            routes.add(f"WS {path}")
        elif isinstance(r, Mount):
            routes.add(f"GET {path}/{{path}}")
        elif isinstance(r, Route):
            routes |= {f"{m} {path}" for m in r.methods - {"HEAD"}}
    assert set(keyed(doc("http.md"), "## Endpoints")) == routes


def test_documented_http_only_error_codes_are_the_apps() -> None:
    """Codes given to openai_api.error_json as literals (the protocol's codes reach it
    through ProtocolError), with their status where it is a literal too."""
    found: dict[str, int | None] = {}
    for module in service_trees().values():
        for n in ast.walk(module):
            if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(
                    n.func, "id", None)) == "error_json" and len(n.args) >= 2:
                status = n.args[0].value if isinstance(n.args[0], ast.Constant) else None
                code = n.args[1]
                if isinstance(code, ast.JoinedStr):  # f"http_{status}"
                    found["".join(v.value if isinstance(v, ast.Constant) else
                                  "{" + ast.unparse(v.value) + "}" for v in code.values)] = status
                else:
                    for s in strings(code):
                        found[s] = status
    documented = keyed(doc("http.md"), "## Errors")
    assert set(documented) == set(found)
    for code, status in found.items():
        if status is not None:
            assert documented[code][1] == str(status), code


# -- deployment.md -------------------------------------------------------------------------

def test_documented_metrics_are_the_ones_exported() -> None:
    from service.metrics import Metrics

    exported = {}
    for family in Metrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        exported[name] = family.type
    documented = keyed(doc("deployment.md"), "## Metrics")
    assert set(documented) == set(exported)
    for name, row in documented.items():
        assert row[1] == exported[name], name


# -- the README's Layout ----------------------------------------------------------------

MODULE_NAME = re.compile(r"[a-z_][a-z0-9_]*/?")


def package_modules(pkg: Path) -> set[str]:
    """Every module and subpackage under `pkg`, by its last name (`runner`, `attention/`)."""
    out = {p.stem for p in pkg.rglob("*.py") if p.name != "__init__.py"}
    out |= {f"{p.parent.name}/" for p in pkg.rglob("__init__.py") if p.parent != pkg}
    return out


def test_readme_layout_names_every_module_and_only_modules_that_exist() -> None:
    """A row of the Layout table whose path is a Python package names, in backticks,
    each of its modules (and subpackages, with a slash); a lowercase backticked word in
    such a row is a module that exists. Every other path in the first column exists."""
    rows = table((ROOT / "README.md").read_text(), "## Layout")
    packages = 0
    for row in rows:
        for path in names(row[0]):
            assert (ROOT / path.rstrip("/")).exists(), f"README Layout: no {path}"
            pkg = ROOT / path.rstrip("/")
            if not (path.endswith("/") and (pkg / "__init__.py").exists()):
                continue
            packages += 1
            have = package_modules(pkg)
            said = {n for n in TICKED.findall(row[1]) if MODULE_NAME.fullmatch(n)}
            assert said <= have, f"README Layout {path} names no such module: {said - have}"
            assert have <= said, f"README Layout {path} leaves out: {sorted(have - said)}"
    assert packages >= 4


# -- links ---------------------------------------------------------------------------------

DOC_FILES = ["README.md", "clients/python/README.md",
             *(f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")))]


@pytest.mark.parametrize("path", DOC_FILES)
def test_links_stay_inside_the_repository(path: str) -> None:
    text = (ROOT / path).read_text()
    assert "../shared" not in text
    for mentioned in re.findall(r"\bdocs/[\w.-]+\.md\b", text):  # named in the text
        assert (ROOT / mentioned).exists(), f"{path} names {mentioned}"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith("#"):
            continue
        assert not re.match(r"\w+://", target), f"{path} links outside: {target}"
        resolved = ((ROOT / path).parent / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{path}: {target}"
