"""examples/fastapi_payments.py: idempotent payment requests on the async API, called through
httpx's ASGI transport, on PostgreSQL and Redis with a real Celery worker in the process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2 as httpx
import pytest

from durable_celery.testing import worker
from examples.fastapi_payments import CONFIRM_CARD, WORKFLOW, create_app, define_payments

pytestmark = pytest.mark.timeout(90)

Client = httpx.AsyncClient


@pytest.fixture(params=["postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def serve(durable: Any, scenario: Callable[[Client], Awaitable[Any]], wait: float = 10.0) -> Any:
    """Run ``scenario`` with a client of the payments app (POSTs wait up to ``wait`` seconds)
    while a worker runs the payments' steps."""
    define_payments(durable)

    async def main() -> Any:
        transport = httpx.ASGITransport(app=create_app(durable, wait=wait))
        async with httpx.AsyncClient(transport=transport, base_url="http://payments") as client:
            return await scenario(client)

    with worker(durable):
        return asyncio.run(main())


def payment(amount: int = 2500, card: str = "tok_visa") -> dict[str, Any]:
    return {"amount": amount, "currency": "EUR", "card": card}


async def pay(client: Client, key: str | None, body: dict[str, Any]) -> httpx.Response:
    return await client.post("/payments", json=body, headers={"Idempotency-Key": key} if key else {})


def runs_of(durable: Any, key: str) -> list[Any]:
    return list(durable.list_runs(workflow=WORKFLOW, key=key))


def test_a_payment_is_answered_201_and_a_repeat_gets_the_same_answer(durable: Any) -> None:
    async def scenario(client: Client) -> list[httpx.Response]:
        first = await pay(client, "k-1", payment())
        again = await pay(client, "k-1", payment())
        reordered = await client.post(  # the same body, its fields in another order
            "/payments",
            json={"card": "tok_visa", "currency": "EUR", "amount": 2500},
            headers={"Idempotency-Key": "k-1"},
        )
        return [first, again, reordered]

    first, again, reordered = serve(durable, scenario)
    assert first.status_code == 201, first.text
    body = first.json()
    assert body["status"] == "completed" and body["amount"] == 2500 and body["charge"].startswith("ch_")
    assert (again.status_code, again.json()) == (201, body)
    assert (reordered.status_code, reordered.json()) == (201, body)
    assert [run.id for run in runs_of(durable, "k-1")] == [body["run"]]


def test_the_same_key_with_another_body_is_409_and_no_key_is_400(durable: Any) -> None:
    async def scenario(client: Client) -> list[httpx.Response]:
        first = await pay(client, "k-2", payment(2500))
        return [
            first,
            await pay(client, "k-2", payment(3000)),
            await pay(client, "k-2", payment(2500, card="tok_other")),
            await pay(client, None, payment()),
            await pay(client, "", payment()),
            await pay(client, "x" * 256, payment()),  # a key is at most 255 bytes
            await pay(client, "k-2", payment(2500)),  # the first body still gets its answer
        ]

    first, amount, card, missing, empty, too_long, same = serve(durable, scenario)
    assert first.status_code == 201
    for response in (amount, card):
        assert response.status_code == 409, response.text
        assert response.json()["run"] == first.json()["run"] and "k-2" in response.json()["error"]
    for response in (missing, empty, too_long):
        assert response.status_code == 400 and "Idempotency-Key" in response.json()["error"]
    assert (same.status_code, same.json()) == (201, first.json())
    assert len(durable.list_runs(workflow=WORKFLOW)) == 1  # neither 409 nor 400 started a run


def test_a_declined_payment_is_402_and_stays_so_for_its_key(durable: Any) -> None:
    async def scenario(client: Client) -> list[httpx.Response]:
        return [await pay(client, "k-3", payment(card="tok_declined")) for _ in range(2)]

    first, again = serve(durable, scenario)
    assert first.status_code == 402 and first.json()["error"] == "the card was declined"
    assert (again.status_code, again.json()) == (402, first.json())  # reuse="never": no second charge
    assert len(runs_of(durable, "k-3")) == 1


