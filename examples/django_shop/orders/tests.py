"""The shop end to end: ``POST /orders/`` and ``POST /payments/`` through Django's test client, a
real Celery worker (threads, in this process) on the broker, PostgreSQL for the orders and
durable's tables.

``python manage.py test`` runs them on Django's test database (``test_<SHOP_DB_NAME>``), which
durable follows. They are ``DurableTransactionTestCase``s: each request really commits, as in
production (a ``TestCase`` would hide the runs from the worker in a transaction never
committed), and durable's connections are closed after each test, so Django can drop the test
database at the end.
"""

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest import mock

from django.conf import settings
from django.db import connection, connections
from django.http import HttpResponse
from django.test import Client, override_settings
from durable_celery import RunNotFound
from durable_celery.contrib.django.testing import DurableTransactionTestCase, release_durable_connections
from durable_celery.testing import wait_for, worker

from . import payments
from .models import Order, Shipment

ORDER = {"item": "mug", "quantity": "2", "payment_token": "tok_visa"}
PAYMENT = {"amount": 2500, "currency": "EUR", "card": "tok_visa"}


def backends() -> int:
    """Connections open on the test database now, this test's own included."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def backends_once_settled(expected: int, timeout: float = 5.0) -> int:
    """``backends()`` once it is down to ``expected``, or after ``timeout`` seconds: a server
    process outlives its closed connection for a moment (DROP DATABASE waits 5 s for it too)."""
    deadline = time.monotonic() + timeout
    while (found := backends()) > expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


class ShopTestCase(DurableTransactionTestCase):
    """What every test of the shop reads: the runs of ``fulfil`` and the messages queued."""

    def fulfil_runs(self) -> set[str]:
        """The ids of every run of ``fulfil`` in the database."""
        return {run.id for run in self.durable.list_runs(workflow="fulfil", limit=10_000)}

    def queued(self) -> int:
        """Messages waiting in the shop's queue, once this process sent what it queued."""
        self.assertTrue(self.durable.flush(timeout=10))
        app = self.durable.app
        with app.connection_for_read() as conn:
            return int(conn.default_channel.queue_declare(queue=app.conf.task_default_queue).message_count)


class PlaceOrderTests(ShopTestCase):
    """A placed order's run commits with the request, and a worker fulfils it."""

    def test_the_run_commits_with_the_request_and_a_worker_fulfils_the_order(self) -> None:
        response = self.client.post("/orders/", ORDER)
        self.assertEqual(response.status_code, 201, response.content)
        order_pk, run_id = response.json()["order"], response.json()["run"]
        order = Order.objects.get(pk=order_pk)
        self.assertEqual((order.run_id, order.payment, order.fulfilled), (run_id, f"PAY-{order_pk}", False))
        run = self.durable.get_run(run_id)  # committed with the order, by the request
        self.assertEqual((run.workflow, run.key, run.holds_key), ("fulfil", f"order:{order_pk}", True))

        with worker(self.durable):
            run = wait_for(self.durable, run_id, timeout=30)

        self.assertEqual(run.status, "completed", run.error)
        # The steps read the order through the ORM: the request had committed before they ran.
        shipped = {"tracking": f"TRK-{order_pk}", "capture": f"CAP-{order_pk}"}
        self.assertEqual(run.output, {"order": order_pk, "picked": "2 x mug", **shipped})
        self.assertTrue(Order.objects.get(pk=order_pk).fulfilled)
        self.assertEqual(Shipment.objects.filter(order=order_pk).count(), 1)
        detail = self.client.get(f"/orders/{order_pk}/").json()
        self.assertEqual((detail["fulfilled"], detail["run_status"]), (True, "completed"))


class ShipTests(ShopTestCase):
    """``ship`` is atomic: a try that fails after its writes keeps none of them."""

    def test_a_ship_try_that_fails_after_writing_keeps_nothing_and_the_retry_ships_once(self) -> None:
        placed = self.client.post("/orders/", ORDER).json()
        order_pk, run_id = placed["order"], placed["run"]
        keys: list[str] = []
        capture = payments.capture

        def answer_lost(order: Order, idempotency_key: str) -> str:
            """The first capture is taken, but its answer never reaches the shop."""
            keys.append(idempotency_key)
            captured = capture(order, idempotency_key)
            if len(keys) == 1:
                raise TimeoutError("the payment provider did not answer")
            return captured

        with mock.patch.object(payments, "capture", answer_lost), worker(self.durable):
            run = wait_for(self.durable, run_id, timeout=30)

        self.assertEqual(run.status, "completed", run.error)
        steps = [(step.name, step.attempt, step.status) for step in self.durable.list_steps(run_id)]
        self.assertEqual(steps, [("pick", 1, "completed"), ("ship", 1, "failed"), ("ship", 2, "completed")])
        # The failed try had created a shipment and marked the order: both were rolled back.
        self.assertEqual(Shipment.objects.filter(order=order_pk).count(), 1)
        # Both tries called the provider, with one key: it captured once.
        self.assertEqual(keys, [f"capture:{run_id}"] * 2)
        order = Order.objects.get(pk=order_pk)
        self.assertEqual((order.fulfilled, order.capture), (True, f"CAP-{order_pk}"))


