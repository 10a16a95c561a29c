"""``python -m durable_celery``: commands that need no Celery app, such as the demo."""

from __future__ import annotations

import click


@click.group()
def main() -> None:
    """durable_celery: durable, keyed workflows for Celery.

    The commands that work on your own app live under `celery -A yourapp durable ...`.
    """


@main.command(short_help="Run the shop example with no servers.")
@click.option(
    "--timeout",
    default=30.0,
    show_default=True,
    help="Seconds to wait for each run before giving up.",
)
def demo(timeout: float) -> None:
    """Run the shop example on the embedded default (SQLite and a serverless broker; no servers).

    It runs durable_celery.demo_shop in a temporary directory, from any folder.
    """
    from .demo import run_demo

    run_demo(timeout=timeout)


if __name__ == "__main__":
    main(prog_name="python -m durable_celery")
