"""Bad input over HTTP: each a clear 4xx in the route's own envelope; the server unharmed."""

from __future__ import annotations

import httpx
import pytest

from tests.rest.conftest import BODY_LIMIT, MODEL, Shim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CHAT = "/v1/chat/completions"
RUN = f"/ai/run/{MODEL}"
JSON = {"content-type": "application/json"}


def post(shim: Shim, path: str, content: bytes | str | None = None, json: object = None,
         **headers: str) -> httpx.Response:
    return httpx.post(shim.url + path, content=content, json=json, timeout=60,
                      headers={**shim.headers(), **JSON, **headers})


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def workers_ai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.json()["success"] is False and r.json()["result"] is None
    return r.json()["errors"][0]


def test_malformed_json_is_400_in_both_envelopes(shim) -> None:
    assert "malformed JSON" in openai_error(post(shim, CHAT, b'{"messages": ['), 400)["message"]
    assert "malformed JSON" in workers_ai_error(post(shim, RUN, b"{prompt: 1}"), 400)["message"]


def test_wrong_type_is_400_naming_the_field(shim) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": "0.5"}
    assert openai_error(post(shim, CHAT, json=body), 400)["param"] == "temperature"
    err = workers_ai_error(post(shim, RUN, json={"prompt": 42}), 400)
    assert err["reason"] == "INVALID_ARGUMENT" and "prompt" in err["message"]


def test_unknown_field_is_400_as_documented(shim) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "temprature": 0.5}
    err = openai_error(post(shim, CHAT, json=body), 400)
    assert err["param"] == "temprature" and "Extra inputs" in err["message"]
    assert workers_ai_error(post(shim, RUN, json={"prompt": "Hi", "foo": 1}), 400)


def test_unknown_message_role_is_400_naming_the_field(shim) -> None:
    wizard = [{"role": "wizard", "content": "Hi"}]
    err = openai_error(post(shim, CHAT, json={"messages": wizard, "max_tokens": 1}), 400)
    assert err["param"] == "messages.0.role" and err["reason"] == "INVALID_ARGUMENT"
    assert all(f"'{role}'" in err["message"]
               for role in ("system", "developer", "user", "assistant", "tool"))
    err = workers_ai_error(post(shim, RUN, json={"messages": wizard, "max_tokens": 1}), 400)
    assert err["reason"] == "INVALID_ARGUMENT" and "role" in err["message"]
    for role in ("system", "developer", "user"):
        body = {"messages": [{"role": role, "content": "Hi"}], "max_tokens": 1}
        assert post(shim, CHAT, json=body).status_code == 200, role


def test_unimplemented_openai_option_is_refused_not_ignored(shim) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"1": 5}}
    assert openai_error(post(shim, CHAT, json=body), 400)["param"] == "logit_bias"


def test_value_that_does_not_fit_the_wire_is_400(shim) -> None:
    body = {"prompt": "Hi", "max_tokens": 2**40}  # past any context, as 2**20 is
    assert workers_ai_error(post(shim, RUN, json=body), 400)["reason"] == \
        "CONTEXT_LENGTH_EXCEEDED"
    body = {"prompt": "Hi", "seed": -1}
    assert workers_ai_error(post(shim, RUN, json=body), 400)["reason"] == "INVALID_ARGUMENT"


def test_lone_surrogate_in_a_prompt_is_400(shim) -> None:
    err = openai_error(post(shim, "/v1/completions", b'{"prompt": "\\ud800"}'), 400)
    assert "UTF-8" in err["message"] or "unicode" in err["message"]


def test_body_over_the_limit_is_413_with_or_without_content_length(shim) -> None:
    big = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    err = workers_ai_error(post(shim, RUN, big), 413)
    assert err["reason"] == "REQUEST_TOO_LARGE"

    def chunked():  # no content-length: the limit is enforced while reading
        yield big[: len(big) // 2]
        yield big[len(big) // 2:]

    assert openai_error(post(shim, "/v1/completions", chunked()), 413)["code"] == \
        "request_too_large"


def test_missing_or_malformed_auth_is_401_before_the_body_is_read(shim) -> None:
    for auth in ("", "Basic abc", "Bearer"):
        r = httpx.post(shim.url + CHAT, content=b"{not json", timeout=30,
                       headers={**JSON, "authorization": auth})
        assert openai_error(r, 401)["type"] == "authentication_error"


def test_unknown_route_and_wrong_method_keep_the_envelope(shim) -> None:
    r = httpx.get(shim.url + "/v1/nothing-here", headers=shim.headers(), timeout=30)
    assert openai_error(r, 404)["reason"] == "NOT_FOUND"
    r = httpx.get(shim.url + RUN, headers=shim.headers(), timeout=30)
    assert workers_ai_error(r, 405)["reason"] == "METHOD_NOT_ALLOWED"


def test_non_ascii_session_header_is_400(shim) -> None:
    r = httpx.post(shim.url + RUN, json={"prompt": "Hi", "max_tokens": 1}, timeout=30,
                   headers={**shim.headers(), "x-session-affinity": "caf\u00e9".encode()})
    assert workers_ai_error(r, 400)["reason"] == "INVALID_ARGUMENT"


SIZES = (1 << 10, 10 << 10, 100 << 10)


def _refusals(shim: Shim, **headers: str) -> set[tuple[int, str, str | None]]:
    """(status, reason, x-should-retry) of the same request on both route families."""
    out = set()
    for path, body in ((CHAT, {"messages": [{"role": "user", "content": "Hi"}]}),
                       (RUN, {"prompt": "Hi"})):
        r = httpx.post(shim.url + path, json={**body, "max_tokens": 1}, timeout=60,
                       headers=headers)
        error = r.json()["errors"][0] if path == RUN else r.json()["error"]
        out.add((r.status_code, error["reason"], r.headers.get("x-should-retry")))
    return out


def test_oversize_session_header_is_400_at_every_size(shim) -> None:
    for size in SIZES:
        assert _refusals(shim, **shim.headers(), **{"x-session-affinity": "s" * size}) == \
            {(400, "INVALID_ARGUMENT", None)}, size
    r = post(shim, CHAT, json={"messages": []}, **{"x-session-affinity": "s" * 300})
    assert openai_error(r, 400)["param"] == "x-session-affinity"


def test_oversize_api_key_is_401_at_every_size(shim) -> None:
    for size in SIZES:
        assert _refusals(shim, authorization="Bearer " + "k" * size) == \
            {(401, "UNAUTHENTICATED", None)}, size


def test_oversize_headers_together_are_431_at_every_size(shim) -> None:
    for size in (40 << 10, 100 << 10, 200 << 10):
        junk = {f"x-junk-{i}": "j" * 1000 for i in range(size // 1000)}
        assert _refusals(shim, **shim.headers(), **junk) == \
            {(431, "REQUEST_HEADER_FIELDS_TOO_LARGE", None)}, size


def test_validation_errors_name_fields_but_echo_no_value(shim) -> None:
    big = "v" * (16 << 10)
    for body in ({"messages": [{"role": "user", "content": "Hi"}], "n": big},
                 {"messages": [{"role": big}], big: 1, "stop": [big]},
                 {"messages": [{"role": "user", "content": big}], "stop": ["s"] * 17}):
        err = openai_error(post(shim, CHAT, json=body), 400)
        assert big[:100] not in err["message"] and len(err["message"]) <= 1024
        assert err["param"] in ("n", "messages.0.role", "messages.0.content", "stop")


def test_server_still_answers_after_bad_input(shim) -> None:
    r = post(shim, RUN, json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["success"] is True