class FailedRequestTests(ShopTestCase):
    """A request that fails leaves no order, no run and no message behind."""

    def test_a_declined_payment_after_the_start_rolls_the_run_back_and_sends_nothing(self) -> None:
        runs, queued = self.fulfil_runs(), self.queued()

        with self.assertLogs("django.request", "WARNING"):  # "Payment Required: /orders/"
            response = self.client.post("/orders/", {**ORDER, "payment_token": "tok_declined"})

        self.assertEqual(response.status_code, 402, response.content)
        self.assertFalse(Order.objects.exists())
        self.assertEqual(self.fulfil_runs(), runs)  # the run and its key claim went with the order
        self.assertEqual(self.queued(), queued)  # its message was never sent

    def test_an_error_after_the_start_rolls_the_run_back_and_sends_nothing(self) -> None:
        runs, queued = self.fulfil_runs(), self.queued()

        with (
            mock.patch.object(payments, "charge", side_effect=RuntimeError("provider down")),
            self.assertLogs("django.request", "ERROR"),  # Django's "Internal Server Error: /orders/"
            self.assertRaises(RuntimeError),
        ):
            self.client.post("/orders/", ORDER)

        self.assertFalse(Order.objects.exists())
        self.assertEqual(self.fulfil_runs(), runs)
        self.assertEqual(self.queued(), queued)

    def test_a_bad_form_starts_nothing(self) -> None:
        runs = self.fulfil_runs()

        with self.assertLogs("django.request", "WARNING"):  # "Bad Request: /orders/"
            response = self.client.post("/orders/", {**ORDER, "quantity": "0"})

        self.assertEqual(response.status_code, 400, response.content)
        self.assertIn("quantity", response.json()["errors"])
        self.assertEqual(self.fulfil_runs(), runs)


class ConnectionTests(ShopTestCase):
    """Many runs through a worker open a bounded number of connections and leave none behind."""

    RUNS = 20
    CONCURRENCY = 4

    def test_connections_stay_bounded_over_many_runs_and_none_is_left_behind(self) -> None:
        pool_size = settings.CELERY_DURABLE_POOL_SIZE
        self.assertEqual(self.durable.settings.pool_size, pool_size)
        # Durable's pool keeps pool_size connections and opens as many more at a peak (store/db.py);
        # Django opens one per thread that uses the ORM: this test's and each worker thread's.
        bound = 2 * pool_size + (1 + self.CONCURRENCY) + 2  # and a margin of 2
        peak, run_ids = backends(), []

        with worker(self.durable, concurrency=self.CONCURRENCY):
            for n in range(self.RUNS):
                response = self.client.post("/orders/", {**ORDER, "item": f"item-{n}"})
                self.assertEqual(response.status_code, 201, response.content)
                run_ids.append(response.json()["run"])
                peak = max(peak, backends())
            for run_id in run_ids:
                run = wait_for(self.durable, run_id, timeout=60)
                self.assertEqual(run.status, "completed", run.error)
                peak = max(peak, backends())

        self.assertLessEqual(peak, bound, f"{peak} connections at the peak, more than {bound}")
        self.assertEqual(Order.objects.filter(fulfilled=True).count(), self.RUNS)
        # What the test case does after each test: then only this test's own connection is left.
        self.assertTrue(release_durable_connections())
        self.assertEqual(backends_once_settled(1), 1)


class OrderDetailTests(ShopTestCase):
    """An unknown order, and an order without a run, answer plainly."""

    def test_an_unknown_order_is_404(self) -> None:
        with self.assertLogs("django.request", "WARNING"):  # "Not Found: /orders/999999/"
            self.assertEqual(self.client.get("/orders/999999/").status_code, 404)

    def test_a_run_that_is_gone_shows_no_status(self) -> None:
        order = Order.objects.create(item="mug", run_id="00000000-0000-0000-0000-000000000000")
        with self.assertRaises(RunNotFound):
            self.durable.get_run(order.run_id)
        self.assertIsNone(self.client.get(f"/orders/{order.pk}/").json()["run_status"])


