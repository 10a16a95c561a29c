"""Idempotent payments over HTTP: FastAPI, an ``Idempotency-Key`` header and the async API.

``POST /payments`` starts a run of the ``payments`` workflow keyed by the request's
``Idempotency-Key`` (``astart``) and waits a few seconds for its answer (``aresult``): 201 with
the charge, or 202 with the run's id while it still goes (``GET /payments/{run_id}`` polls). A
repeat with the same key and body gets the same answer, even while the first request's run still
goes: the start is refused with the key's holder (``on_duplicate="error"``, ``KeyTaken``), whose
``input_changed`` tells a repeat from another request with the same key, which gets 409; no key,
400. The event loop stays free while requests wait: the waits are futures settled by durable's
one answers thread, the database work runs in threads.

``create_app(durable)`` builds the web app for a ``Durable`` whose ``payments`` workflow
``define_payments(durable)`` defined; in production that is a module both the web processes
(``uvicorn``) and the Celery workers import. Run as a program, it tells the story on the
in-memory store with a real Celery worker in this process, calling the app through httpx's ASGI
transport:

    python -m examples.fastapi_payments
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Annotated, Any

from celery import Celery
from fastapi import APIRouter, FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from durable_celery import (
    Durable,
    InvalidKey,
    KeyTaken,
    ResultTimeout,
    Run,
    RunCancelled,
    RunFailed,
    RunNotFound,
    current_run,
)
from durable_celery.testing import worker

WORKFLOW = "payments"
WAIT = 3.0  # seconds a POST waits for the answer before it answers 202
CONFIRM_CARD = "tok_3ds"  # a card whose holder must confirm the payment in their bank's app
DECLINED_CARD = "tok_declined"


class Payment(BaseModel):
    """A payment request's body."""

    amount: int = Field(gt=0, description="in the currency's minor unit: 2500 is 25.00")
    currency: str = Field(pattern="^[A-Z]{3}$")
    card: str = Field(min_length=1, max_length=64)


class CardDeclined(Exception):
    """The bank said no."""


def define_payments(durable: Durable) -> Any:
    """The ``payments`` workflow: authorize (the card holder may have to confirm), then capture."""
    # reuse="never": a key answers with its run for as long as the run is kept, its failure
    # included; after_close (the default) would let a repeat after the end charge again.
    payments = durable.workflow(WORKFLOW, reuse="never", idempotency="required")

    @payments.step
    def authorize(amount: int, currency: str, card: str) -> None:
        if card == DECLINED_CARD:
            raise CardDeclined("the card was declined")
        if card == CONFIRM_CARD:  # the run parks, holding no worker, until the bank calls back
            if not current_run().wait_for_event("confirmed", timeout=900, timeout_value=False):
                raise CardDeclined("the card holder did not confirm")
            print("  the bank says: confirmed")

    @payments.step
    def capture(amount: int, currency: str, card: str) -> dict[str, Any]:
        # The bank is given the run's id as its own idempotency key: a retried step charges once.
        charge = "ch_" + hashlib.sha256(current_run().id.encode()).hexdigest()[:16]
        print(f"  step ran: capture {amount / 100:.2f} {currency}")
        return {"charge": charge, "amount": amount, "currency": currency}

    return payments


router = APIRouter()


def create_app(durable: Durable, wait: float = WAIT) -> FastAPI:
    """The payments API on ``durable`` (whose ``payments`` workflow is defined); a POST waits
    up to ``wait`` seconds for the payment's answer."""
    api = FastAPI(title="payments")
    api.state.durable, api.state.wait = durable, wait
    api.include_router(router)
    return api


@router.post("/payments")
async def pay(
    request: Request, payment: Payment, idempotency_key: Annotated[str | None, Header()] = None
) -> JSONResponse:
    """Start the payment keyed by the request's Idempotency-Key, and answer when it ends or
    after a few seconds (202); a repeat of the key gets the first request's run."""
    durable = request.app.state.durable
    if not idempotency_key:
        return JSONResponse({"error": "an Idempotency-Key header is required"}, status_code=400)
    body = payment.model_dump()
    try:
        # The key's row decides, inside the start's transaction: of requests racing with one key,
        # one makes the run; every other is refused, told the holder and whether its body differs
        # from the holder's input (JSON equality), for a holder still going or ended alike.
        run_id = await durable.astart(WORKFLOW, body, key=idempotency_key, on_duplicate="error")
    except KeyTaken as taken:
        if taken.input_changed:
            message = f"Idempotency-Key {idempotency_key} was used with another request"
            return JSONResponse({"error": message, "run": taken.holder_id}, status_code=409)
        run_id = taken.holder_id  # the same request again: the first one's answer
    except InvalidKey as exc:  # longer than 255 bytes, say
        return JSONResponse({"error": f"Idempotency-Key: {exc}"}, status_code=400)
    return await answer(durable, run_id, request.app.state.wait, done=201)


