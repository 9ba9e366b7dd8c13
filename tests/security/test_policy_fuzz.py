"""Hostile input to the verifier's own inputs: the policy file parser and the evidence parser.

``load_policy(path)`` gets random TOML documents (random keys, and random types and values for each
known field, including huge integers, NaN and infinities, nested tables, dates), random text and
random bytes: it returns a ``Policy`` or raises ``ConfigError``, never anything else.
``Evidence.from_dict`` gets random dicts (and non-dicts): ``Evidence`` or ``AttestationError`` only.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputravel.core.attestation import CCMode, Evidence, Policy, load_policy
from gputravel.core.errors import AttestationError, ConfigError

FIELDS = ("firmware", "driver", "code", "allowed_modes", "max_report_age_s", "token_ttl_s")
HEX = "e6a67ab531c766ba5af043628272121ee821b4364c757086a93ed1ff84e7ce98"
VALID = {"firmware": HEX, "driver": HEX, "code": "auto", "allowed_modes": ["on"], "max_report_age_s": 60,
         "token_ttl_s": 3600}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# --- a small TOML writer (values of every TOML type) -------------------------------------------------
def toml_key(key: str) -> str:
    return key if key and all(c.isascii() and (c.isalnum() or c in "-_") for c in key) else toml_str(key)


def toml_str(s: str) -> str:
    out = []
    for ch in s:
        o = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\u{o:04x}")
        elif 0xD800 <= o <= 0xDFFF:  # a lone surrogate cannot be written; TOML cannot hold it either
            out.append("?")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return toml_str(v)
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def toml_doc(d: dict[str, Any]) -> str:
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in d.items())


scalars = st.one_of(
    st.booleans(), st.integers(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([10**400, -(10**400), 2**1024, 2**64, 0, -1]),  # tomllib reads integers of any size
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=80),
    st.sampled_from([HEX, HEX.upper(), HEX[:-1], "auto", "AUTO", "on", "off", "devtools", "", "0" * 64]),
    st.datetimes(), st.dates(), st.times(),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
keys = st.one_of(st.sampled_from(FIELDS), st.text(min_size=1, max_size=12))


def check_policy_file(path: Path, text: str | bytes) -> None:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        policy = load_policy(path)
    except ConfigError:
        return
    assert isinstance(policy, Policy)
    assert all(isinstance(m, CCMode) for m in policy.allowed_modes)
    assert math.isfinite(policy.max_report_age_s) and policy.max_report_age_s > 0
    assert math.isfinite(policy.token_ttl_s) and policy.token_ttl_s > 0


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("policy") / "policy.toml"


def test_the_valid_policy_parses(policy_path: Path) -> None:
    policy_path.write_text(toml_doc(VALID))
    assert load_policy(policy_path).allowed_modes == (CCMode.ON,)


@FUZZ
@given(doc=st.dictionaries(keys, values, max_size=8))
def test_random_toml_documents_raise_only_config_error(policy_path: Path, doc: dict[str, Any]) -> None:
    check_policy_file(policy_path, toml_doc(doc))


@FUZZ
@given(field=st.sampled_from(FIELDS), value=values, drop=st.sets(st.sampled_from(FIELDS), max_size=2))
def test_each_field_with_random_type_and_value_raises_only_config_error(policy_path: Path, field: str, value: Any,
                                                                        drop: set[str]) -> None:
    doc = {k: v for k, v in VALID.items() if k not in drop}
    doc[field] = value
    text = toml_doc(doc)
    tomllib.loads(text)  # the writer made valid TOML: the parser, not the writer, is under test
    check_policy_file(policy_path, text)


@FUZZ
@given(field=st.sampled_from(["max_report_age_s", "token_ttl_s"]),
       value=st.one_of(st.integers(), st.sampled_from([10**400, -(10**400), 2**1024, 2**63, 0]), st.floats(),
                       st.booleans()))
def test_numeric_fields_with_extreme_numbers_raise_only_config_error(policy_path: Path, field: str,
                                                                     value: Any) -> None:
    check_policy_file(policy_path, toml_doc({**VALID, field: value}))


@FUZZ
@given(text=st.one_of(st.text(max_size=300), st.binary(max_size=300),
                      st.builds(lambda d, junk: toml_doc(d) + junk, st.dictionaries(keys, values, max_size=4),
                                st.text(max_size=20))))
def test_random_text_and_bytes_raise_only_config_error(policy_path: Path, text: str | bytes) -> None:
    check_policy_file(policy_path, text)


def test_a_missing_or_unreadable_policy_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_policy(tmp_path / "absent.toml")
    with pytest.raises(ConfigError):
        load_policy(tmp_path)  # a folder


# --- Evidence.from_dict ------------------------------------------------------------------------------
def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40),
              st.binary(max_size=16).map(b64)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10)
evidence_keys = st.one_of(st.sampled_from(["report", "signature", "chain_pem"]), st.text(max_size=10))


def check_evidence(data: Any) -> None:
    try:
        evidence = Evidence.from_dict(data)
    except AttestationError:
        return
    assert isinstance(evidence, Evidence)
    assert isinstance(evidence.report, bytes) and isinstance(evidence.signature, bytes)
    assert all(isinstance(c, bytes) for c in evidence.chain_pem)
    assert Evidence.from_dict(json.loads(json.dumps(evidence.to_dict()))) == evidence


@FUZZ
@given(data=st.dictionaries(evidence_keys, json_values, max_size=5))
def test_random_dicts_raise_only_attestation_error(data: dict[str, Any]) -> None:
    check_evidence(data)


@FUZZ
@given(report=json_values, signature=json_values,
       chain=st.one_of(json_values, st.lists(st.one_of(st.binary(max_size=32).map(b64), json_values), max_size=4)))
def test_evidence_shaped_dicts_with_random_values_raise_only_attestation_error(report: Any, signature: Any,
                                                                               chain: Any) -> None:
    check_evidence({"report": report, "signature": signature, "chain_pem": chain})


@FUZZ
@given(data=st.one_of(json_values, st.binary(), st.tuples(st.integers()), st.frozensets(st.integers())))
def test_non_dicts_raise_only_attestation_error(data: Any) -> None:
    check_evidence(data)
