"""A mixed load on live gateways that records every answer, for the database-outage tests.

One thread identifies a photo of an enrolled person on each gateway in turn; another writes, alternating
between the gateways: it creates an identity and enrolls a face to it (every other identity is made by
its enroll, ``create=true``), and deletes every third identity it enrolled. Each answer is kept
(``Outcome``) so the test can check what was acknowledged against the database and the indexes afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:  # a pytest plugin: imported by pytest itself (tests.service.live_fixtures)
    from tests.service.live_fixtures import Live


@dataclass(frozen=True)
class Outcome:
    op: str  # identify, create, enroll, delete
    gateway: str
    target: str  # the identity's external id
    started: float  # time.monotonic()
    ended: float
    status: int  # 0: no HTTP answer (the error is in ``code``)
    code: str | None = None  # of an error body
    retry_after: str | None = None
    face_ids: tuple[int, ...] = ()
    decision: str | None = None  # identify: the first face's match

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class MixedLoad:
    gateways: Mapping[str, Live]
    collection: str
    probe: bytes  # identified throughout
    face: bytes  # enrolled to each new identity
    pause_s: float = 0.05
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for target in (self._identify, self._write):
            thread = threading.Thread(target=target, name=f"load-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        return list(self.outcomes)

    def since(self, moment: float, op: str | None = None) -> list[Outcome]:
        return [o for o in list(self.outcomes) if o.started >= moment and (op is None or o.op == op)]

    def _call(self, op: str, gateway: str, target: str, method: str, path: str,
              read: Callable[[Any], dict[str, Any]] = lambda _: {}, **kwargs: Any) -> Outcome:
        live = self.gateways[gateway]
        started = time.monotonic()
        try:
            response = httpx.request(method, live.base + f"/v1/collections/{self.collection}{path}",
                                     headers={"X-API-Key": live.admin_key}, timeout=60, **kwargs)
        except httpx.HTTPError as exc:
            outcome = Outcome(op, gateway, target, started, time.monotonic(), 0, repr(exc))
        else:
            body = response.json() if response.content else None
            ok = response.is_success
            outcome = Outcome(op, gateway, target, started, time.monotonic(), response.status_code,
                              None if ok or not isinstance(body, dict) else body.get("code"),
                              response.headers.get("retry-after"), **(read(body) if ok else {}))
        self.outcomes.append(outcome)
        return outcome

    def _identify(self) -> None:
        names = list(self.gateways)
        turn = 0
        while not self._stop.is_set():
            gateway, turn = names[turn % len(names)], turn + 1
            self._call("identify", gateway, "", "POST", "/identify", _decision,
                       files=[("image", ("probe.jpg", self.probe, "image/jpeg"))])
            self._stop.wait(self.pause_s)

    def _write(self) -> None:
        names = list(self.gateways)
        enrolled: list[str] = []
        number = 0
        while not self._stop.is_set():
            number += 1
            gateway, target = names[number % len(names)], f"p{number}"
            created = number % 2 == 0 or self._call("create", gateway, target, "POST", "/identities", json={
                "external_id": target, "name": f"Person {number}"}).ok  # every other one made by its enroll
            if created:
                face = self._call("enroll", gateway, target, "POST", f"/identities/{target}/faces", _faces,
                                  params={"create": "true"},
                                  files=[("images", ("face.jpg", self.face, "image/jpeg"))])
                if face.ok:
                    enrolled.append(target)
            if number % 3 == 0 and enrolled:
                gone = self._call("delete", gateway, enrolled[0], "DELETE", f"/identities/{enrolled[0]}")
                if gone.ok:
                    enrolled.pop(0)
            self._stop.wait(self.pause_s)


def _decision(body: dict[str, Any]) -> dict[str, Any]:
    faces = body["faces"]
    identity = faces[0]["identity"] if faces else None
    return {"decision": identity["external_id"] if identity else None}


def _faces(body: dict[str, Any]) -> dict[str, Any]:
    return {"face_ids": tuple(int(f["id"]) for f in body["faces"])}
