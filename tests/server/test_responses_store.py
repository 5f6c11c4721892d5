"""The local Responses store: LRU by records and bytes, capacity failure, deletion, input_items pages."""

from __future__ import annotations

import pytest

from ninfer.server.http import dumps
from ninfer.server.response_store import ResponseStore, page
from protocols.errors import ProtocolError


def resp(rid: str, text: str = "x") -> dict:
    return {"id": rid, "object": "response", "output": [{"type": "message", "id": "msg_" + rid, "content": text}]}


def items(*ids: str) -> tuple[dict, ...]:
    return tuple({"type": "message", "id": i, "role": "user", "content": "q"} for i in ids)


def test_lru_by_records_and_recency():
    store = ResponseStore(max_records=2, max_mib=1)
    store.put(resp("a"), items("i1"), (), None, "resp:a")
    store.put(resp("b"), items("i2"), (), None, None)
    store.get("a")  # a is now the most recently used
    store.put(resp("c"), items("i3"), (), None, None)
    with pytest.raises(ProtocolError) as e:
        store.get("b")
    assert e.value.code == "response_not_found" and e.value.status == 404
    assert store.get("a").session_key == "resp:a" and len(store) == 2


def test_byte_budget_evicts_and_single_oversize_fails():
    store = ResponseStore(max_records=100, max_mib=1)
    big = "y" * (400 * 1024)
    for rid in "abc":
        store.put(resp(rid, big), (), (), None, None)
    assert len(store) == 2 and store.nbytes <= 1024 * 1024  # the oldest left to make room
    with pytest.raises(ProtocolError) as e:
        store.put(resp("huge", "z" * (1024 * 1024)), (), (), None, None)
    assert e.value.code == "response_store_capacity_exceeded" and e.value.status == 400
    assert len(store) == 2  # nothing was evicted for a Response that can never fit
    with pytest.raises(ProtocolError):
        ResponseStore(max_records=0, max_mib=1).put(resp("a"), (), (), None, None)


def test_context_chains_survive_parent_deletion():
    store = ResponseStore(max_records=10, max_mib=1)
    parent = store.put(resp("p"), items("i1"), (), True, "resp:p")
    child = store.put(resp("c"), items("i2"), parent.context, parent.preserve_thinking, parent.session_key)
    assert [i["id"] for i in child.context] == ["i1", "msg_p", "i2", "msg_c"]
    assert child.input_items == items("i2") and child.preserve_thinking is True
    store.delete("p")
    with pytest.raises(ProtocolError):
        store.get("p")
    assert store.get("c").context == child.context  # the descendant keeps its full context
    with pytest.raises(ProtocolError):
        store.delete("p")


def test_input_items_pages():
    its = items("a", "b", "c", "d")
    assert [i["id"] for i in page(its, after=None, limit=20, order="desc")["data"]] == ["d", "c", "b", "a"]
    p = page(its, after="b", limit=1, order="asc")
    assert [i["id"] for i in p["data"]] == ["c"] and p["has_more"] and (p["first_id"], p["last_id"]) == ("c", "c")
    p = page(its, after="a", limit=5, order="desc")
    assert p == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
    with pytest.raises(ProtocolError) as e:
        page(its, after="zz", limit=5, order="asc")
    assert e.value.param == "after"


def test_history_a_child_keeps_alive_is_charged_once():
    store = ResponseStore(max_records=2, max_mib=1)
    page_kb = "q" * (60 * 1024)
    rec = store.put(resp("r0", page_kb), (), (), None, None)
    for n in range(1, 8):  # a chain: each child holds every ancestor's Items, evicted or not
        rec = store.put(resp(f"r{n}", page_kb), (), rec.context, None, None)
    held = {id(it): it for r in (store.get("r6"), store.get("r7")) for it in r.context}
    items_bytes = sum(len(dumps(it)) for it in held.values())
    assert len(store) == 2 and items_bytes <= store.nbytes <= 1024 * 1024  # shared Items once, none missed
    stored = ["r6", "r7"]
    for n in range(8, 20):  # until the chain's own context no longer fits the budget
        try:
            rec = store.put(resp(f"r{n}", page_kb), (), rec.context, None, None)
        except ProtocolError as e:
            assert e.code == "response_store_capacity_exceeded"
            break
        stored.append(f"r{n}")
    else:
        raise AssertionError("a chain of 1.2 MB fit a 1 MiB store")
    assert store.nbytes <= 1024 * 1024
    for rid in stored[-2:]:
        store.delete(rid)
    assert store.nbytes == 0 and len(store) == 0
