"""The household's web page on `prima-ctl serve`: a chat over /v1/chat/completions and the ring, live.

The page (`/`) and its files (`/static/...`) are public, so a browser can load them and then ask for the
ring's token; the JSON endpoints below need the Bearer token exactly as the OpenAI API does:

    GET  /api/ring   every node in ring order, as `prima-ctl status --json` prints them (a ring that cannot
                     be walked: the head alone, when it answers, and the walk's error), and plain_chat: whether
                     the model has no chat template (a base model: the chat is plain completion)
    GET  /api/plan   the last prediction for the windows the ring holds now (none yet, or stale: null)
    POST /api/plan   profile the nodes and price those windows with the cost model: predicted vs measured TPOT
                     and the timeline picture (a PNG, base64)
"""

import asyncio
import base64
import tempfile
import time
from pathlib import Path

from aiohttp import web

from prima_rpc.app import ring
from prima_rpc.app.applied_plan import NOT_ASSIGNED, NoPlan, predict
from prima_rpc.app.status_rows import busy_words, ring_replans, status_row

STATIC = Path(__file__).parent / "static"


def is_public(request: web.Request) -> bool:
    """The page and its files: no token needed to load them (they hold no data)."""
    return request.path == "/" or request.path.startswith("/static/")


def walk_rows(head: str, token: str | None) -> dict:
    """{"nodes": [...], "replans": [...], "busy": str, "error": str | None}: every member in ring order with its
    state (lost ones marked), the live re-plans and, in words, which device is busy and whether the ring adapted;
    only when the asked node itself does not answer, no nodes and the error."""
    try:
        members = ring.status(head, token)
    except ring.RingError as exc:
        return {"nodes": [], "replans": [], "busy": "", "error": str(exc)}
    rows, replans = [status_row(*member) for member in members], ring_replans(members)
    return {"nodes": rows, "replans": replans, "busy": busy_words(rows, replans), "error": None}


def timeline_png(plan: dict) -> str:
    from solver.timeline import render  # matplotlib: only when a picture is asked for

    with tempfile.TemporaryDirectory() as tmp:
        return base64.b64encode(render(plan, Path(tmp) / "timeline.png", "the ring now").read_bytes()).decode()


class Page:
    def __init__(self, head: str, token: str | None):
        self.head, self.token = head, token
        self.prediction: dict | None = None  # the last POST /api/plan, with the windows it priced
        self.predicting = asyncio.Lock()  # one profiling of the ring at a time (profiles on shared cores disagree)
        self.plain: dict[str, bool] = {}  # model name -> whether it has no chat template (read once a model)

    async def index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def ring(self, request: web.Request) -> web.Response:
        rows = await asyncio.to_thread(walk_rows, self.head, self.token)
        return web.json_response({"head": self.head, "time": time.time(), **rows,
                                  "plain_chat": await self._plain_chat(rows)})

    async def _plain_chat(self, rows: dict) -> bool:
        """Whether the head's model has no chat template (its manifest, fetched once a model)."""
        head = rows["nodes"][0] if rows["nodes"] else None
        if not head or not head["model"]:
            return False
        if head["model"] not in self.plain:
            try:
                self.plain[head["model"]] = await asyncio.to_thread(ring.plain_chat, head["address"], self.token)
            except ring.RingError:
                return False  # asked again at the next poll
        return self.plain[head["model"]]

    def _current(self, rows: dict) -> dict | None:
        """The cached prediction while the ring still holds the windows it priced."""
        p = self.prediction
        return p if p and not rows["error"] and p["windows"] == [r["windows"] for r in rows["nodes"]] else None

    async def plan(self, request: web.Request) -> web.Response:
        rows = await asyncio.to_thread(walk_rows, self.head, self.token)
        head = rows["nodes"][0] if rows["nodes"] else None
        assigned = head and head["role"] == "head" and head["windows"]
        return web.json_response(self._answer(self._current(rows), rows, "" if assigned or not head else NOT_ASSIGNED))

    async def predict(self, request: web.Request) -> web.Response:
        async with self.predicting:
            rows = await asyncio.to_thread(walk_rows, self.head, self.token)
            try:
                plan = await asyncio.to_thread(predict, self.head, self.token)
                picture = await asyncio.to_thread(timeline_png, plan)
            except (NoPlan, ring.RingError) as exc:
                return web.json_response(self._answer(None, rows, str(exc)))
            self.prediction = {"plan": plan, "timeline_png": picture,
                               "windows": [r["windows"] for r in rows["nodes"]]}
            return web.json_response(self._answer(self.prediction, rows))

    def _answer(self, prediction: dict | None, rows: dict, reason: str = "") -> dict:
        head = rows["nodes"][0] if rows["nodes"] else None
        measured = head["last_token_ms"] if head and head["role"] == "head" and head["last_token_ms"] > 0 else None
        return {"plan": prediction and prediction["plan"], "timeline_png": prediction and prediction["timeline_png"],
                "predicted_tpot_ms": prediction and prediction["plan"]["predicted_tpot_ms"],
                "measured_tpot_ms": measured, "reason": reason or rows["error"] or ""}


def setup(app: web.Application, head: str, token: str | None) -> None:
    """Add the page's routes to the API's app."""
    page = Page(head, token)
    app.router.add_get("/", page.index)
    app.router.add_static("/static/", STATIC, append_version=False)
    app.router.add_get("/api/ring", page.ring)
    app.router.add_get("/api/plan", page.plan)
    app.router.add_post("/api/plan", page.predict)
