"""The local Responses store: an in-process LRU of terminal Responses and their continuation context.

Each record keeps the public Response object, the request's own input Items (for input_items),
and the full context Item sequence a child continues from (history + input + output). Records
share their Items by reference with the parent they continued. The byte budget counts what the
records hold: each record's envelope, and each distinct Item once while any record holds it — so
a child whose ancestors were evicted or deleted is still charged for the history it keeps alive.
Nothing survives a restart. Deleting or evicting a record removes only the HTTP object: children
already hold their context, and engine checkpoints follow the engine's own retention.
"""

from __future__ import annotations

import collections

import attrs

from ninfer.server.http import dumps
from protocols.errors import ProtocolError


@attrs.frozen
class StoredResponse:
    response: dict
    input_items: tuple[dict, ...]
    context: tuple[dict, ...]  # history + input Items + output Items: what a child continues from
    preserve_thinking: bool | None  # resolved value a child inherits when it omits the field
    session_key: str | None  # engine-local reuse key shared by the whole previous_response_id chain
    envelope_bytes: int  # the Response object without its output Items (those are in ``context``)


def _size(obj: object) -> int:
    return len(dumps(obj))  # the bytes it takes on the wire


class ResponseStore:
    def __init__(self, max_records: int, max_mib: int):
        self.max_records = max_records
        self.max_bytes = max_mib * 1024 * 1024
        self._records: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._items: dict[int, list] = {}  # id(Item) -> [records holding it, its bytes, the Item]
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def put(self, response: dict, input_items: tuple[dict, ...], history: tuple[dict, ...],
            preserve_thinking: bool | None, session_key: str | None) -> StoredResponse:
        """Store a terminal Response, evicting least-recently used records to make room."""
        context = history + input_items + tuple(response["output"])
        envelope = _size({**response, "output": []})
        nbytes = envelope + sum(self._item_bytes(it) for it in context)  # what it holds on its own
        if nbytes > self.max_bytes or self.max_records == 0:
            raise ProtocolError("response_store_capacity_exceeded",
                                f"The Response needs {nbytes} bytes of local storage; the store holds at most "
                                f"{self.max_bytes} bytes and {self.max_records} records "
                                "(--response-store-max-mib, --response-store-max-records).", "store")
        rec = StoredResponse(response, input_items, context, preserve_thinking, session_key, envelope)
        rid = response["id"]
        self._drop(rid)
        self._records[rid] = rec
        self._hold(rec)
        # Then the least recently used others go; the new record fits alone, so it is never dropped.
        while len(self._records) > self.max_records or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._records)))
        return rec

    def get(self, rid: str) -> StoredResponse:
        rec = self._records.get(rid)
        if rec is None:
            raise ProtocolError("response_not_found", f"No stored Response with id '{rid}' (never stored, "
                                "stored with store:false, evicted, or deleted).", "response_id")
        self._records.move_to_end(rid)
        return rec

    def delete(self, rid: str) -> None:
        self.get(rid)
        self._drop(rid)

    def _drop(self, rid: str) -> None:
        rec = self._records.pop(rid, None)
        if rec is None:
            return
        self.nbytes -= rec.envelope_bytes
        for it in rec.context:
            held = self._items[id(it)]
            held[0] -= 1
            if held[0] == 0:
                del self._items[id(it)]
                self.nbytes -= held[1]

    def _hold(self, rec: StoredResponse) -> None:
        self.nbytes += rec.envelope_bytes
        for it in rec.context:
            held = self._items.get(id(it))
            if held is None:  # the Item itself is kept in the entry, so its id is never reused meanwhile
                held = self._items[id(it)] = [0, _size(it), it]
                self.nbytes += held[1]
            held[0] += 1

    def _item_bytes(self, item: dict) -> int:
        held = self._items.get(id(item))
        return held[1] if held is not None else _size(item)


def page(items: tuple[dict, ...], *, after: str | None, limit: int, order: str) -> dict:
    """One input_items page: Items after the id ``after`` in ``order``, at most ``limit``."""
    seq = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [it["id"] for it in seq]
        if after not in ids:
            raise ProtocolError("invalid_value", f"Invalid value for 'after': no input Item with id '{after}'.",
                                "after")
        seq = seq[ids.index(after) + 1:]
    data = seq[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(seq) > limit}
