"""probe serve's API through FastAPI's TestClient on a tiny Llama with a word-level tokenizer: every endpoint and
its payload, the token, the guards, one-line errors, fuzzing (never a 5xx), the worker's queue and limits, and the
model restored bit for bit after every request."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient
from bench.serve import fingerprint
from conftest import run_cli
from hypothesis import given, strategies as st
from words import tiny_with_words

from probe.heads.classify import score_heads
from probe.inputs import ProbeSet
from probe.models import LoadedModel
from probe.schemas import SCHEMAS
from probe.serve import create_app
from probe.serve.views import Views
from probe.serve.app import JobTimeout, Worker

TOKEN = "test-token"
TEXT = "the keys to the cabinet are here , the keys to the cabinet"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    model, tokenizer = tiny_with_words()
    return LoadedModel(model=model, tokenizer=tokenizer, name="tiny-words", vocab_size=model.config.vocab_size)


@pytest.fixture(scope="module")
def views(loaded: LoadedModel) -> Views:
    return Views(loaded, max_tokens=64)


@pytest.fixture(scope="module")
def client(views: Views) -> Any:
    app = create_app(views, TOKEN, time_limit=60)
    with TestClient(app, headers=AUTH) as test_client:
        yield test_client
    app.state.worker.close()


def one_line_error(response: Any, status: int | None = None) -> str:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert status is None or response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["detail"] and isinstance(body["detail"], str), body
    assert "\n" not in body["detail"] and "Traceback" not in body["detail"]
    return body["detail"]


BODIES = {
    "text": {"text": TEXT},
    "head": {"text": TEXT, "layer": 1, "head": 2},
    "qk": {"text": TEXT, "layer": 1, "head": 2, "query": 6, "key": 2},
    "dla": {"text": TEXT, "position": 5, "token": 7},
    "ablate": {"text": TEXT, "heads": [[0, 1], [1, 3]], "method": "zero", "position": 5},
    "generate": {"text": TEXT, "heads": [[1, 0]], "factor": 3.0, "max_new_tokens": 4},
}


# -- the token and the guards ----------------------------------------------------------------------------------

def test_every_request_needs_the_token(views: Views) -> None:
    app = create_app(views, TOKEN)
    bare = TestClient(app)
    for path in ["/", "/api/info", "/assets/serve.js", "/openapi.json"]:
        assert "token" in one_line_error(bare.get(path), 401)
        assert one_line_error(bare.get(path, headers={"Authorization": "Bearer wrong"}), 401)
    for name, body in BODIES.items():
        one_line_error(bare.post(f"/api/{name}", json=body), 401)
    first = bare.get(f"/?token={TOKEN}")  # Jupyter's way: the token once in the address, then a cookie
    assert first.status_code == 200 and "HttpOnly" in first.headers["set-cookie"]
    assert "samesite=strict" in first.headers["set-cookie"].lower()
    assert bare.get("/api/info").status_code == 200  # the cookie alone now
    app.state.worker.close()


def test_headers_page_and_assets(client: Any) -> None:
    page = client.get("/")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    assert "access-control-allow-origin" not in {key.lower() for key in page.headers}
    assert "<script>" not in page.text and page.text.count("<script src=") == 2  # no inline script
    for name in ("serve.js", "serve.css", "plotly-cartesian.min.js"):
        assert client.get(f"/assets/{name}").status_code == 200
    for name in ("probe.js", "..%2F..%2Fpyproject.toml", "serve.html"):
        one_line_error(client.get(f"/assets/{name}"), 404)
    assert client.get("/docs").status_code == 404  # its assets would come from a CDN: /openapi.json instead
    schema = client.get("/openapi.json").json()
    assert {f"/api/{name}" for name in BODIES} | {"/api/info"} <= set(schema["paths"])
    one_line_error(client.post("/api/text", json={"text": TEXT}, headers={"Origin": "http://evil.example"}), 403)


def test_bodies_and_texts_are_bounded(client: Any) -> None:
    assert "KiB" in one_line_error(client.post("/api/text", content=b"x" * 300_000,
                                               headers={"Content-Type": "application/json"}), 413)
    assert "at most 64" in one_line_error(client.post("/api/text", json={"text": "the " * 100}), 422)
    one_line_error(client.post("/api/text", json={"text": "x" * 100_001}), 422)


# -- the endpoints ---------------------------------------------------------------------------------------------

def test_info_and_text(client: Any, views: Views, loaded: LoadedModel) -> None:
    info = client.get("/api/info").json()
    assert info["n_layers"] == 2 and info["n_heads"] == 4 and "previous_token" in info["scores"]
    assert {"natural", "repeated"} <= set(info["presets"]) and "scale" in info["steering"]
    found = client.post("/api/text", json={"text": TEXT}).json()
    n = len(found["tokens"])
    assert found["tokens"][0] == "⟨<s>⟩" and len(found["ids"]) == n and len(found["loss"]) == n - 1
    assert len(found["next"]) == n and all(len(row) == 10 for row in found["next"])
    ids = torch.tensor([found["ids"]])
    with torch.no_grad():
        logp = loaded.model(ids).logits[0].float().log_softmax(-1)
    assert found["loss"][3] == pytest.approx(float(-logp[3, found["ids"][4]]), abs=1e-4)
    assert found["next"][3][0]["id"] == int(logp[3].argmax())
    own = score_heads(loaded, ProbeSet("natural", "the text", ids, 1), list(found["scores"]), path="blocked")
    for name, grid in found["scores"].items():  # the library's own scoring of a probe set of this one text
        assert torch.tensor(grid) == pytest.approx(own[name].float(), abs=1e-4, nan_ok=True), name


def test_head_clicks_on_a_seen_text_run_no_forward(client: Any, views: Views) -> None:
    client.post("/api/text", json={"text": TEXT})
    before = views.forwards
    head = client.post("/api/head", json=BODIES["head"]).json()
    other = client.post("/api/head", json={**BODIES["head"], "head": 0}).json()
    assert views.forwards == before and head["cached"] and other["cached"]
    weights = torch.tensor(head["weights"])
    assert weights.shape == (len(head["tokens"]),) * 2 and torch.allclose(weights.sum(1), torch.ones(1), atol=3e-3)
    assert torch.triu(weights, 1).abs().max() == 0 and len(head["top_keys"]) == 8
    assert weights.tolist() != torch.tensor(other["weights"]).tolist()


def test_long_texts_keep_each_querys_top_keys(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import probe.serve.views as module

    monkeypatch.setattr(module, "FULL_TOKENS", 8)
    views = Views(loaded)
    head = views.head(TEXT, (0, 1))
    n = len(head["tokens"])
    assert "weights" not in head and len(head["top_keys_per_query"]["keys"]) == n
    assert all(key <= query for query, keys in enumerate(head["top_keys_per_query"]["keys"]) for key in keys)


@pytest.mark.parametrize("kind", ["qk", "dla"])
def test_published_kinds_validate_their_schema(client: Any, kind: str) -> None:
    payload = client.post(f"/api/{kind}", json=BODIES[kind]).json()
    jsonschema.Draft202012Validator(SCHEMAS[kind].schema()).validate(payload)
    if kind == "qk":
        assert (payload["query"], payload["key"]) == (6, 2)
        score = payload["views"]["score"]
        assert score["sum"] == pytest.approx(score["model_score"], abs=1e-5)
    else:
        assert payload["points"] == 1 and len(payload["heads"]) == 8


def test_ablation_changes_the_numbers_and_restores_the_model(client: Any, loaded: LoadedModel) -> None:
    before = fingerprint(loaded.model)
    zero = client.post("/api/ablate", json=BODIES["ablate"]).json()
    assert zero["loss_before"] != zero["loss_after"]
    assert zero["delta"] == pytest.approx([a - b for a, b in zip(zero["loss_after"], zero["loss_before"])], abs=2e-4)
    assert zero["next_before"][0]["p"] != zero["next_before"][0]["p_after"]
    identity = client.post("/api/ablate", json={**BODIES["ablate"], "method": "scale", "factor": 1.0}).json()
    assert max(abs(value) for value in identity["delta"]) < 1e-4
    mean = client.post("/api/ablate", json={**BODIES["ablate"], "method": "mean"}).json()
    assert mean["loss_after"] != zero["loss_after"]
    one_line_error(client.post("/api/ablate", json={**BODIES["ablate"], "heads": [[0, 9]]}), 422)
    generated = client.post("/api/generate", json=BODIES["generate"]).json()
    assert generated["rows"][0]["setting"] == 3.0 and generated["baseline"]
    assert fingerprint(loaded.model) == before


@pytest.mark.parametrize(("name", "body", "words"), [
    ("head", {"text": TEXT, "layer": 2, "head": 0}, "layer 2"),
    ("head", {"text": TEXT, "layer": 0, "head": 4}, "head 0.4"),
    ("head", {"text": TEXT, "layer": "0", "head": 1}, "layer"),
    ("qk", {"text": TEXT, "layer": 0, "head": 0, "query": 2, "key": 5}, "key 5"),
    ("qk", {"text": TEXT, "layer": 0, "head": 0, "query": 99, "key": 0}, "query 99"),
    ("dla", {"text": TEXT, "position": 0, "token": 10**6}, "vocabulary"),
    ("ablate", {"text": TEXT, "heads": [], "method": "zero"}, "heads"),
    ("ablate", {"text": TEXT, "heads": [[0, 0]], "method": "resample"}, "method"),
    ("ablate", {"text": TEXT, "heads": [[0, 0]], "extra": 1}, "extra"),
    ("text", {"text": ""}, "text"),
    ("text", {}, "text"),
    ("generate", {"text": TEXT, "heads": [[0, 0]], "max_new_tokens": 1000}, "max_new_tokens"),
])
def test_bad_input_is_one_line(client: Any, name: str, body: dict[str, Any], words: str) -> None:
    assert words in one_line_error(client.post(f"/api/{name}", json=body))


# -- fuzzing ---------------------------------------------------------------------------------------------------

ODD_TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\x00", "<script>alert(1)</script>", "\ud800",
                                                             "🙂" * 30, "the " * 70, "\u202e\u200b", "é" * 10]))
VALUE = st.one_of(st.integers(-5, 10**7), st.floats(allow_nan=True), st.text(max_size=5), st.none(), st.booleans(),
                  st.lists(st.integers(-2, 6), max_size=3), st.just([[0, 1]]), st.just([[7, 7], [0, 0]]))
FIELDS = ["text", "layer", "head", "query", "key", "position", "token", "heads", "method", "factor",
          "max_new_tokens"]


@given(name=st.sampled_from(list(BODIES)), text=ODD_TEXT,
       changes=st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=3), drop=st.booleans())
def test_fuzzing_never_answers_5xx(client: Any, loaded: LoadedModel, name: str, text: str,
                                   changes: dict[str, Any], drop: bool) -> None:
    body = {**BODIES[name], "text": text, **changes}
    if drop:
        body.pop(next(iter(body)))
    if name == "generate" and isinstance(body.get("max_new_tokens"), int):
        body["max_new_tokens"] = min(body["max_new_tokens"], 3)
    response = client.post(f"/api/{name}", content=json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass"),
                           headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        one_line_error(response)


def test_fuzzed_requests_leave_the_model_as_it_was(client: Any, loaded: LoadedModel) -> None:
    before = fingerprint(loaded.model)
    for body in ({"text": TEXT, "heads": [[0, 1], [1, 9]]}, {"text": "\x00 🙂", "heads": [[0, 1]], "method": "mean"},
                 BODIES["ablate"]):
        client.post("/api/ablate", json=body)
    assert fingerprint(loaded.model) == before


# -- the worker ------------------------------------------------------------------------------------------------

def test_a_job_past_its_time_limit_stops_and_the_model_is_restored(views: Views, loaded: LoadedModel) -> None:
    before = fingerprint(loaded.model)
    worker = Worker()
    slow = worker.submit(lambda: (time.sleep(0.3), views.ablate(TEXT, [(0, 1)], "scale", 2.0, 0)), 0.1)
    with pytest.raises(JobTimeout):
        slow.result(timeout=30)
    assert fingerprint(loaded.model) == before
    assert worker.submit(lambda: views.ablate(TEXT, [(0, 1)], "zero", 0.0, 0), 30).result(30)["mean_delta"] != 0
    worker.close()


def test_a_cancelled_queued_job_never_starts() -> None:
    worker, gate, ran = Worker(), threading.Event(), []
    first = worker.submit(gate.wait, 30)
    second = worker.submit(lambda: ran.append("second"), 30)
    assert second.cancel()
    gate.set()
    third = worker.submit(lambda: ran.append("third"), 30)
    third.result(30)
    assert first.result(30) and ran == ["third"]
    worker.close()


def test_a_request_past_its_time_limit_is_answered_504(views: Views, loaded: LoadedModel) -> None:
    before = fingerprint(loaded.model)
    app = create_app(views, TOKEN, time_limit=1e-9)
    response = TestClient(app, headers=AUTH).post("/api/ablate", json={**BODIES["ablate"], "text": "the keys"})
    assert response.status_code == 504 and "time limit" in response.json()["detail"]
    assert fingerprint(loaded.model) == before
    app.state.worker.close()


# -- the command -----------------------------------------------------------------------------------------------

def test_another_host_than_loopback_needs_a_token(capsys, monkeypatch) -> None:
    monkeypatch.delenv("PROBE_SERVE_TOKEN", raising=False)
    code, _, err = run_cli(["serve", "--host", "0.0.0.0", "--model", "tests/words.py:tiny_with_words"], capsys,
                           monkeypatch)
    assert code == 2 and err.strip().count("\n") == 0 and "--token" in err


def test_a_client_that_goes_away_cancels_its_queued_request(loaded: LoadedModel) -> None:
    """A real server: while the worker is busy, a client sends an ablation and hangs up; it never runs."""
    import socket
    from urllib.parse import urlsplit

    from probe.serve import start

    server = start(loaded)
    app = server.handle.config.app
    views, worker = app.state.views, app.state.worker
    worker.submit(lambda: views.text(TEXT), 60).result(60)
    before, gate = views.forwards, threading.Event()
    worker.submit(gate.wait, 60)
    address = urlsplit(server.url)
    body = json.dumps(BODIES["ablate"]).encode()
    with socket.create_connection((address.hostname, address.port)) as client:
        client.sendall(f"POST /api/ablate HTTP/1.1\r\nHost: {address.netloc}\r\nAuthorization: Bearer "
                       f"{address.query.removeprefix('token=')}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.5)
    time.sleep(0.6)  # the server notices the hang-up (it polls every 0.2 s) and cancels the queued job
    gate.set()
    worker.submit(lambda: None, 60).result(60)  # everything queued before has run or been dropped
    assert views.forwards == before
    server.stop()


def test_show_serves_beside_the_kernel(loaded: LoadedModel, capsys) -> None:
    import urllib.request

    from probe.serve import show

    server = show(loaded, height=500)
    assert "IFrame" in capsys.readouterr().out  # outside a notebook, IPython prints the display's repr
    with urllib.request.urlopen(server.url.replace("/?", "/api/info?"), timeout=30) as answer:
        assert json.load(answer)["model"] == "tiny-words"
    server.stop()


@pytest.mark.slow
def test_show_in_a_real_notebook_displays_the_page_and_serves_it() -> None:
    """One call in a notebook cell, run by nbclient in an IPython kernel: an IFrame of the page is displayed, and the
    server it starts beside the kernel answers the page's API with its token."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    root, tests = Path(__file__).resolve().parent.parent, Path(__file__).resolve().parent
    cells = [f"import sys\nsys.path[:0] = [{str(root)!r}, {str(tests)!r}]\nimport json, urllib.request\n"
             "from words import tiny_with_words\nfrom probe.models import LoadedModel\nfrom probe.serve import show\n"
             "model, tokenizer = tiny_with_words()\n"
             "loaded = LoadedModel(model=model, tokenizer=tokenizer, name='tiny-words', vocab_size=len(tokenizer))\n"
             "server = show(loaded, height=500)",
             "with urllib.request.urlopen(server.url.replace('/?', '/api/info?'), timeout=30) as answer:\n"
             "    print(json.load(answer)['model'])\nserver.stop()"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(root)}}).execute()
    shown = [output for output in notebook.cells[0].outputs if output.output_type == "display_data"]
    assert len(shown) == 1 and "<iframe" in shown[0].data["text/html"] and "?token=" in shown[0].data["text/html"]
    printed = "".join(output.get("text", "") for output in notebook.cells[1].outputs if output.output_type == "stream")
    assert printed.strip() == "tiny-words"
