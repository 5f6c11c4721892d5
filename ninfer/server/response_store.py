"""The local Responses store: an in-process LRU of terminal Responses and their continuation context.

Each record keeps the public Response object, the request's own input Items (for input_items),
and the full context Item sequence a child continues from (history + input + output). Records
share their history tuples by reference with the parent they continued, so a child costs its own
new Items; the byte budget counts exactly that. Nothing survives a restart. Deleting or evicting a
record removes only the HTTP object: children already hold their context, and engine checkpoints
follow the engine's own retention.
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
    nbytes: int


def _size(obj: object) -> int:
    return len(dumps(obj))  # the bytes it takes on the wire


class ResponseStore:
    def __init__(self, max_records: int, max_mib: int):
        self.max_records = max_records
        self.max_bytes = max_mib * 1024 * 1024
        self._records: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def put(self, response: dict, input_items: tuple[dict, ...], history: tuple[dict, ...],
            preserve_thinking: bool | None, session_key: str | None) -> StoredResponse:
        """Store a terminal Response, evicting least-recently used records to make room."""
        output = tuple(response["output"])
        nbytes = _size(response) + _size(input_items)  # output Items are inside the response
        if nbytes > self.max_bytes or self.max_records == 0:
            raise ProtocolError("response_store_capacity_exceeded",
                                f"The Response needs {nbytes} bytes of local storage; the store holds at most "
                                f"{self.max_bytes} bytes and {self.max_records} records "
                                "(--response-store-max-mib, --response-store-max-records).", "store")
        rec = StoredResponse(response, input_items, history + input_items + output, preserve_thinking,
                             session_key, nbytes)
        rid = response["id"]
        self._drop(rid)
        while self._records and (len(self._records) >= self.max_records or self.nbytes + nbytes > self.max_bytes):
            self._drop(next(iter(self._records)))
        self._records[rid] = rec
        self.nbytes += nbytes
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
        if rec is not None:
            self.nbytes -= rec.nbytes


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
