"""Every ``celery -A app durable ...`` command turns a database it cannot use into one line and
a fix, exit 1; ``--traceback`` shows the whole traceback instead."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.conftest import PG_HOST

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
PASSWORD = "hunter2"
USER_AT = f"postgres:{PASSWORD}@"
HOST = PG_HOST.split("@", 1)[1]  # host:port of the test server
COMMANDS = [["runs"], ["status"], ["show", "00000000-0000-0000-0000-000000000000"]]


@pytest.fixture
def cli(tmp_path):
    """Run ``celery -A errapp durable ...`` with the app's Durable on ``url``."""
    (tmp_path / "errapp.py").write_text(
        textwrap.dedent("""
        import os
        from celery import Celery
        from durable_celery import Durable
        app = Celery("errapp", broker="redis://127.0.0.1:1/0")
        durable = Durable(app, os.environ["ERRAPP_URL"], upkeep=False)
    """)
    )
    (tmp_path / "bareapp.py").write_text('from celery import Celery\napp = Celery("bareapp")\n')
    base = {k: v for k, v in os.environ.items() if k != "CELERY_APP"}
    base["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"

    def run(url, *args, app="errapp"):
        env = {**base, "ERRAPP_URL": url}
        given = ["-A", app] if app else []
        return subprocess.run(
            [sys.executable, "-m", "celery", *given, "durable", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd=tmp_path,
        )

    return run


@pytest.fixture
def empty_db():
    """A database that exists but was never migrated, dropped at the end."""
    name = f"durable_t_empty_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield name
    with psycopg.connect(f"{PG_HOST}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def with_password(url: str) -> str:
    """``url`` (of the test server) with the password ``hunter2`` set."""
    scheme, rest = url.split("://", 1)
    rest = rest.split("@", 1)[1]
    return f"{scheme}://{USER_AT}{rest}"


def assert_short(done, *expected):
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert PASSWORD not in out
    lines = out.strip().splitlines()
    assert 1 <= len(lines) <= 2, out
    assert lines[0].startswith(("durable: ", "schema: ")), out
    for text in expected:
        assert text in out, out
    return lines


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_nothing_listening(cli, command):
    url = f"postgresql://{USER_AT}127.0.0.1:1/nowhere"
    lines = assert_short(cli(url, *command), "postgres:***@127.0.0.1:1/nowhere", "Connection refused")
    assert lines[1].startswith("fix: check that the server is running")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_wrong_user(cli, command):
    user = f"nobody_{uuid.uuid4().hex[:6]}"
    url = f"postgresql://{user}:{PASSWORD}@{HOST}/postgres"
    lines = assert_short(cli(url, *command), f"{user}:***@{HOST}/postgres")
    assert lines[1].startswith("fix: check the user and password")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_database_that_does_not_exist(cli, command):
    url = with_password(f"{PG_HOST}/no_such_db_{uuid.uuid4().hex[:6]}")
    lines = assert_short(cli(url, *command), "does not exist", "***@")
    assert lines[1].startswith("fix: create that database")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_unmigrated_database(cli, empty_db, command):
    done = cli(f"{PG_HOST}/{empty_db}", *command)
    assert_short(done, f"{HOST}/{empty_db}", "`celery -A errapp durable migrate`")
    if command == ["status"]:  # status checks the schema first and says how far behind it is
        assert done.stdout.startswith("schema: ") and "revision(s) behind at postgresql" in done.stdout
    else:
        assert f"{HOST}/{empty_db} has no durable schema" in done.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_traceback_before_or_after_the_command(cli, command):
    url = f"postgresql://{USER_AT}127.0.0.1:1/nowhere"
    for args in (["--traceback", *command], [*command, "--traceback"]):
        done = cli(url, *args)
        assert done.returncode == 1
        assert done.stderr.startswith("Traceback (most recent call last):"), done.stderr
        assert "DatabaseUnavailable" in done.stderr and PASSWORD not in done.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_mistyped_scheme(cli, command):
    """The app's module still loads (the URL is checked at first use): one line says what is
    wrong with the URL, password masked."""
    done = cli(f"postgresq://{USER_AT}{HOST}/x", *command)
    assert done.returncode == 1
    out = done.stdout + done.stderr
    assert PASSWORD not in out and len(out.strip().splitlines()) <= 2, out
    assert out.startswith("durable: unknown database scheme 'postgresq' in postgresq://postgres:***@"), out
    assert "use postgresql://user:password@host:port/dbname or sqlite:///" in out
    assert "Traceback" not in out


def test_without_a_durable(cli):
    done = cli("unused", "runs", app=None)
    assert done.returncode == 1
    assert done.stderr.strip() == "durable: no -A given: run `celery -A yourmodule durable runs ...`"
    done = cli("unused", "status", app="bareapp")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "durable: the app given with -A has no Durable(app); create one in its module"
    )


def test_usage_errors_stay_click_s(cli):
    done = cli("unused", "runs", "--no-such-option", app="bareapp")
    assert done.returncode == 2 and "No such option" in done.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_database_durable_does_not_keep_runs_in(cli, command):
    """A MySQL URL (its dialect exists, its driver may not) is refused in one line, on every
    command alike, before any driver is imported."""
    done = cli(f"mysql://root:{PASSWORD}@127.0.0.1/shop", *command)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "durable: durable keeps its runs in PostgreSQL or SQLite, not mysql "
        "(mysql://root:***@127.0.0.1/shop); use postgresql://user:password@host:port/dbname or sqlite:///path/to/file.sqlite3"
    ]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_sslmode_require_on_a_server_without_ssl_names_the_right_fix(cli, command):
    done = cli(f"{PG_HOST}/postgres?sslmode=require", *command)
    lines = assert_short(done, "server does not support SSL")
    assert lines[1].startswith("fix: the server accepts no SSL connections")


def test_the_python_api_refuses_a_mysql_url_in_one_line():
    from celery import Celery

    from durable_celery import Durable
    from durable_celery.errors import InvalidDefinition

    with pytest.raises(
        InvalidDefinition, match=r"^durable keeps its runs in PostgreSQL or SQLite, not mysql"
    ):
        Durable(Celery("mysqlapp", broker="memory://"), "mysql://u:p@db/x", upkeep=False).list_runs()