@router.get("/payments/{run_id}")
async def payment_status(request: Request, run_id: str) -> JSONResponse:
    """The payment's answer now: 200 (or 402) once it has ended, else 202."""
    durable = request.app.state.durable
    run = await payment_run(durable, run_id)
    if run is None:
        return JSONResponse({"error": f"no payment {run_id}"}, status_code=404)
    if not run.finished:  # no wait: the client polls
        return JSONResponse({"run": run_id, "status": run.status}, status_code=202)
    return await answer(durable, run_id, 0, done=200)


@router.post("/payments/{run_id}/confirmation")
async def confirm(request: Request, run_id: str) -> JSONResponse:
    """The bank's call back (a real one checks the bank's signature): the card holder
    confirmed. Kept if the run is not waiting for it yet."""
    durable = request.app.state.durable
    if await payment_run(durable, run_id) is None:
        return JSONResponse({"error": f"no payment {run_id}"}, status_code=404)
    await asyncio.to_thread(durable.send_event, run_id, "confirmed", True, True)
    return JSONResponse({"run": run_id}, status_code=202)


@router.get("/health")
async def health() -> dict[str, bool]:
    """Answered at once, however many payment requests wait."""
    return {"ok": True}


async def payment_run(durable: Durable, run_id: str) -> Run | None:
    """The run of the payments workflow with that id, or None."""
    try:
        run = await durable.aget_run(run_id)
    except RunNotFound:
        return None
    return run if run.workflow == WORKFLOW else None


async def answer(durable: Durable, run_id: str, wait: float, done: int) -> JSONResponse:
    """The run's answer within ``wait`` seconds: ``done`` with its output, 402 if it failed or
    was cancelled, or 202 with its id while it goes on."""
    try:
        output = await durable.aresult(run_id, timeout=wait)
    except ResultTimeout as late:
        return JSONResponse({"run": run_id, "status": late.status}, status_code=202)
    except RunFailed as failed:
        body = {"run": run_id, "status": failed.status, "error": failed.error_message}
        return JSONResponse(body, status_code=402)
    except RunCancelled as cancelled:
        return JSONResponse(
            {"run": run_id, "status": "cancelled", "error": cancelled.reason}, status_code=402
        )
    return JSONResponse({"run": run_id, "status": "completed", **output}, status_code=done)


def said(response: Any) -> str:
    """A response in a few words: its status code and what it says."""
    data = response.json()
    if "amount" in data:
        return (
            f"{response.status_code} {data['status']}, charged {data['amount'] / 100:.2f} {data['currency']}"
        )
    if response.status_code == 202:
        return "202, not finished yet"
    return f"{response.status_code} {data.get('error') or data['status']}"


async def story(durable: Durable) -> None:
    """The requests of the README's story, through httpx's ASGI transport."""
    import httpx2 as httpx

    transport = httpx.ASGITransport(app=create_app(durable))
    async with httpx.AsyncClient(transport=transport, base_url="http://payments") as client:

        async def pay(key: str | None, amount: int, card: str = "tok_visa") -> Any:
            headers = {"Idempotency-Key": key} if key else {}
            body = {"amount": amount, "currency": "EUR", "card": card}
            return await client.post("/payments", json=body, headers=headers)

        first = await pay("order-1001", 2500)
        print("POST /payments, key order-1001:", said(first))
        again = await pay("order-1001", 2500)
        print(f"the same request again: {said(again)}, the same charge: {again.json() == first.json()}")
        print("the same key, 30.00 EUR:", said(await pay("order-1001", 3000)))
        print("no Idempotency-Key:", said(await pay(None, 2500)))
        print("a declined card, key order-1002:", said(await pay("order-1002", 900, "tok_declined")))
        slow = await pay("order-1003", 4000, CONFIRM_CARD)
        print("a card whose holder must confirm, key order-1003:", said(slow))
        run_id = slow.json()["run"]
        print("GET /payments/{run}:", said(await client.get(f"/payments/{run_id}")))
        print("the card holder confirms in their bank's app")
        await client.post(f"/payments/{run_id}/confirmation")
        print("the client sends it again:", said(await pay("order-1003", 4000, CONFIRM_CARD)))
        print("GET /payments/{run}:", said(await client.get(f"/payments/{run_id}")))
    runs = await asyncio.to_thread(durable.list_runs, WORKFLOW)
    print(f"runs of {WORKFLOW}: {len(runs)}, for 7 requests with 3 keys")


def main() -> None:
    app = Celery("payments")  # no broker set: the memory store brings Celery's memory:// broker
    durable = Durable(app, "memory://")
    define_payments(durable)
    with worker(durable):
        asyncio.run(story(durable))


if __name__ == "__main__":
    main()