@override_settings(PAYMENT_WAIT=10)  # a POST waits this long for its answer: ample for the worker
class PaymentTests(ShopTestCase):
    """``POST /payments/`` keyed by its Idempotency-Key: one run per key, and every repeat gets its answer."""

    def key(self) -> str:
        """An Idempotency-Key of this test's own: durable's runs outlive each test."""
        return f"pay-{uuid.uuid4().hex}"

    def pay(self, key: str | None, body: Any = PAYMENT, client: Client | None = None) -> HttpResponse:
        """``POST /payments/`` with ``body`` as JSON and ``key`` as its Idempotency-Key (None: no header)."""
        headers = {} if key is None else {"Idempotency-Key": key}
        client = client or self.client
        return client.post("/payments/", body, content_type="application/json", headers=headers)

    def runs_of(self, key: str) -> list[str]:
        """The ids of the runs of ``payment`` started with ``key``."""
        return [run.id for run in self.durable.list_runs(workflow="payment", key=key)]

    def race(self, key: str, bodies: list[dict[str, Any]]) -> list[HttpResponse]:
        """The responses to one request per body with ``key``, each from a thread, let go at once."""
        start = threading.Barrier(len(bodies))

        def post(body: dict[str, Any]) -> HttpResponse:
            """One client's request once every thread is ready; its thread's Django connections closed."""
            try:
                start.wait(timeout=10)
                return self.pay(key, body, client=Client())
            finally:
                connections.close_all()  # or Django could not drop the test database at the end

        with ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(post, bodies, timeout=60))

    def test_a_payment_is_201_and_a_repeat_gets_the_same_run_and_result(self) -> None:
        key = self.key()
        with worker(self.durable):
            first = self.pay(key)
            again = self.pay(key)
            reordered = self.pay(key, {"card": "tok_visa", "currency": "EUR", "amount": 2500})

        self.assertEqual(first.status_code, 201, first.content)
        answer = first.json()
        self.assertEqual((answer["status"], answer["result"]["amount"]), ("completed", 2500))
        self.assertTrue(answer["result"]["charge"].startswith("CH-"), answer)
        self.assertEqual((again.status_code, again.json()), (201, answer))
        self.assertEqual((reordered.status_code, reordered.json()), (201, answer))
        self.assertEqual(self.runs_of(key), [answer["run_id"]])

    def test_the_same_key_with_another_body_is_409_and_the_first_body_still_gets_its_answer(self) -> None:
        key = self.key()
        with worker(self.durable):
            first = self.pay(key)
            with self.assertLogs("django.request", "WARNING"):  # "Conflict: /payments/"
                amount = self.pay(key, {**PAYMENT, "amount": 3000})
                card = self.pay(key, {**PAYMENT, "card": "tok_other"})
            same = self.pay(key)

        self.assertEqual(first.status_code, 201, first.content)
        for conflict in (amount, card):
            self.assertEqual(conflict.status_code, 409, conflict.content)
            self.assertEqual(conflict.json()["run_id"], first.json()["run_id"])
            said = f"Idempotency-Key {key!r} was already used with another payment"
            self.assertEqual(conflict.json()["error"], said)
        self.assertEqual((same.status_code, same.json()), (201, first.json()))
        self.assertEqual(self.runs_of(key), [first.json()["run_id"]])

    def test_no_key_or_a_bad_body_is_400_and_starts_nothing(self) -> None:
        before = {run.id for run in self.durable.list_runs(workflow="payment", limit=10_000)}
        key = self.key()
        bad_bodies = [
            {**PAYMENT, "amount": "2500"},
            {**PAYMENT, "amount": True},
            {**PAYMENT, "amount": 0},
            {**PAYMENT, "amount": 25.0},
            {**PAYMENT, "currency": "eur"},
            {"amount": 2500, "currency": "EUR"},
            {**PAYMENT, "note": "gift"},
            [PAYMENT],
        ]

        with self.assertLogs("django.request", "WARNING"):  # "Bad Request: /payments/"
            no_key = [self.pay(None), self.pay(""), self.pay("x" * 256)]  # a key is at most 255 bytes
            bodies = [self.pay(key, body) for body in bad_bodies]
            not_json = self.client.post(
                "/payments/", "{", content_type="application/json", headers={"Idempotency-Key": key}
            )

        for response in no_key:
            self.assertEqual(response.status_code, 400, response.content)
            self.assertIn("Idempotency-Key", response.json()["error"])
        for response in [*bodies, not_json]:
            self.assertEqual(response.status_code, 400, response.content)
            self.assertEqual(response.json()["error"], "the body is not a payment")
        self.assertEqual(bodies[-2].json()["errors"], {"note": "is not a field of a payment"})
        self.assertEqual(set(bodies[-3].json()["errors"]), {"card"})
        self.assertEqual({run.id for run in self.durable.list_runs(workflow="payment", limit=10_000)}, before)

    def test_a_declined_payment_is_402_and_stays_so_for_its_key(self) -> None:
        key = self.key()
        with (
            self.assertLogs("celery.app.trace", "ERROR"),  # the worker's "raised unexpected: Declined(...)"
            worker(self.durable),  # stopped first: its tasks' logs are in by then
            self.assertLogs("django.request", "WARNING"),  # "Payment Required: /payments/"
        ):
            first = self.pay(key, {**PAYMENT, "card": payments.DECLINED})
            again = self.pay(key, {**PAYMENT, "card": payments.DECLINED})

        self.assertEqual(first.status_code, 402, first.content)
        declined = first.json()
        self.assertEqual((declined["status"], declined["error"]), ("failed", "the card was declined"))
        self.assertEqual((again.status_code, again.json()), (402, declined))  # reuse="never": no second try
        self.assertEqual(self.runs_of(key), [declined["run_id"]])

    @override_settings(PAYMENT_WAIT=0.5)
    def test_a_slow_payment_is_202_and_a_repeat_after_it_completed_is_201_with_the_same_run(self) -> None:
        key, slow = self.key(), {**PAYMENT, "card": payments.MUST_CONFIRM}
        with worker(self.durable):
            first = self.pay(key, slow)  # its run waits for the card holder's confirmation
            self.assertEqual(first.status_code, 202, first.content)
            run_id = first.json()["run_id"]
            self.assertIn(first.json()["status"], ("pending", "running", "waiting"))
            self.assertEqual(first["Location"], f"/payments/{run_id}/")
            polled = self.client.get(first["Location"])
            repeat = self.pay(key, slow)  # while the first request's run still goes
            confirmed = self.client.post(f"/payments/{run_id}/confirmation/")
            run = wait_for(self.durable, run_id, timeout=30)
            after = self.pay(key, slow)
            done = self.client.get(first["Location"])

        self.assertEqual((polled.status_code, polled.json()["run_id"]), (202, run_id))
        self.assertEqual((repeat.status_code, repeat.json()["run_id"]), (202, run_id))
        self.assertEqual(confirmed.status_code, 202, confirmed.content)
        self.assertEqual(run.status, "completed", run.error)
        self.assertEqual(after.status_code, 201, after.content)
        self.assertEqual(after.json(), {"run_id": run_id, "status": "completed", "result": run.output})
        self.assertEqual((done.status_code, done.json()), (200, after.json()))
        self.assertEqual(self.runs_of(key), [run_id])

    def test_an_unknown_payment_is_404(self) -> None:
        placed = self.client.post("/orders/", ORDER).json()  # a run, but of fulfil: no payment
        with self.assertLogs("django.request", "WARNING"):  # "Not Found: /payments/.../"
            for run_id in ("no-such-run", placed["run"]):
                self.assertEqual(self.client.get(f"/payments/{run_id}/").status_code, 404)
                self.assertEqual(self.client.post(f"/payments/{run_id}/confirmation/").status_code, 404)

    def test_two_requests_racing_with_one_key_make_one_run_and_both_name_it(self) -> None:
        with worker(self.durable):
            for _ in range(3):
                key = self.key()
                responses = self.race(key, [PAYMENT, PAYMENT])
                answers = [(response.status_code, response.json()) for response in responses]
                self.assertEqual([status for status, _ in answers], [201, 201], answers)
                self.assertEqual(answers[0], answers[1])
                self.assertEqual(self.runs_of(key), [answers[0][1]["run_id"]])

    def test_two_requests_racing_with_one_key_and_two_bodies_one_run_and_the_other_is_409(self) -> None:
        key = self.key()
        with worker(self.durable), self.assertLogs("django.request", "WARNING"):  # "Conflict"
            responses = self.race(key, [PAYMENT, {**PAYMENT, "amount": 3000}])

        made, conflict = sorted(responses, key=lambda response: response.status_code)
        self.assertEqual((made.status_code, conflict.status_code), (201, 409), [r.content for r in responses])
        self.assertEqual(conflict.json()["run_id"], made.json()["run_id"])
        self.assertEqual(self.runs_of(key), [made.json()["run_id"]])