def test_a_slow_payment_is_202_then_get_polls_it_and_a_repeat_gets_the_same_answer(durable: Any) -> None:
    async def scenario(client: Client) -> dict[str, Any]:
        seen: dict[str, Any] = {"post": await pay(client, "k-4", payment(4000, CONFIRM_CARD))}
        run_id = seen["post"].json()["run"]
        seen["get"] = await client.get(f"/payments/{run_id}")
        seen["repeat"] = await pay(client, "k-4", payment(4000, CONFIRM_CARD))  # still going: 202 too
        seen["unknown"] = await client.get("/payments/no-such-run")
        seen["confirm"] = await client.post(f"/payments/{run_id}/confirmation")
        deadline = time.monotonic() + 30
        while (done := await client.get(f"/payments/{run_id}")).status_code == 202:
            assert time.monotonic() < deadline, done.text
            await asyncio.sleep(0.05)
        seen["done"] = done
        seen["after"] = await pay(client, "k-4", payment(4000, CONFIRM_CARD))
        return seen

    seen = serve(durable, scenario, wait=0.5)
    post = seen["post"]
    assert post.status_code == 202 and post.json()["status"] in ("pending", "running", "waiting")
    run_id = post.json()["run"]
    assert seen["get"].status_code == 202 and seen["get"].json()["run"] == run_id
    assert seen["repeat"].status_code == 202 and seen["repeat"].json()["run"] == run_id
    assert seen["unknown"].status_code == 404
    assert seen["confirm"].status_code == 202
    done = seen["done"]
    assert done.status_code == 200 and done.json()["run"] == run_id and done.json()["amount"] == 4000
    assert (seen["after"].status_code, seen["after"].json()) == (201, done.json())
    assert len(runs_of(durable, "k-4")) == 1


def test_requests_racing_with_one_key_make_one_run_and_get_one_answer(durable: Any) -> None:
    async def scenario(client: Client) -> tuple[list[httpx.Response], list[httpx.Response]]:
        same = await asyncio.gather(*(pay(client, "k-5", payment(1200)) for _ in range(4)))
        other = await asyncio.gather(pay(client, "k-6", payment(1200)), pay(client, "k-6", payment(1300)))
        return list(same), list(other)

    same, other = serve(durable, scenario)
    assert [r.status_code for r in same] == [201] * 4, [r.text for r in same]
    assert all(r.json() == same[0].json() for r in same)
    assert [run.id for run in runs_of(durable, "k-5")] == [same[0].json()["run"]]
    # Racing with different bodies: whichever started the run gets 201, the other 409.
    assert sorted(r.status_code for r in other) == [201, 409], [r.text for r in other]
    assert len(runs_of(durable, "k-6")) == 1


def test_the_event_loop_answers_other_requests_while_a_payment_waits(durable: Any) -> None:
    async def scenario(client: Client) -> dict[str, float]:
        began = time.monotonic()
        took: dict[str, float] = {}

        async def timed(name: str, request: Awaitable[httpx.Response], status: int) -> None:
            response = await request
            assert response.status_code == status, response.text
            took[name] = time.monotonic() - began

        async def health_then_confirm() -> None:
            await asyncio.sleep(0.3)  # the payment's request is waiting by now
            await timed("health", client.get("/health"), 200)
            await asyncio.sleep(0.7)
            runs = await asyncio.to_thread(runs_of, durable, "k-7")
            await timed("confirm", client.post(f"/payments/{runs[0].id}/confirmation"), 202)

        await asyncio.gather(
            timed("payment", pay(client, "k-7", payment(card=CONFIRM_CARD)), 201), health_then_confirm()
        )
        return took

    took = serve(durable, scenario)
    # /health was answered at once, while the payment's request waited for its confirmation.
    assert took["health"] < 0.3 + 0.5 < took["confirm"] <= took["payment"], took
