"""The report of ``bench.peers``: medians over rounds, as Markdown tables, and the ratios."""

from __future__ import annotations

import os
from typing import Any

from bench.common import say
from bench.peers_measure import median
from bench.peers_systems import Spec

Results = dict[str, Any]


def _mid(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float:
    """The median of one figure over rounds."""
    return median([(row[key][sub] if sub else row[key]) for row in rows])


def _table(header: list[str], rows: list[list[str]]) -> None:
    """Print a Markdown table."""
    say("| " + " | ".join(header) + " |")
    say("|" + "---|" * len(header))
    for row in rows:
        say("| " + " | ".join(row) + " |")


def _x(value: float) -> str:
    """A ratio."""
    return "-" if value != value else f"{value:.2f}x"


def throughput_table(specs: list[Spec], results: Results) -> None:
    """Runs/s and CPU per run of every system, medians over rounds."""
    plain = results["throughput"].get("plain")
    base = _mid(plain, "rate") if plain else float("nan")
    rows = []
    for spec in specs:
        rounds = results["throughput"].get(spec.name)
        if not rounds:
            continue
        rate = _mid(rounds, "rate")
        cpu = [_mid(rounds, "cpu", part) for part in ("all", "workers", "producer", "postgres", "redis")]
        rows.append(
            [spec.label, f"{rate:.1f}", _x(rate / base)]
            + [f"**{cpu[0]:.2f}**"]
            + [f"{value:.2f}" if value else "-" for value in cpu[1:]]
        )
    _table(
        ["system", "runs/s", "vs plain", "CPU ms/run, all", "workers", "producer", "PostgreSQL", "Redis"],
        rows,
    )


def latency_table(specs: list[Spec], results: Results, rate: float, steps: int) -> None:
    """Start-to-first-step and step-to-step latency at one start rate."""
    rows = []
    for spec in specs:
        rounds = results["latency"].get((spec.name, rate, steps), [])
        measured = [row for row in rounds if "first_p50" in row]
        if not measured:
            skipped = next((row["skipped"] for row in rounds if "skipped" in row), None)
            if skipped:
                rows.append([spec.label, f"not run: {skipped}", "", "", "", "", "", "", "", ""])
            continue
        kept = sum(1 for row in measured if row["kept_up"])
        sent = [row for row in measured if row["sent_p50"] is not None]
        in_task = [row for row in measured if row.get("task_p50") is not None]
        rows.append(
            [
                spec.label,
                f"**{_mid(measured, 'first_p50'):.1f}**",
                f"{_mid(measured, 'first_p99'):.1f}",
                f"{_mid(measured, 'call_p50'):.1f}",
                f"{_mid(sent, 'sent_p50'):.1f}" if sent else "-",
                f"{_mid(measured, 'after_p50'):.1f}",
                f"{_mid(in_task, 'task_p50'):.2f}" if in_task else "-",
                f"{_mid(measured, 'cpu', 'all'):.2f}",
                f"{_mid(measured, 'step_p50'):.1f} / {_mid(measured, 'step_p99'):.1f}" if steps > 1 else "-",
                f"{_mid(measured, 'achieved'):.0f}/s; {_mid(measured, 'worked'):.0f}/s;"
                f" {kept} of {len(measured)}",
            ]
        )
    _table(
        [
            "system",
            "start to 1st step p50 ms",
            "p99 ms",
            "start call p50",
            "message sent p50",
            "handed over to 1st step p50",
            "of it, task began to 1st step p50",
            "CPU ms/run",
            "step to step p50 / p99",
            "started; worked; rounds kept up",
        ],
        rows,
    )


def keyed_table(specs: list[Spec], results: Results) -> None:
    """Keyed starts/s against the bare insert."""
    bare = results["bare"]
    base = _mid(bare, "rate")
    rows = [["bare INSERT + COMMIT", f"{base:.0f}", "1.00x", f"{_mid(bare, 'p50'):.2f}", "", ""]]
    for spec in specs:
        rounds = results["keyed"].get(spec.name)
        if not rounds:
            continue
        rate = _mid(rounds, "rate")
        rows.append(
            [
                spec.label,
                f"**{rate:.0f}**",
                _x(rate / base),
                f"{_mid(rounds, 'p50'):.2f}",
                f"{_mid(rounds, 'p99'):.2f}",
                f"{_mid(rounds, 'cpu'):.2f}",
            ]
        )
    _table(["keyed start", "starts/s", "vs bare", "call p50 ms", "p99 ms", "producer CPU ms/start"], rows)


def ratios(specs: list[Spec], results: Results, rates: list[tuple[float, int]]) -> None:
    """Durable against each other system: runs/s, CPU per run, latency, keyed starts."""
    ours = results["throughput"].get("durable")
    if not ours:
        return
    for spec in specs:
        theirs = results["throughput"].get(spec.name)
        if spec.name == "durable" or not theirs:
            continue
        parts = [
            f"runs/s {_x(_mid(ours, 'rate') / _mid(theirs, 'rate'))}",
            f"CPU per run {_x(_mid(ours, 'cpu', 'all') / _mid(theirs, 'cpu', 'all'))}",
        ]
        for rate, steps in rates:
            a = [r for r in results["latency"].get(("durable", rate, steps), []) if "first_p50" in r]
            b = [r for r in results["latency"].get((spec.name, rate, steps), []) if "first_p50" in r]
            if a and b:
                parts.append(
                    f"start to 1st step at {rate:g}/s{' (one step)' if steps == 1 else ''}"
                    f" p50 {_x(_mid(a, 'first_p50') / _mid(b, 'first_p50'))},"
                    f" p99 {_x(_mid(a, 'first_p99') / _mid(b, 'first_p99'))}"
                )
        keyed = results["keyed"]
        if keyed.get(spec.name) and keyed.get("durable"):
            parts.append(
                f"keyed starts/s {_x(_mid(keyed['durable'], 'rate') / _mid(keyed[spec.name], 'rate'))}"
            )
        say(f"- durable vs {spec.label}: " + "; ".join(parts))


def report(
    specs: list[Spec], results: Results, facts: dict[str, Any], rates: list[tuple[float, int]]
) -> None:
    """Print everything measured."""
    say("")
    say(
        f"bench.peers on {os.cpu_count()} CPUs ({facts['cpu']});"
        f" {facts['rounds']} interleaved rounds, medians;"
        f" load average {facts['load_start']} at the start, {facts['load_end']} at the end"
    )
    say("versions: " + ", ".join(f"{name} {version}" for name, version in facts["versions"].items()))
    say(f"settings: {facts['settings']}")
    for spec, reason in facts["skipped"]:
        say(f"skipped {spec.label}: {reason}")
    say("")
    say(
        f"throughput: {facts['runs']} three-step runs per system per round,"
        f" started from {facts['threads']} threads"
    )
    throughput_table(specs, results)
    for rate, steps in rates:
        say("")
        kind = "three-step" if steps == 3 else "one-step"
        say(
            f"latency at a steady {rate:g} starts/s of {kind} runs,"
            f" {facts['latency_runs']} runs per system per round"
        )
        latency_table(specs, results, rate, steps)
    if results["bare"]:
        say("")
        say(f"keyed starts, one producer thread, {facts['keyed']} new keys per system per round")
        keyed_table(specs, results)
    say("")
    ratios(specs, results, rates)
